"""Speculative decoding on the scheduler's side: which of the runner's drafts a request's next step verifies, and
the rollback over the drafts a step rejected.

Invariant: a request never verifies more drafts than `max_drafts` allows, so a step cannot pass `max_tokens` or
`max_model_len` even if every draft and every placeholder in flight becomes a token.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvflow.request import Request, RequestStatus

if TYPE_CHECKING:
    from kvflow.core.sched.output import ModelRunnerOutput
    from kvflow.spec_decode.metrics import SpecDecodingStats


def max_drafts(request: Request, max_model_len: int) -> int:
    """The most drafts `request`'s next step may verify without passing `max_tokens` or `max_model_len`, even
    if every draft and every placeholder in flight becomes a token (a step yields one more than it verifies)."""
    room = min(
        request.max_tokens - request.num_output_tokens,
        max_model_len - request.num_tokens,
    )
    return max(room - request.num_output_placeholders - 1, 0)


def cut_drafts(request: Request, drafts: list[int], max_model_len: int) -> list[int]:
    """The runner's `drafts` that `request`'s next step may verify: within `max_drafts`, and for a constrained
    request the prefix its grammar accepts."""
    drafts = drafts[: max_drafts(request, max_model_len)]
    so_request = request.structured_output_request
    if drafts and so_request is not None:
        # Drafts the constraint refuses would be rejected anyway: they are not verified at all.
        drafts = drafts[: so_request.valid_draft_prefix(drafts)]
    return drafts


def roll_back_rejected(
    request: Request,
    num_drafts: int,
    num_generated: int,
    index: int,
    outcome: ModelRunnerOutput,
    spec_decoding_stats: SpecDecodingStats | None,
) -> None:
    """A step verified `num_drafts` drafts of `request` and produced `num_generated` tokens (the accepted drafts
    and one more): the rejected drafts' positions were computed for nothing, so `num_computed_tokens` rolls
    back over them (their KV is overwritten later; no block holding them was hashed, since blocks are cached
    only over known tokens). E.g., 10 tokens, 9 computed, drafts [a, b, c]: 4 scheduled, 13 computed; a
    accepted, b rejected -> 2 generated, 2 rejected, 11 computed (the 10 tokens and a; the new 12th is next).
    The statistics count the worker's real drafts (`ModelRunnerOutput.num_real_drafts` at row `index` of
    `outcome`: with async scheduling, draft slots the worker had no draft for are padding, not drafts).
    """
    num_rejected = num_drafts + 1 - num_generated
    if request.status == RequestStatus.RUNNING:
        request.num_computed_tokens -= num_rejected
    if spec_decoding_stats is not None:
        real = outcome.num_real_drafts[index] if outcome.num_real_drafts else num_drafts
        if real:
            spec_decoding_stats.observe_draft(real, min(num_generated - 1, real))
