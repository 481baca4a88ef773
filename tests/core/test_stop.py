"""check_stop: (past min_tokens) EOS and stop token ids first, then the length limits."""

from __future__ import annotations

from kvflow.core.sched.stop import check_stop
from kvflow.request import Request, RequestStatus
from kvflow.sampling_params import SamplingParams

EOS = 2


def request_with(
    outputs: list[int], prompt_len: int = 4, eos_token_id: int | None = EOS, **params
) -> Request:
    request = Request(
        "r", list(range(10, 10 + prompt_len)), SamplingParams(**params), eos_token_id=eos_token_id
    )
    request.status = RequestStatus.RUNNING
    for token_id in outputs:
        request.append_output_token_ids(token_id)
    return request


def test_ordinary_token_does_not_stop():
    request = request_with([5], max_tokens=10)
    assert check_stop(request, max_model_len=100) is False
    assert request.status == RequestStatus.RUNNING
    assert request.stop_reason is None


def test_max_tokens_caps_length():
    request = request_with([5, 6, 7], max_tokens=3)
    assert check_stop(request, max_model_len=100) is True
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert request.get_finished_reason() == "length"


def test_below_max_tokens_continues():
    assert check_stop(request_with([5, 6], max_tokens=3), max_model_len=100) is False


def test_max_model_len_caps_length():
    request = request_with([5, 6], prompt_len=8, max_tokens=100)
    assert check_stop(request, max_model_len=10) is True
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_one_below_max_model_len_continues():
    assert check_stop(request_with([5], prompt_len=8, max_tokens=100), max_model_len=10) is False


def test_eos_stops():
    request = request_with([5, EOS], max_tokens=10)
    assert check_stop(request, max_model_len=100) is True
    assert request.status == RequestStatus.FINISHED_STOPPED
    assert request.stop_reason is None
    assert request.get_finished_reason() == "stop"


def test_eos_ignored_with_ignore_eos():
    request = request_with([EOS], max_tokens=10, ignore_eos=True)
    assert check_stop(request, max_model_len=100) is False
    assert request.status == RequestStatus.RUNNING


def test_no_eos_token_id():
    assert (
        check_stop(request_with([EOS], max_tokens=10, eos_token_id=None), max_model_len=100)
        is False
    )


def test_eos_only_checked_on_last_token():
    assert (
        check_stop(request_with([EOS, 5], max_tokens=10, min_tokens=1), max_model_len=100) is False
    )


def test_stop_token_sets_stop_reason():
    request = request_with([5, 8], max_tokens=10, stop_token_ids=[7, 8])
    assert check_stop(request, max_model_len=100) is True
    assert request.status == RequestStatus.FINISHED_STOPPED
    assert request.stop_reason == 8


def test_stop_token_applies_even_with_ignore_eos():
    request = request_with([8], max_tokens=10, stop_token_ids=[8], ignore_eos=True)
    assert check_stop(request, max_model_len=100) is True
    assert request.stop_reason == 8


def test_min_tokens_suppresses_eos_and_stop_tokens():
    assert check_stop(request_with([EOS], max_tokens=10, min_tokens=2), max_model_len=100) is False
    assert (
        check_stop(
            request_with([8], max_tokens=10, min_tokens=2, stop_token_ids=[8]), max_model_len=100
        )
        is False
    )


def test_min_tokens_reached_allows_eos():
    request = request_with([5, EOS], max_tokens=10, min_tokens=2)
    assert check_stop(request, max_model_len=100) is True
    assert request.status == RequestStatus.FINISHED_STOPPED


def test_min_tokens_does_not_suppress_length():
    request = request_with([5, 6], max_tokens=2, min_tokens=2)
    assert check_stop(request, max_model_len=100) is True
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_eos_as_last_allowed_token_is_stop():
    request = request_with([5, EOS], max_tokens=2)
    assert check_stop(request, max_model_len=100) is True
    assert request.status == RequestStatus.FINISHED_STOPPED
    assert request.stop_reason is None
    assert request.get_finished_reason() == "stop"


def test_stop_token_as_last_allowed_token_is_stop():
    request = request_with([8], max_tokens=1, stop_token_ids=[8])
    assert check_stop(request, max_model_len=100) is True
    assert request.status == RequestStatus.FINISHED_STOPPED
    assert request.stop_reason == 8


def test_eos_reaching_max_model_len_is_stop():
    request = request_with([EOS], prompt_len=9, max_tokens=100)
    assert check_stop(request, max_model_len=10) is True
    assert request.status == RequestStatus.FINISHED_STOPPED


def test_ignored_eos_as_last_allowed_token_is_length():
    request = request_with([5, EOS], max_tokens=2, ignore_eos=True)
    assert check_stop(request, max_model_len=100) is True
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_stop_token_below_min_tokens_still_length_capped_at_max_model_len():
    # min_tokens holds back stop tokens, never the length caps: the sequence cannot outgrow max_model_len.
    request = request_with([8], prompt_len=9, max_tokens=5, min_tokens=3, stop_token_ids=[8])
    assert check_stop(request, max_model_len=10) is True
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert request.stop_reason is None
