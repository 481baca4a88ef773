"""A pure-Python model of the slot runner's slot bookkeeping, for scheduler tests."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvflow.core.sched.output import SchedulerOutput


class WorkerSlots:
    """The slot model the randomized scheduler tests check after every step (no model, no tensors).

    It applies each `SchedulerOutput` exactly as the slot runner (`use_v2_model_runner=True`) does: release
    `finished_req_ids | preempted_req_ids`, then add `scheduled_new_reqs` (a same-id add frees the old slot first),
    then check that every cached request and every request in `num_scheduled_tokens` holds a slot.
    Over-admission raises `AssertionError("No free indices")`; a missing holder raises an AssertionError naming it.

    Invariant: `len(held) + num_free == max_num_reqs`.
    """

    def __init__(self, max_num_reqs: int) -> None:
        self.max_num_reqs = max_num_reqs
        self.held: set[str] = set()

    @property
    def num_free(self) -> int:
        return self.max_num_reqs - len(self.held)

    def apply(self, scheduler_output: SchedulerOutput) -> None:
        """Apply one step's releases and admissions, then check that everything it runs holds a slot."""
        self.held -= scheduler_output.finished_req_ids | scheduler_output.preempted_req_ids
        for new_req in scheduler_output.scheduled_new_reqs:
            self.held.discard(new_req.req_id)
            if not self.num_free:
                raise AssertionError("No free indices")
            self.held.add(new_req.req_id)
        for req_id in scheduler_output.scheduled_cached_reqs.req_ids:
            assert req_id in self.held, f"cached request {req_id!r} holds no worker slot"
        for req_id in scheduler_output.num_scheduled_tokens:
            assert req_id in self.held, f"scheduled request {req_id!r} holds no worker slot"
