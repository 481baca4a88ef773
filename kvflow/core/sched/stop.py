"""Stop checks run after every appended output token."""

from __future__ import annotations

from kvflow.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int) -> bool:
    """Set the request's finished status and return True if its latest token ends it.

    Order (vLLM's): once `min_tokens` are out, EOS (unless `ignore_eos`) and stop token ids (`stop_reason`
    records which) come first, so a request whose last allowed token is EOS or a stop token finishes "stop", not
    "length"; then the length caps (`max_tokens`, `max_model_len`). Below `min_tokens` only the length caps can
    end it (`min_tokens <= max_tokens`, but `max_model_len` may come first).

    Runs once per output token, so it is one flat function (no helper calls).
    """
    params = request.sampling_params
    num_output_tokens = request.num_output_tokens
    if num_output_tokens >= params.min_tokens:
        stop_token_ids = params.stop_token_ids
        if not params.ignore_eos or stop_token_ids:
            last_token_id = request.output_token_ids[-1]
            if not params.ignore_eos and last_token_id == request.eos_token_id:
                request.status = RequestStatus.FINISHED_STOPPED
                return True
            if stop_token_ids and last_token_id in stop_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = last_token_id
                return True
    if num_output_tokens >= params.max_tokens or request.num_tokens >= max_model_len:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False
