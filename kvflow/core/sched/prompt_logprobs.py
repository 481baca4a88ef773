"""Logprobs on their way out: a batch row's sampled-token logprobs, and the prompt-logprob rows each request holds
until its first output token carries them (rows may repeat after a preemption; each row goes out once)."""

from __future__ import annotations

from kvflow.core.sched.output import LogprobsLists
from kvflow.request import Request


def logprobs_rows(
    logprobs: LogprobsLists, index: int, num_new_tokens: int, row_starts: list[int] | None
) -> LogprobsLists | None:
    """The batch row's logprobs for the tokens kept (a stop may have cut the step's tokens short): its one row,
    or with drafts (`row_starts`) its first `num_new_tokens` rows."""
    start = index if row_starts is None else row_starts[index]
    if num_new_tokens == 0 or start >= logprobs.num_rows or not logprobs.logprob_token_ids[start]:
        return None
    end = start + (1 if row_starts is None else num_new_tokens)
    return LogprobsLists(
        logprobs.logprob_token_ids[start:end],
        logprobs.logprobs[start:end],
        logprobs.sampled_token_ranks[start:end],
    )


def receive_prompt_logprobs(
    requests: dict[str, Request], prompt_logprobs_dict: dict[str, LogprobsLists]
) -> None:
    """Hold each request's new prompt-logprob rows until its first output token carries them out.

    Rows may come in a step that samples nothing (a partial prefill), and for a request preempted since the
    step was planned; a request recomputing its prompt sends rows again, which are dropped. Cost: O(rows).
    """
    for request_id, rows in prompt_logprobs_dict.items():
        request = requests.get(request_id)
        if request is None or request.is_finished() or request.num_output_tokens:
            continue
        request.prompt_logprobs_rows = extend_prompt_logprobs(
            request.prompt_logprobs_rows, rows, request.prompt_token_ids
        )


def extend_prompt_logprobs(
    held: LogprobsLists | None, rows: LogprobsLists, prompt_token_ids: list[int]
) -> LogprobsLists | None:
    """`held` (the rows of prompt tokens 1..k, or None) extended by the rows of `rows` past token k.

    Rows it repeats (a recompute after a preemption) are dropped. E.g., held 1..6 and rows 5..8 -> held 1..8.
    `rows` are ignored when they cannot continue `held`: they start past token k + 1 or are not the logprobs of
    this prompt's tokens. Both happen only when the request id was reused while a step of its finished namesake
    was in flight; rows of the same tokens at the same positions are the same logprobs, whoever computed them.
    """
    next_index = 1 if held is None else held.start_index + held.num_rows
    num_repeated = next_index - rows.start_index
    new_token_ids = rows.logprob_token_ids[max(num_repeated, 0) :]
    if num_repeated < 0 or not new_token_ids:
        return held
    prompt_tokens = prompt_token_ids[next_index : next_index + len(new_token_ids)]
    if [token_ids[0] for token_ids in new_token_ids] != prompt_tokens:
        return held
    if num_repeated == 0 and held is None:
        return rows
    if held is None:
        held = LogprobsLists([], [], [], start_index=next_index)
    held.logprob_token_ids += new_token_ids
    held.logprobs += rows.logprobs[num_repeated:]
    held.sampled_token_ranks += rows.sampled_token_ranks[num_repeated:]
    return held
