"""add_request validation: every rejected request raises ValueError naming it, and changes nothing."""

from __future__ import annotations

import pytest
from sched_helpers import run_to_completion, step

from kvflow.testing import make_request, make_scheduler
from kvflow.testing.hash_model import reference_tokens


def assert_rejected(scheduler, request, *fragments):
    """add_request raises ValueError whose message names the request (and mentions each fragment)."""
    with pytest.raises(ValueError) as excinfo:
        scheduler.add_request(request)
    message = str(excinfo.value)
    assert request.request_id in message
    for fragment in fragments:
        assert fragment in message


def test_empty_prompt_rejected():
    scheduler = make_scheduler()
    assert_rejected(scheduler, make_request("empty-one", []))
    assert scheduler.requests == {}
    assert not scheduler.has_unfinished_requests()


def test_prompt_longer_than_max_model_len_rejected():
    scheduler = make_scheduler(max_model_len=32)
    assert_rejected(scheduler, make_request("too-long", [1] * 33), "max_model_len")
    assert "too-long" not in scheduler.requests
    scheduler.add_request(
        make_request("fits", [1] * 32, max_tokens=1)
    )  # exactly max_model_len is allowed


def test_prompt_needing_more_blocks_than_the_cache_rejected():
    scheduler = make_scheduler(block_size=16, num_blocks=2, max_model_len=100)
    assert_rejected(scheduler, make_request("huge", [1] * 33), "blocks")
    assert scheduler.requests == {}
    scheduler.add_request(make_request("ok", [1] * 32, max_tokens=1))
    assert run_to_completion(scheduler) == {"ok": reference_tokens([1] * 32, 1)}


def test_duplicate_id_of_waiting_request_rejected():
    scheduler = make_scheduler()
    original = make_request("dup", [1] * 4)
    scheduler.add_request(original)
    assert_rejected(scheduler, make_request("dup", [2] * 4))
    assert scheduler.requests["dup"] is original
    assert len(scheduler.waiting) == 1


def test_duplicate_id_of_running_request_rejected():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("dup", [1] * 4, max_tokens=3))
    step(scheduler)
    assert_rejected(scheduler, make_request("dup", [2] * 4))
    assert run_to_completion(scheduler) == {"dup": reference_tokens([1] * 4, 3)[1:]}


def test_resumable_request_with_id_of_non_resumable_live_request_rejected():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("dup", [1] * 4))
    assert_rejected(scheduler, make_request("dup", [2] * 4, resumable=True))


def test_rejected_request_does_not_consume_blocks():
    scheduler = make_scheduler(block_size=4, num_blocks=4, max_model_len=64)
    for request_id, prompt in (("a", []), ("b", [1] * 17)):
        with pytest.raises(ValueError):
            scheduler.add_request(make_request(request_id, prompt))
    assert scheduler.kv_cache_manager.usage == 0.0
    assert scheduler.schedule().num_scheduled_tokens == {}
