"""StreamingSessions on its own: idle sessions, slot holders and unsent chunks, without a scheduler around it."""

from __future__ import annotations

import pytest

from kvflow.core.kv_cache_manager import KVCacheManager
from kvflow.core.sched.request_queue import FCFSRequestQueue
from kvflow.core.sched.sessions import StreamingSessions
from kvflow.request import Request, RequestStatus, StreamingUpdate
from kvflow.testing import make_request

PROMPT = list(range(10))
MAX_MODEL_LEN = 20


class Table:
    """A session table with the waiting queue and KV cache manager it works on."""

    def __init__(self) -> None:
        self.waiting = FCFSRequestQueue()
        self.kv = KVCacheManager(num_blocks=8, block_size=4)
        self.sessions = StreamingSessions(MAX_MODEL_LEN, self.waiting, self.kv)


def stopped_session(table: Table, num_outputs: int = 3) -> Request:
    """A session whose first chunk ran (KV blocks held) and just stopped after `num_outputs` tokens."""
    session = make_request("s", PROMPT, resumable=True)
    table.kv.allocate_slots(session, len(PROMPT))
    session.num_computed_tokens = len(PROMPT)
    session.append_output_token_ids([50 + i for i in range(num_outputs)])
    session.num_computed_tokens += num_outputs - 1  # the last sampled token was never fed back
    session.status = RequestStatus.FINISHED_LENGTH_CAPPED  # what the stop check set
    return session


def chunk(tokens: list[int]) -> StreamingUpdate:
    update = StreamingUpdate.from_request(make_request("s", tokens, max_tokens=2, resumable=True))
    assert update is not None
    return update


def idle_session(table: Table) -> Request:
    session = stopped_session(table)
    assert table.sessions.park_stopped(session, kept_slot=True) is False
    return session


# ------------------------------------------------------------------------------------------------ parking
def test_parked_session_is_idle_and_keeps_its_slot():
    table = Table()
    session = idle_session(table)
    assert session.status == RequestStatus.WAITING_FOR_STREAMING_REQ
    assert table.sessions.num_waiting_for_input == 1
    assert table.sessions.num_slot_holders == 1
    assert table.sessions.holds_slot("s")
    assert not table.sessions.has_unsent_chunks
    assert list(table.waiting) == []


def test_session_stopped_without_a_slot_parks_without_one():
    table = Table()
    session = stopped_session(table)
    assert table.sessions.park_stopped(session, kept_slot=False) is False
    assert table.sessions.num_waiting_for_input == 1
    assert table.sessions.num_slot_holders == 0


def test_parking_with_a_queued_chunk_applies_it():
    table = Table()
    session = stopped_session(table)
    session.streaming_queue.append(chunk([7, 8]))
    assert table.sessions.park_stopped(session, kept_slot=True) is False
    assert session.status == RequestStatus.WAITING
    assert list(session.all_token_ids) == [*PROMPT, 50, 51, 7, 8]
    assert list(table.waiting) == [session]
    assert table.sessions.num_waiting_for_input == 0
    assert table.sessions.has_unsent_chunks


def test_parking_with_a_queued_close_ends_the_session():
    table = Table()
    session = stopped_session(table)
    session.streaming_queue.append(None)
    assert table.sessions.park_stopped(session, kept_slot=True) is True
    assert table.sessions.num_waiting_for_input == 0
    assert list(table.waiting) == []


def test_parking_with_a_queued_chunk_too_long_caps_the_session():
    table = Table()
    session = stopped_session(table)
    session.streaming_queue.append(chunk([1] * 9))  # 12 kept + 9 > 20
    assert table.sessions.park_stopped(session, kept_slot=True) is True
    assert session.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert list(table.waiting) == []


# ------------------------------------------------------------------------------------------------ updates
def test_chunk_for_an_idle_session_is_applied_and_queued():
    table = Table()
    session = idle_session(table)
    assert table.sessions.add_update(session, chunk([7, 8]), close_after=False) is False
    assert session.status == RequestStatus.WAITING
    assert session.num_computed_tokens == 12  # the kept history; the chunk is still to compute
    assert list(table.waiting) == [session]
    assert table.sessions.num_waiting_for_input == 0
    assert list(session.streaming_queue) == []


def test_last_chunk_for_an_idle_session_queues_the_close_behind_it():
    table = Table()
    session = idle_session(table)
    assert table.sessions.add_update(session, chunk([7, 8]), close_after=True) is False
    assert list(session.streaming_queue) == [None]


def test_close_of_an_idle_session_ends_it_now_and_changes_nothing_else():
    table = Table()
    session = idle_session(table)
    assert table.sessions.add_update(session, None, close_after=True) is True
    assert session.status == RequestStatus.WAITING_FOR_STREAMING_REQ  # the caller finishes it
    assert list(table.waiting) == []


@pytest.mark.parametrize("status", [RequestStatus.RUNNING, RequestStatus.WAITING])
def test_updates_for_a_busy_session_are_queued_in_order(status):
    table = Table()
    session = make_request("s", PROMPT, resumable=True)
    session.status = status
    first, second = chunk([1]), chunk([2])
    assert table.sessions.add_update(session, first, close_after=False) is False
    assert table.sessions.add_update(session, second, close_after=True) is False
    assert table.sessions.add_update(session, None, close_after=True) is False
    assert list(session.streaming_queue) == [first, second, None, None]
    assert list(table.waiting) == []


def test_empty_chunk_is_rejected():
    table = Table()
    session = idle_session(table)
    with pytest.raises(ValueError, match="'s'"):
        table.sessions.add_update(session, StreamingUpdate([], session.sampling_params, 0.0), False)
    assert table.sessions.num_waiting_for_input == 1


def test_chunk_too_long_for_an_idle_session_is_rejected_and_changes_nothing():
    table = Table()
    session = idle_session(table)
    with pytest.raises(ValueError, match="max_model_len=20"):
        table.sessions.add_update(session, chunk([1] * 9), close_after=False)
    assert session.status == RequestStatus.WAITING_FOR_STREAMING_REQ
    assert table.sessions.num_waiting_for_input == 1
    assert (
        table.sessions.add_update(session, chunk([1] * 8), close_after=False) is False
    )  # 12 + 8 fits


# ------------------------------------------------------------------------------------------------ scheduling
def test_unsent_chunk_is_taken_once():
    table = Table()
    session = idle_session(table)
    table.sessions.add_update(session, chunk([7, 8]), close_after=False)
    assert table.sessions.take_unsent_chunk("s") is True
    assert table.sessions.take_unsent_chunk("s") is False
    assert not table.sessions.has_unsent_chunks


def test_admitted_slot_holder_resumes_in_its_own_slot_once():
    table = Table()
    session = idle_session(table)
    table.sessions.add_update(session, chunk([7, 8]), close_after=False)
    assert table.sessions.resume_in_own_slot("s") is True
    assert table.sessions.num_slot_holders == 0
    assert table.sessions.resume_in_own_slot("s") is False
    assert table.sessions.resume_in_own_slot("never-seen") is False


def test_session_without_a_slot_gets_its_chunk_as_a_preempted_request():
    table = Table()
    session = stopped_session(table)
    table.sessions.park_stopped(session, kept_slot=False)
    table.sessions.add_update(session, chunk([7, 8]), close_after=False)
    assert session.status == RequestStatus.PREEMPTED
    assert not table.sessions.has_unsent_chunks


# ------------------------------------------------------------------------------------------------ release / forget
def test_release_frees_blocks_and_slots_of_every_holder():
    table = Table()
    session = idle_session(table)
    assert table.kv.usage > 0.0
    assert table.sessions.release_slot_holders() == ["s"]
    assert table.kv.usage == 0.0
    assert table.sessions.num_slot_holders == 0
    assert session.num_computed_tokens == 0
    assert session.num_preemptions == 1
    assert (
        session.status == RequestStatus.WAITING_FOR_STREAMING_REQ
    )  # still idle, now without blocks
    assert table.sessions.num_waiting_for_input == 1
    assert table.sessions.release_slot_holders() == []


def test_release_turns_a_queued_chunk_into_a_resume():
    table = Table()
    session = idle_session(table)
    table.sessions.add_update(session, chunk([7, 8]), close_after=False)
    table.sessions.release_slot_holders()
    assert session.status == RequestStatus.PREEMPTED
    assert not table.sessions.has_unsent_chunks
    assert list(table.waiting) == [session]


def test_forget_drops_every_trace_of_an_idle_session():
    table = Table()
    idle_session(table)
    table.sessions.forget("s")
    assert table.sessions.num_waiting_for_input == 0
    assert table.sessions.num_slot_holders == 0
    table.sessions.forget("s")  # idempotent
    table.sessions.forget("never-seen")


def test_forget_drops_an_unsent_chunk():
    table = Table()
    session = idle_session(table)
    table.sessions.add_update(session, chunk([7, 8]), close_after=False)
    table.sessions.forget("s")
    assert not table.sessions.has_unsent_chunks
    assert table.sessions.num_slot_holders == 0
