"""The worker model: `PagedHashWorker` runs the hash model on a paged KV cache for either runner protocol, and
`FinishedStep` is the future of a batch it already ran."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

from kvflow.core.sched.output import DRAFT_PLACEHOLDER, ModelRunnerOutput
from kvflow.models.hash_model import next_token
from kvflow.testing.interleavings.keys import output_key
from kvflow.testing.interleavings.model import NotApplicable, oracle
from kvflow.utils import cdiv

if TYPE_CHECKING:
    from kvflow.core.sched.output import SchedulerOutput


# What the worker model leaves in the KV slot of a rejected draft: its K/V belongs to a token that is not there.
REJECTED_DRAFT = -2


class PagedHashWorker:
    """A pure-Python worker for either runner protocol, running the hash model on a paged KV cache.

    It applies each `SchedulerOutput` as the runner does: release `finished_req_ids | preempted_req_ids` (the
    persistent-batch protocol parks a preempted request's tokens), add `scheduled_new_reqs`, update
    `scheduled_cached_reqs` (new blocks, a session's chunk, a persistent-batch resume with its replacement block
    table and `all_token_ids`; with speculation, a computed count that is the lower of the scheduler's and its own,
    as the runner's min rule); then it writes the scheduled tokens (and drafts) through the block table and samples
    `next_token(tokens read back)` for each request that reached the end of its tokens, appending what it keeps to
    its own list (so the next step can run before the scheduler has the tokens: async scheduling).

    Speculative decoding (`num_speculative_tokens` > 0): the drafts a step verifies are the scheduler's, its
    `DRAFT_PLACEHOLDER` slots filled with the worker's own latest proposals (padded with token 0 where it has
    fewer); they are written after the known tokens, and row j of the request samples after the first j of them.
    Draft j can be accepted only if rows 0..j sampled drafts 0..j (`m` drafts at most); the batch's outcomes are
    every combination of accepted lengths `a` in m..0 (index 0: greedy, all it can), and a request accepting `a`
    yields its rows 0..a. The KV slots of its rejected drafts are marked `REJECTED_DRAFT` (a stale draft's K/V:
    reading one is a violation) and its computed count rolls back over them. After sampling, each request that
    sampled proposes the oracle continuation of its tokens (up to k, never past `max_model_len`), returned in
    `spec_token_ids`, so accepting drafts keeps every output the oracle's.

    Invariants: `len(tokens) <= max_num_reqs` (a request with `tokens` holds a slot; parked ones hold none); a
    request is never both active and parked; `drafts` only for active requests; `last_scheduled_ids` is the
    previous step's scheduled requests.
    """

    def __init__(
        self,
        max_num_reqs: int,
        block_size: int,
        num_blocks: int,
        use_v2_model_runner: bool,
        max_model_len: int,
        num_speculative_tokens: int = 0,
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.block_size = block_size
        self.use_v2_model_runner = use_v2_model_runner
        self.max_model_len = max_model_len
        self.num_speculative_tokens = num_speculative_tokens
        self.kv: list[int | None] = [None] * (block_size * num_blocks)
        self.tokens: dict[str, list[int]] = {}
        self.block_table: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        # Each request's proposals after its latest sampling step.
        self.drafts: dict[str, list[int]] = {}
        self.parked: dict[str, list[int]] = {}
        self.last_scheduled_ids: frozenset[str] = frozenset()
        # The last batch run: its number of outcomes, and what happened worth covering (`SearchResult.events`).
        self.num_outcomes = 1
        self.step_events: list[str] = []

    @property
    def held(self) -> set[str]:
        """Requests holding a worker slot."""
        return set(self.tokens)

    def execute(
        self, scheduler_output: SchedulerOutput, outcome_index: int = 0
    ) -> ModelRunnerOutput:
        """Run a batch with its outcome number `outcome_index` (of `num_outcomes`, set by this call; raises
        `NotApplicable` past them)."""
        self.step_events = []
        self._release(scheduler_output)
        self._add_new(scheduler_output)
        self._update_cached(scheduler_output)
        assert len(self.tokens) <= self.max_num_reqs, (
            f"the worker ran out of slots: {sorted(self.tokens)} > max_num_seqs={self.max_num_reqs}"
        )
        self.last_scheduled_ids = frozenset(scheduler_output.num_scheduled_tokens)
        return self._run(scheduler_output, outcome_index)

    def _drop(self, req_id: str) -> None:
        self.tokens.pop(req_id, None)
        self.block_table.pop(req_id, None)
        self.computed.pop(req_id, None)
        self.drafts.pop(req_id, None)

    def _release(self, scheduler_output: SchedulerOutput) -> None:
        for req_id in scheduler_output.finished_req_ids:
            self._drop(req_id)
            self.parked.pop(req_id, None)
        for req_id in scheduler_output.preempted_req_ids - scheduler_output.finished_req_ids:
            if not self.use_v2_model_runner and req_id in self.tokens:
                self.parked[req_id] = self.tokens[req_id]
            self._drop(req_id)

    def _add_new(self, scheduler_output: SchedulerOutput) -> None:
        for new_req in scheduler_output.scheduled_new_reqs:
            req_id = new_req.req_id
            assert req_id not in self.tokens, f"{req_id!r} sent as new while it holds a worker slot"
            self.parked.pop(req_id, None)
            token_ids = (
                new_req.prefill_token_ids
                if new_req.prefill_token_ids is not None
                else new_req.prompt_token_ids
            )
            self.tokens[req_id] = list(token_ids)
            self.block_table[req_id] = list(new_req.block_ids[0])
            self.computed[req_id] = new_req.num_computed_tokens

    def _update_cached(self, scheduler_output: SchedulerOutput) -> None:
        cached = scheduler_output.scheduled_cached_reqs
        for index, req_id in enumerate(cached.req_ids):
            num_computed = cached.num_computed_tokens[index]
            new_block_ids = cached.new_block_ids[index]
            resumed = req_id in cached.resumed_req_ids
            if resumed:
                assert not self.use_v2_model_runner, "the slot runner gets resumes as new requests"
                assert new_block_ids is not None, f"resumed {req_id!r} without a block table"
                if req_id in self.parked:
                    self.tokens[req_id] = self.parked.pop(req_id)
                assert req_id in self.tokens, f"resumed {req_id!r} is unknown to the worker"
                self.block_table[req_id] = list(new_block_ids[0])
            else:
                assert req_id not in self.parked, f"parked {req_id!r} scheduled without a resume"
                assert req_id in self.tokens, f"cached request {req_id!r} holds no worker slot"
                if new_block_ids is not None:
                    self.block_table[req_id].extend(new_block_ids[0])
            if req_id in cached.all_token_ids:
                self.tokens[req_id] = list(cached.all_token_ids[req_id])
            elif cached.new_token_ids[index]:
                assert num_computed <= len(self.tokens[req_id]), (
                    f"{req_id!r}: a chunk written past the worker's tokens"
                )
                self.tokens[req_id] = self.tokens[req_id][:num_computed] + list(
                    cached.new_token_ids[index]
                )
            if self.num_speculative_tokens and not resumed:
                # The scheduler's count takes the draft slots of steps in flight as accepted (an upper bound).
                num_computed = min(num_computed, self.computed[req_id])
            self.computed[req_id] = num_computed

    def _run(self, scheduler_output: SchedulerOutput, outcome_index: int) -> ModelRunnerOutput:
        """Write every scheduled token and draft, sample each request's rows, then apply the chosen outcome."""
        req_ids = list(scheduler_output.num_scheduled_tokens)
        scheduled_drafts = scheduler_output.scheduled_spec_decode_tokens
        drafts: dict[str, list[int]] = {}
        # Requests whose draft slots were placeholders -> how many the worker filled with its own drafts.
        num_real_drafts: dict[str, int] = {}
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            drafts[req_id] = self._fill_drafts(
                req_id, scheduled_drafts.get(req_id), num_real_drafts
            )
            self._write(req_id, num_tokens, drafts[req_id])
        rows = {  # what each request that reached the end of its tokens samples (a partial prefill: nothing)
            req_id: self._sample_rows(req_id, len(drafts[req_id]))
            for req_id in req_ids
            if self.computed[req_id] >= len(self.tokens[req_id])
        }
        verifying = [req_id for req_id in rows if drafts[req_id]]
        outcomes = list(
            itertools.product(
                *(range(_num_matching(rows[r], drafts[r]), -1, -1) for r in verifying)
            )
        )
        self.num_outcomes = len(outcomes)
        if outcome_index >= len(outcomes):
            raise NotApplicable
        accepted = dict(zip(verifying, outcomes[outcome_index], strict=True))
        sampled: list[list[int]] = []
        proposals: list[list[int]] = []
        for req_id in req_ids:
            if req_id not in rows:
                sampled.append([])
                proposals.append([])
                continue
            generated = rows[req_id][: accepted.get(req_id, 0) + 1]
            self._accept(req_id, drafts[req_id], generated)
            sampled.append(generated)
            proposals.append(self._propose(req_id))
        if verifying:
            self.step_events.append("verified_drafts")
        if any(accepted[req_id] < len(drafts[req_id]) for req_id in verifying):
            self.step_events.append("rejected_drafts")
        output = ModelRunnerOutput(
            req_ids, {req_id: i for i, req_id in enumerate(req_ids)}, sampled
        )
        if self.num_speculative_tokens:
            output.spec_token_ids = proposals
            if num_real_drafts:
                output.num_real_drafts = [
                    num_real_drafts.get(req_id, len(drafts[req_id])) for req_id in req_ids
                ]
        return output

    def _fill_drafts(
        self, req_id: str, scheduled: list[int] | None, num_real_drafts: dict[str, int]
    ) -> list[int]:
        """The drafts a step verifies: the scheduler's, or for `DRAFT_PLACEHOLDER` slots the worker's own."""
        if not scheduled:
            return []
        if DRAFT_PLACEHOLDER not in scheduled:
            latest = self.drafts.get(req_id, [])
            assert list(scheduled) == latest[: len(scheduled)], (
                f"{req_id!r}: drafts {scheduled} are not the worker's latest proposals {latest}"
            )
            return list(scheduled)
        self.step_events.append("placeholder_drafts")
        own = self.drafts.get(req_id, [])[: len(scheduled)]
        num_real_drafts[req_id] = len(own)
        if len(own) < len(scheduled):
            self.step_events.append("padded_drafts")
        return own + [0] * (len(scheduled) - len(own))

    def _write(self, req_id: str, num_tokens: int, drafts: list[int]) -> None:
        """Write the scheduled positions (known tokens, then drafts) into the KV cache."""
        start = self.computed[req_id]
        end = start + num_tokens
        readable = self.tokens[req_id] + drafts
        table = self.block_table[req_id]
        assert end <= len(readable), f"{req_id!r}: scheduled past the worker's tokens ({end})"
        assert not drafts or end == len(readable), (
            f"{req_id!r}: a step verifying {len(drafts)} drafts ends at {end}, not at its last draft"
        )
        assert cdiv(end, self.block_size) <= len(table), f"{req_id!r}: tokens without KV blocks"
        for position in range(start, end):
            self.kv[self._slot(table, position)] = readable[position]
        self.computed[req_id] = end

    def _sample_rows(self, req_id: str, num_drafts: int) -> list[int]:
        """Row j samples after the known tokens and the first j drafts, read back through the block table."""
        table = self.block_table[req_id]
        read_back = [
            self.kv[self._slot(table, position)]
            for position in range(len(self.tokens[req_id]) + num_drafts)
        ]
        assert None not in read_back, f"{req_id!r}: read a KV slot that was never written"
        assert REJECTED_DRAFT not in read_back, f"{req_id!r}: read the KV of a rejected draft"
        num_known = len(self.tokens[req_id])
        return [next_token(read_back[: num_known + j]) for j in range(num_drafts + 1)]  # type: ignore[arg-type]

    def _accept(self, req_id: str, drafts: list[int], generated: list[int]) -> None:
        """Keep the accepted drafts and the token after them; roll back over the rejected drafts."""
        tokens = self.tokens[req_id]
        num_known = len(tokens)
        num_rejected = len(drafts) + 1 - len(generated)
        if num_rejected:
            table = self.block_table[req_id]
            for position in range(num_known + len(generated) - 1, num_known + len(drafts)):
                self.kv[self._slot(table, position)] = REJECTED_DRAFT
            self.computed[req_id] -= num_rejected
        tokens.extend(generated[: max(self.max_model_len - num_known, 0)])  # past it: reported only

    def _propose(self, req_id: str) -> list[int]:
        """The oracle continuation of the request's tokens, up to k, never reaching past `max_model_len`."""
        if not self.num_speculative_tokens:
            return []
        tokens = self.tokens[req_id]
        room = self.max_model_len - len(tokens) - 1
        proposals = (
            list(oracle(tuple(tokens), min(self.num_speculative_tokens, room))) if room > 0 else []
        )
        self.drafts[req_id] = proposals
        return proposals

    def _slot(self, table: list[int], position: int) -> int:
        return table[position // self.block_size] * self.block_size + position % self.block_size

    def state_key(self) -> tuple[Any, ...]:
        active = tuple(
            (
                req_id,
                tuple(self.tokens[req_id]),
                tuple(self.block_table[req_id]),
                self.computed[req_id],
                tuple(self.drafts.get(req_id, ())),
            )
            for req_id in sorted(self.tokens)
        )
        parked = tuple((req_id, tuple(tokens)) for req_id, tokens in sorted(self.parked.items()))
        return active, parked, tuple(self.kv), frozenset(self.last_scheduled_ids)


def _num_matching(rows: list[int], drafts: list[int]) -> int:
    """How many leading drafts the rows sampled: the most a step can accept (greedy accepts exactly these)."""
    num_matching = 0
    while num_matching < len(drafts) and rows[num_matching] == drafts[num_matching]:
        num_matching += 1
    return num_matching


class FinishedStep:
    """The future of a batch the worker already ran: `result()` hands its output over, after checking that the
    batch's `SchedulerOutput` was not modified while it was in flight (the worker may read it any time)."""

    def __init__(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> None:
        self.scheduler_output = scheduler_output
        self.model_runner_output = model_runner_output
        self.fingerprint = hash(output_key(scheduler_output))
        spec_token_ids = model_runner_output.spec_token_ids
        num_real_drafts = model_runner_output.num_real_drafts
        self.result_key = (
            tuple(map(tuple, model_runner_output.sampled_token_ids)),
            None if spec_token_ids is None else tuple(map(tuple, spec_token_ids)),
            None if num_real_drafts is None else tuple(num_real_drafts),
        )

    def result(self) -> ModelRunnerOutput:
        assert hash(output_key(self.scheduler_output)) == self.fingerprint, (
            "a SchedulerOutput was modified while its batch was in flight"
        )
        return self.model_runner_output
