"""Stop checks run after every appended output token."""

from __future__ import annotations

from kvflow.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int) -> bool:
    """Set the request's finished status and return True if its latest token ends it.

    Order: length limits (max_tokens, max_model_len) first; below `min_tokens` nothing else stops it; then EOS
    (unless `ignore_eos`) and stop token ids (`stop_reason` records which).
    """
    if request.num_output_tokens >= request.max_tokens or request.num_tokens >= max_model_len:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    params = request.sampling_params
    if request.num_output_tokens < params.min_tokens:
        return False
    last_token_id = request.output_token_ids[-1]
    if not params.ignore_eos and last_token_id == request.eos_token_id:
        request.status = RequestStatus.FINISHED_STOPPED
        return True
    if params.stop_token_ids and last_token_id in params.stop_token_ids:
        request.status = RequestStatus.FINISHED_STOPPED
        request.stop_reason = last_token_id
        return True
    return False
