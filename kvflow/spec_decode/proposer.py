"""The proposer interface: what the worker and `SpecDecodeRunner` ask of every speculative-decoding proposer.

    Proposer        the base: set-up (`load`, `kv_cache_bytes_per_block`, `make_kv_cache`) and `propose_batch`
    LookupProposer  a proposer that drafts each request from its own tokens (`propose`), with no model and no KV
    DraftBatch      what one `propose_batch` call is asked: the slots to draft for and the slots to catch up
    Proposal        one request's drafts and, for drafts drawn from a distribution, that distribution

Proposers are looked up by method name in `kvflow.spec_decode.SPEC_PROPOSERS` and built with the
`SpeculativeConfig`; the worker then calls `load`, sizes the KV cache with `kv_cache_bytes_per_block`, and the
runner calls `make_kv_cache` once and `propose_batch` after every step that sampled.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    import numpy as np
    import torch

    from kvflow.config import EngineConfig
    from kvflow.worker.states import RequestSlots


@dataclasses.dataclass(frozen=True)
class DraftBatch:
    """One step's request to a proposer, after the target sampled.

    `max_drafts` (slot -> room) names the slots to draft for, each at most `room` drafts (its room before
    `max_model_len`); `catch_up` (slot -> end) names every slot the step computed and how many of its leading
    positions the target has K/V for (a proposer with a KV cache brings its own to that point; it is empty for the
    others); both in batch order. `slots` holds the requests' tokens: slot i's known tokens are
    `token_ids[i, :num_tokens[i]]`.
    """

    slots: RequestSlots
    max_drafts: dict[int, int]
    catch_up: dict[int, int]
    eos_token_id: int | None


@dataclasses.dataclass
class Proposal:
    """One request's drafts and, for a sampled request's draft-model drafts, the distribution each was drawn from
    ([len(token_ids), vocab]; None: the drafts are point masses, verified by `accept_point_mass_drafts`)."""

    token_ids: list[int]
    draft_probs: torch.Tensor | None = None


class Proposer(ABC):
    """A speculative-decoding proposer: drafts up to `num_speculative_tokens` next tokens per request.

    Invariants: `propose_batch` reads a slot's tokens `token_ids[i, :num_tokens[i]]` and may write past
    `num_tokens[i]` (uncommitted positions) but never commits tokens; a proposal never holds more than the
    `max_drafts` it was asked for; `kv_cache_bytes_per_block(b)` is what each KV block of `b` tokens costs the
    proposer on top of the target (0 for a proposer without a KV cache of its own).
    """

    # Whether the proposer runs a model with a KV cache of its own (the worker sizes it by
    # `kv_cache_bytes_per_block`; only such a proposer is sent `DraftBatch.catch_up`, which costs a pass over the
    # step's rows to build).
    needs_kv_cache: ClassVar[bool] = False
    num_speculative_tokens: int

    def load(
        self, engine_config: EngineConfig, device: torch.device, target_vocab_size: int
    ) -> None:
        """Build what the proposer runs on `device` (nothing by default); a proposer that cannot serve the
        target (another vocabulary, too short a context) raises ValueError naming `speculative_config`."""
        del engine_config, device, target_vocab_size

    @abstractmethod
    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        """Bytes of the proposer's own KV cache per block of `block_size` tokens (0: none)."""

    def make_kv_cache(self, num_blocks: int, block_size: int) -> None:
        """Allocate the proposer's KV cache: the target's block count and block size (nothing by default)."""
        del num_blocks, block_size

    @abstractmethod
    def propose_batch(self, batch: DraftBatch) -> dict[int, Proposal]:
        """Drafts for the slots of `batch.max_drafts`, after each slot's known tokens. Returns proposals by slot
        (a slot may be missing: no draft)."""


class LookupProposer(Proposer):
    """A proposer that drafts each request from its own known tokens (`propose`): no model, no KV cache."""

    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        return 0

    @abstractmethod
    def propose(self, token_ids: np.ndarray, max_drafts: int) -> list[int]:
        """Up to `max_drafts` draft tokens to follow `token_ids` (a request's known tokens)."""

    def propose_batch(self, batch: DraftBatch) -> dict[int, Proposal]:
        """`propose` for each slot of `batch.max_drafts`, over its known tokens."""
        slots = batch.slots
        return {
            index: Proposal(
                self.propose(slots.token_ids[index, : int(slots.num_tokens[index])], room)
            )
            for index, room in batch.max_drafts.items()
        }
