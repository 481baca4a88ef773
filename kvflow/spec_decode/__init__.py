"""Speculative decoding: cheap drafts of the next tokens, verified by the target model in one step.

    proposer.py           `Proposer`, the interface every proposer implements (`LookupProposer`: per-request
                          lookup without a model), and `Proposal`
    ngram.py              `NgramProposer`: prompt lookup, drafts copied from the request's own earlier tokens
    draft_model.py        `DraftModelProposer`: drafts from a smaller model, run beside the target with its own KV cache
    rejection_sampler.py  the lossless acceptance rules: `rejection_sample` (drafts with a proposal distribution)
                          and `accept_point_mass_drafts` (n-gram drafts, whose proposal is a point mass)
    runner.py             `SpecDecodeRunner`: the worker's side of drafts (writing them into the token buffers,
                          verifying them, proposing the next ones) and `SpecStep`, one step's verification plan
    metrics.py            `SpecDecodingStats`: drafts, drafted and accepted tokens, acceptance per position

Proposers are registered in `SPEC_PROPOSERS` (the one registry shape; the names are the `method` values of
`speculative_config`) and imported only when looked up, so `kvflow.config` can check a method name without
importing numpy or torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvflow.registry import LazyRegistry

if TYPE_CHECKING:
    from kvflow.spec_decode.proposer import Proposer

SPEC_PROPOSERS: LazyRegistry[type[Proposer]] = LazyRegistry(
    "speculative proposer",
    {
        "ngram": "kvflow.spec_decode.ngram:NgramProposer",
        "draft_model": "kvflow.spec_decode.draft_model:DraftModelProposer",
    },
)

__all__ = ["SPEC_PROPOSERS"]
