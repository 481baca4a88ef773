"""Speculative decoding: cheap drafts of the next tokens, verified by the target model in one step.

    ngram.py              `NgramProposer`: prompt lookup, drafts copied from the request's own earlier tokens
    draft_model.py        `DraftModelProposer`: drafts from a smaller model, run beside the target with its own KV cache
    rejection_sampler.py  the lossless acceptance rules: `rejection_sample` (drafts with a proposal distribution)
                          and `accept_point_mass_drafts` (n-gram drafts, whose proposal is a point mass)
    metrics.py            `SpecDecodingStats`: drafts, drafted and accepted tokens, acceptance per position

Proposers are registered in `SPEC_PROPOSERS` (the one registry shape; the names are the `method` values of
`speculative_config`) and imported only when looked up, so `kvflow.config` can check a method name without
importing numpy or torch.
"""

from __future__ import annotations

from kvflow.registry import LazyRegistry

SPEC_PROPOSERS: LazyRegistry[type] = LazyRegistry(
    "speculative proposer",
    {
        "ngram": "kvflow.spec_decode.ngram:NgramProposer",
        "draft_model": "kvflow.spec_decode.draft_model:DraftModelProposer",
    },
)

__all__ = ["SPEC_PROPOSERS"]
