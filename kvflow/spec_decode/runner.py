"""The worker's side of speculative decoding, beside the model runner: drafts in, verification, drafts out.

Each step the model runner hands its batch to `SpecDecodeRunner.write`, which puts the scheduled drafts into the
token buffers and returns a `SpecStep` (the rows that verify them); after sampling, `verify` runs
`rejection_sample` for drafts that came with their distribution, `accept` keeps each request's accepted drafts and
the token after them, and `propose` asks the `Proposer` for the next step's drafts.

Invariants:
  * `slot_drafts[i]` / `slot_draft_probs[i]` are what the proposer drafted for the request in slot i after its
    latest sampled step (empty / None once it takes the slot, and for a step that proposed nothing for it);
  * drafts are written past a slot's `num_tokens` and stay uncommitted until `accept` appends the accepted ones;
  * verification is exact whatever proposed the drafts: point masses (`accept_point_mass_drafts`) for drafts
    without a distribution, padded ones and requests asking for logprobs; `rejection_sample` for the others.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvflow.core.sched.output import DRAFT_PLACEHOLDER, LogprobsLists
from kvflow.spec_decode.proposer import DraftBatch
from kvflow.spec_decode.rejection_sampler import accept_point_mass_drafts, rejection_sample
from kvflow.worker.sampler import build_sampling_metadata, mix_seed

if TYPE_CHECKING:
    from kvflow.spec_decode.proposer import Proposer
    from kvflow.worker.sampler import Sampler
    from kvflow.worker.states import RequestSlots

logger = logging.getLogger(__name__)

# Mixed into a seeded request's seed for the uniforms that accept or reject its drafts (`rejection_sample`), so
# they never reuse the streams its tokens are sampled from.
_VERIFY_SEED_SALT = 0x766572696679  # "verify"


@dataclass(frozen=True)
class SpecStep:
    """What one step's verification needs: the drafts written for it and the sampled rows that verify them.

    Invariants: a batch row verifying d drafts (`drafts[row]`, padding included) has d + 1 consecutive sampled
    rows, in batch order; sampled row i belongs to batch row `sampled_rows[i]`, samples the token after that
    row's first `sample_offsets[i]` drafts, from the logits of flat batch token `logits_indices[i]`;
    `num_real_drafts[row]` (rows with placeholder slots only) counts the drafts that are the worker's own, the
    rest being padding; `draft_probs[row]` ([d, V]) is the distribution a row's drafts were drawn from, for the
    rows `rejection_sample` verifies (the others are point masses).
    """

    slot_indices: np.ndarray  # [num_reqs] slot of each batch row
    drafts: dict[int, list[int]]
    num_real_drafts: dict[int, int]
    draft_probs: dict[int, torch.Tensor]
    sampled_rows: np.ndarray  # [num_sampled]
    sample_offsets: np.ndarray  # [num_sampled]
    logits_indices: np.ndarray  # [num_sampled]

    def real_draft_counts(self, num_reqs: int) -> list[int] | None:
        """Each batch row's real drafts (`ModelRunnerOutput.num_real_drafts`), or None when none was padded."""
        if not self.num_real_drafts:
            return None
        return [
            self.num_real_drafts.get(row, len(self.drafts.get(row, ()))) for row in range(num_reqs)
        ]


class SpecDecodeRunner:
    """Owns the worker's drafts: each slot's latest proposal, and one step's verification (`SpecStep`)."""

    def __init__(
        self,
        proposer: Proposer,
        slots: RequestSlots,
        *,
        block_size: int,
        num_blocks: int,
        eos_token_id: int | None,
        disable_by_batch_size: int | None = None,
    ) -> None:
        self.proposer = proposer
        self.slots = slots
        self.block_size = block_size
        self.eos_token_id = eos_token_id
        # A step with at least this many requests proposes no drafts (None: always propose); logged per switch.
        self.disable_by_batch_size = disable_by_batch_size
        self._switched_off = False
        self.slot_drafts: list[list[int]] = [[] for _ in range(slots.max_num_reqs)]
        self.slot_draft_probs: list[torch.Tensor | None] = [None] * slots.max_num_reqs
        proposer.make_kv_cache(num_blocks, block_size)

    def forget_slot(self, index: int) -> None:
        """Slot `index` has a new holder: drafts proposed for the previous one are not its."""
        self.slot_drafts[index] = []
        self.slot_draft_probs[index] = None

    # ------------------------------------------------------------------------------------------ write
    def write(
        self,
        req_ids: list[str],
        slot_indices: np.ndarray,
        spec_decode_tokens: dict[str, list[int]],
        sampled_rows: np.ndarray,
        logits_indices: np.ndarray,
    ) -> SpecStep | None:
        """Put each request's drafts in its token buffer right after its known tokens, where this step reads them
        (they stay uncommitted: `num_tokens` does not move until `accept`), and plan their verification from the
        step's one-per-request `sampled_rows` / `logits_indices`. None when no request verifies drafts.

        The scheduler's ids are used as sent; `DRAFT_PLACEHOLDER` slots (planned while the step that proposed
        them was in flight) take the worker's own drafts, and slots beyond those are padded with token 0: a
        padded draft is verified like any other, and accepting it when sampled is exact too (a point-mass draft
        is accepted with the probability the model gives it, whoever chose it)."""
        if not spec_decode_tokens:
            return None
        slots = self.slots
        drafts: dict[int, list[int]] = {}
        num_real: dict[int, int] = {}
        draft_probs: dict[int, torch.Tensor] = {}
        for row, req_id in enumerate(req_ids):
            request_drafts = spec_decode_tokens.get(req_id)
            if not request_drafts:
                continue
            index = int(slot_indices[row])
            own = self.slot_drafts[index][: len(request_drafts)]
            if DRAFT_PLACEHOLDER in request_drafts:
                num_real[row] = len(own)
                request_drafts = own + [0] * (len(request_drafts) - len(own))
            probs = self.slot_draft_probs[index]
            params = slots.sampling_params[index]
            # A request asking for logprobs verifies its drafts as point masses (exact too, if accepted less
            # often): each token it emits is then a verification row's sample, whose logprobs that row holds.
            wants_logprobs = params is not None and params.logprobs is not None
            if probs is not None and not wants_logprobs and request_drafts[: len(own)] == own:
                draft_probs[row] = _pad_point_masses(probs[: len(own)], request_drafts[len(own) :])
            start = int(slots.num_tokens[index])
            slots.token_ids[index, start : start + len(request_drafts)] = request_drafts
            drafts[row] = request_drafts
        if not drafts:
            return None
        # A request verifying d drafts samples d + 1 rows, from its last d + 1 scheduled tokens.
        # E.g., sampled rows [0, 2], row 2 with 2 drafts: rows [0, 2, 2, 2], offsets [0, 0, 1, 2],
        # logits_indices [1, 9] -> [1, 7, 8, 9].
        counts = np.array([len(drafts.get(row, ())) + 1 for row in sampled_rows.tolist()])
        group_starts = np.cumsum(counts) - counts
        sample_offsets = np.arange(int(counts.sum())) - np.repeat(group_starts, counts)
        return SpecStep(
            slot_indices=slot_indices,
            drafts=drafts,
            num_real_drafts=num_real,
            draft_probs=draft_probs,
            sampled_rows=np.repeat(sampled_rows, counts),
            sample_offsets=sample_offsets,
            logits_indices=(
                np.repeat(logits_indices, counts) - np.repeat(counts - 1, counts) + sample_offsets
            ),
        )

    # ------------------------------------------------------------------------------------------ verify
    def verify(
        self, logits: torch.Tensor, step: SpecStep, sampler: Sampler
    ) -> dict[int, list[int]]:
        """The tokens `rejection_sample` emits for each row whose drafts came with their distributions q (a draft
        model, sampled requests), against the target's distributions p at its d + 1 sampled rows of `logits`
        (min(1, p/q), then the residual or the bonus token); other rows are left to `accept`. Seeded requests
        draw their uniforms from (seed, output position), others from `sampler`'s stream, after its samples."""
        if not step.draft_probs:
            return {}
        slots = self.slots
        sampled_rows = step.sampled_rows
        # A row's d + 1 sampled rows are consecutive, and sampled rows ascend (batch order).
        rows_with_probs = np.fromiter(step.draft_probs, np.int64, len(step.draft_probs))
        begins = np.searchsorted(sampled_rows, rows_with_probs, side="left")
        ends = np.searchsorted(sampled_rows, rows_with_probs, side="right")
        groups = [
            (row, np.arange(begin, end))
            for row, begin, end in zip(
                rows_with_probs.tolist(), begins.tolist(), ends.tolist(), strict=True
            )
        ]
        flat = np.concatenate([rows for _, rows in groups])
        slot_indices = step.slot_indices[sampled_rows[flat]]
        params = [slots.sampling_params[index] for index in slot_indices.tolist()]
        metadata = build_sampling_metadata(
            params,  # type: ignore[arg-type]
            token_ids=slots.token_ids,
            slot_indices=slot_indices,
            num_prompt_tokens=slots.num_prompt_tokens[slot_indices],
            num_tokens=slots.num_tokens[slot_indices] + step.sample_offsets[flat],
            vocab_size=int(logits.shape[1]),
            eos_token_id=self.eos_token_id,
            device=logits.device,
        )
        index_tensor = torch.as_tensor(flat, dtype=torch.int64, device=logits.device)
        target_probs = sampler.probabilities(logits[index_tensor], metadata)
        verified: dict[int, list[int]] = {}
        first = 0
        for row, rows in groups:
            index = int(step.slot_indices[row])
            params_row = slots.sampling_params[index]
            assert params_row is not None
            if params_row.seed is not None:
                position = int(slots.num_tokens[index] - slots.num_prompt_tokens[index])
                generator = torch.Generator(device=logits.device)
                generator.manual_seed(mix_seed(params_row.seed ^ _VERIFY_SEED_SALT, position))
            else:
                generator = sampler.generator(logits.device)
            verified[row] = rejection_sample(
                target_probs[first : first + len(rows)],
                step.draft_probs[row].to(target_probs.device),
                torch.tensor(step.drafts[row], dtype=torch.int64, device=target_probs.device),
                generator,
            )
            first += len(rows)
        return verified

    # ------------------------------------------------------------------------------------------ accept
    def accept(
        self, step: SpecStep, sampled_np: np.ndarray, verified: dict[int, list[int]]
    ) -> list[list[int]]:
        """Each request's accepted drafts and the token after them (`verified`'s tokens, else
        `accept_point_mass_drafts`: row j was sampled with drafts 0..j-1 as context, so a draft is accepted when
        its row sampled it), appended to its buffer over the drafts; the rejected drafts' positions leave the
        computed count (which already counts every scheduled token). Returns the tokens per batch row."""
        sampled_token_ids: list[list[int]] = [[] for _ in step.slot_indices]
        for row, token_id in zip(step.sampled_rows.tolist(), sampled_np.tolist(), strict=True):
            sampled_token_ids[row].append(token_id)
        slots = self.slots
        for row, request_drafts in step.drafts.items():
            accepted = verified.get(row) or accept_point_mass_drafts(
                sampled_token_ids[row], request_drafts
            )
            sampled_token_ids[row] = accepted
            index = int(step.slot_indices[row])
            slots.num_computed_tokens[index] -= len(request_drafts) + 1 - len(accepted)
        for row in set(step.sampled_rows.tolist()):
            index = int(step.slot_indices[row])
            start = int(slots.num_tokens[index])
            # Past max_model_len a token is reported, not stored.
            kept = sampled_token_ids[row][: max(slots.max_model_len - start, 0)]
            slots.token_ids[index, start : start + len(kept)] = kept
            slots.num_tokens[index] = start + len(kept)
        return sampled_token_ids

    # ------------------------------------------------------------------------------------------ propose
    def propose(
        self,
        slot_indices: np.ndarray,
        sampled_rows: np.ndarray,
        failed_rows: set[int],
        sampled_token_ids: list[list[int]],
    ) -> list[list[int]]:
        """Drafts for the next step of each batch row that sampled, from its buffer; never past `max_model_len`
        (the scheduler cuts them to what max_tokens and a request's grammar allow). The proposer sees every
        computed row (`catch_up`: a draft model computes every position the target computed, so a full block's
        draft K/V is there whenever its target K/V is), rows in `failed_rows` (their requests end) excepted."""
        drafts: list[list[int]] = [[] for _ in sampled_token_ids]
        slots = self.slots
        wanted: dict[int, int] = {}  # slot -> room for drafts
        row_of: dict[int, int] = {}
        switched_off = self._switched_off_at(len(sampled_token_ids))
        sampled = set(sampled_rows.tolist())
        for row in sampled:
            index = int(slot_indices[row])
            self.forget_slot(index)
            if switched_off:
                continue
            params = slots.sampling_params[index]
            if not sampled_token_ids[row] or params is None:
                continue
            room = slots.max_model_len - int(slots.num_tokens[index]) - 1
            if room > 0:
                wanted[index] = room
                row_of[index] = row
        # Only a proposer with a KV cache of its own catches up; the others never read it.
        catch_up = (
            self._catch_up(slot_indices, sampled, failed_rows)
            if self.proposer.needs_kv_cache
            else {}
        )
        proposals = self.proposer.propose_batch(
            DraftBatch(slots, wanted, catch_up, self.eos_token_id)
        )
        for index, proposal in proposals.items():
            drafts[row_of[index]] = proposal.token_ids
            self.slot_drafts[index] = proposal.token_ids
            self.slot_draft_probs[index] = proposal.draft_probs
        return drafts

    def _catch_up(
        self, slot_indices: np.ndarray, sampled: set[int], failed_rows: set[int]
    ) -> dict[int, int]:
        """Slot -> the positions of this step's rows whose target K/V is in the cache (known tokens of rows that
        sampled, computed ones of partial prefills), capped at what the row's blocks hold; batch order."""
        slots = self.slots
        is_sampled = np.zeros(len(slot_indices), dtype=bool)
        is_sampled[list(sampled)] = True
        known = np.where(
            is_sampled, slots.num_tokens[slot_indices], slots.num_computed_tokens[slot_indices]
        )
        ends = np.minimum(known, slots.num_blocks[slot_indices] * self.block_size)
        if failed_rows:
            kept = np.ones(len(slot_indices), dtype=bool)
            kept[list(failed_rows)] = False
            slot_indices, ends = slot_indices[kept], ends[kept]
        return dict(zip(slot_indices.tolist(), ends.tolist(), strict=True))

    def _switched_off_at(self, batch_size: int) -> bool:
        """Whether a step of `batch_size` requests proposes nothing (`disable_by_batch_size`); logs each switch."""
        limit = self.disable_by_batch_size
        switched_off = limit is not None and batch_size >= limit
        if switched_off != self._switched_off:
            self._switched_off = switched_off
            logger.info(
                "speculative decoding %s: %d requests in the step, disable_by_batch_size=%s",
                "off" if switched_off else "back on",
                batch_size,
                limit,
            )
        return switched_off


def rows_per_token(
    logprobs: LogprobsLists, sampled_rows: list[int], sampled_token_ids: list[list[int]]
) -> tuple[LogprobsLists, list[int]]:
    """With drafts, one logprob row per emitted token: batch row r's tokens are the samples of its first
    len(sampled_token_ids[r]) verification rows (point-mass verification emits the sampled tokens), so their
    rows are kept in order. Returns the rows and where each batch row's rows start."""
    positions: list[list[int]] = [[] for _ in sampled_token_ids]
    for position, row in enumerate(sampled_rows):
        positions[row].append(position)
    result = LogprobsLists([], [], [])
    starts: list[int] = []
    for row, tokens in enumerate(sampled_token_ids):
        starts.append(result.num_rows)
        for position in positions[row][: len(tokens)]:
            result.logprob_token_ids.append(logprobs.logprob_token_ids[position])
            result.logprobs.append(logprobs.logprobs[position])
            result.sampled_token_ranks.append(logprobs.sampled_token_ranks[position])
    return result, starts


def _pad_point_masses(draft_probs: torch.Tensor, padding: list[int]) -> torch.Tensor:
    """`draft_probs` [n, V] followed by one point-mass row per padded draft id: a padded draft's "distribution"
    is the point mass on it (its id was fixed, not drawn), which `rejection_sample` verifies exactly."""
    if not padding:
        return draft_probs
    masses = torch.zeros(
        (len(padding), draft_probs.shape[1]), dtype=draft_probs.dtype, device=draft_probs.device
    )
    masses[torch.arange(len(padding)), torch.tensor(padding)] = 1.0
    return torch.cat([draft_probs, masses])
