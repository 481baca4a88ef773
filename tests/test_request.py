"""Unit tests for kvflow.request: Request token bookkeeping, read-only views, statuses and streaming folds."""

from __future__ import annotations

import pytest

from kvflow.core.kv_cache_utils import RequestBlockHasher
from kvflow.request import Request, RequestStatus, StreamingUpdate
from kvflow.sampling_params import SamplingParams

BLOCK_SIZE = 4

FINISHED_STATUSES = [
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH_CAPPED,
    RequestStatus.FINISHED_ABORTED,
    RequestStatus.FINISHED_IGNORED,
    RequestStatus.FINISHED_ERROR,
]
UNFINISHED_STATUSES = [
    RequestStatus.WAITING,
    RequestStatus.WAITING_FOR_FSM,
    RequestStatus.WAITING_FOR_STREAMING_REQ,
    RequestStatus.RUNNING,
    RequestStatus.PREEMPTED,
]


def make_request(
    prompt: list[int], request_id: str = "r", hashed: bool = True, **kwargs
) -> Request:
    hasher = RequestBlockHasher(BLOCK_SIZE) if hashed else None
    return Request(request_id, prompt, SamplingParams(max_tokens=32), block_hasher=hasher, **kwargs)


# ------------------------------------------------------------------------------------------------ construction
def test_new_request_is_waiting():
    assert make_request([1, 2, 3]).status == RequestStatus.WAITING


def test_new_request_counts_prompt_tokens():
    request = make_request([1, 2, 3])
    assert request.num_prompt_tokens == 3
    assert request.num_tokens == 3
    assert request.num_output_tokens == 0
    assert request.num_computed_tokens == 0


def test_new_request_has_no_outputs():
    request = make_request([1, 2, 3])
    assert list(request.output_token_ids) == []
    assert list(request.all_token_ids) == [1, 2, 3]


def test_request_copies_prompt():
    prompt = [1, 2, 3]
    request = make_request(prompt)
    prompt.append(4)
    assert request.num_tokens == 3
    assert list(request.prompt_token_ids) == [1, 2, 3]


def test_request_defaults():
    request = make_request([1])
    assert request.priority == 0
    assert request.resumable is False
    assert request.streaming_queue is None
    assert request.num_preemptions == 0
    assert request.num_output_placeholders == 0
    assert request.async_tokens_to_discard == 0
    assert request.spec_token_ids == []


def test_explicit_arrival_time_is_kept():
    assert make_request([1], arrival_time=12.5).arrival_time == 12.5


def test_resumable_request_has_streaming_queue():
    request = make_request([1], resumable=True)
    assert request.streaming_queue is not None
    assert len(request.streaming_queue) == 0


def test_max_tokens_comes_from_sampling_params():
    assert make_request([1]).max_tokens == 32


def test_request_without_hasher_has_no_block_hashes():
    request = make_request(list(range(8)), hashed=False)
    request.append_output_token_ids([1, 2, 3, 4])
    assert request.block_hashes == []


def test_set_block_hasher_hashes_existing_full_blocks():
    request = make_request(list(range(9)), hashed=False)
    request.set_block_hasher(RequestBlockHasher(BLOCK_SIZE))
    assert request.block_hashes == make_request(list(range(9))).block_hashes


# ----------------------------------------------------------------------------------------------- token counts
def test_append_single_token_updates_counts():
    request = make_request([1, 2, 3])
    request.append_output_token_ids(9)
    assert request.num_tokens == 4
    assert request.num_output_tokens == 1
    assert request.num_prompt_tokens == 3


def test_append_token_list_updates_views():
    request = make_request([1, 2, 3])
    request.append_output_token_ids([7, 8])
    assert list(request.output_token_ids) == [7, 8]
    assert list(request.all_token_ids) == [1, 2, 3, 7, 8]


def test_append_empty_list_changes_nothing():
    request = make_request([1, 2, 3])
    request.append_output_token_ids([])
    assert request.num_tokens == 3


def test_num_tokens_with_spec_includes_spec_tokens():
    request = make_request([1, 2, 3])
    request.append_output_token_ids(4)
    request.spec_token_ids = [10, 11]
    assert request.num_tokens_with_spec == 6
    assert request.num_tokens == 4


def test_num_tokens_with_spec_without_spec_equals_num_tokens():
    request = make_request([1, 2, 3])
    assert request.num_tokens_with_spec == request.num_tokens


def test_append_extends_block_hashes_when_block_fills():
    request = make_request([1, 2, 3])
    assert request.block_hashes == []
    request.append_output_token_ids(4)
    assert len(request.block_hashes) == 1


# ------------------------------------------------------------------------------------------- read-only views
def test_output_token_ids_has_no_append():
    request = make_request([1, 2])
    with pytest.raises(AttributeError):
        request.output_token_ids.append(3)  # type: ignore[attr-defined]


def test_all_token_ids_has_no_append():
    request = make_request([1, 2])
    with pytest.raises(AttributeError):
        request.all_token_ids.append(3)  # type: ignore[attr-defined]


def test_all_token_ids_rejects_setitem():
    request = make_request([1, 2])
    with pytest.raises(TypeError):
        request.all_token_ids[0] = 5  # type: ignore[index]
    assert list(request.all_token_ids) == [1, 2]


def test_output_token_ids_rejects_setitem():
    request = make_request([1, 2])
    request.append_output_token_ids(3)
    with pytest.raises(TypeError):
        request.output_token_ids[0] = 5  # type: ignore[index]


def test_all_token_ids_rejects_delitem():
    request = make_request([1, 2])
    with pytest.raises(TypeError):
        del request.all_token_ids[0]  # type: ignore[attr-defined]


def test_output_token_ids_has_no_extend():
    request = make_request([1, 2])
    with pytest.raises(AttributeError):
        request.output_token_ids.extend([3])  # type: ignore[attr-defined]


def test_views_reflect_later_appends():
    request = make_request([1, 2])
    outputs = request.output_token_ids
    all_tokens = request.all_token_ids
    request.append_output_token_ids([3, 4])
    assert list(outputs) == [3, 4]
    assert list(all_tokens) == [1, 2, 3, 4]


def test_view_supports_indexing_slicing_and_len():
    request = make_request([5, 6, 7, 8])
    view = request.all_token_ids
    assert view[0] == 5
    assert view[-1] == 8
    assert view[1:3] == [6, 7]
    assert len(view) == 4


def test_view_supports_contains_and_equality():
    request = make_request([5, 6, 7])
    assert 6 in request.all_token_ids
    assert 9 not in request.all_token_ids
    assert request.all_token_ids == [5, 6, 7]


def test_view_copy_is_independent_list():
    request = make_request([5, 6, 7])
    copied = request.all_token_ids.copy()
    copied.append(8)
    assert request.num_tokens == 3


def test_view_is_unhashable():
    with pytest.raises(TypeError):
        hash(make_request([1]).all_token_ids)


# --------------------------------------------------------------------------------------------------- status
@pytest.mark.parametrize("status", FINISHED_STATUSES)
def test_finished_statuses_are_finished(status):
    assert RequestStatus.is_finished(status)


@pytest.mark.parametrize("status", UNFINISHED_STATUSES)
def test_unfinished_statuses_are_not_finished(status):
    assert not RequestStatus.is_finished(status)


@pytest.mark.parametrize("status", FINISHED_STATUSES + UNFINISHED_STATUSES)
def test_status_prints_and_formats_as_its_name(status):
    assert f"{status}" == str(status) == f"{status:s}" == status.name
    assert f"{status:>30}" == f"{status.name:>30}"


def test_status_formats_as_its_name_in_messages():
    assert f"{RequestStatus.WAITING}" == "WAITING"
    assert f"request is {RequestStatus.FINISHED_ERROR}" == "request is FINISHED_ERROR"


def test_statuses_still_order_like_ints():
    assert sorted(FINISHED_STATUSES + UNFINISHED_STATUSES) == list(RequestStatus)
    assert RequestStatus.PREEMPTED < RequestStatus.FINISHED_STOPPED


def test_request_is_finished_follows_status():
    request = make_request([1])
    assert not request.is_finished()
    request.status = RequestStatus.FINISHED_ABORTED
    assert request.is_finished()


@pytest.mark.parametrize(
    ("status", "reason"),
    [
        (RequestStatus.FINISHED_STOPPED, "stop"),
        (RequestStatus.FINISHED_LENGTH_CAPPED, "length"),
        (RequestStatus.FINISHED_ABORTED, "abort"),
    ],
)
def test_get_finished_reason(status, reason):
    request = make_request([1])
    request.status = status
    assert request.get_finished_reason() == reason


@pytest.mark.parametrize("status", FINISHED_STATUSES)
def test_every_finished_status_has_a_documented_reason(status):
    assert RequestStatus.get_finished_reason(status) in ("stop", "length", "abort", "error")


def test_a_request_that_failed_in_a_step_finishes_with_error():
    assert RequestStatus.get_finished_reason(RequestStatus.FINISHED_ERROR) == "error"


@pytest.mark.parametrize("status", UNFINISHED_STATUSES)
def test_unfinished_status_has_no_finished_reason(status):
    assert RequestStatus.get_finished_reason(status) is None


# ------------------------------------------------------------------------------------------- StreamingUpdate
def test_streaming_update_from_resumable_request_carries_prompt():
    request = make_request([1, 2], resumable=True, arrival_time=3.0)
    update = StreamingUpdate.from_request(request)
    assert update is not None
    assert update.prompt_token_ids == [1, 2]
    assert update.arrival_time == 3.0
    assert update.sampling_params is request.sampling_params


def test_streaming_update_from_closing_request_is_none():
    assert StreamingUpdate.from_request(make_request([])) is None


# ---------------------------------------------------------------------------------------------- extend_prompt
def test_extend_prompt_without_outputs_appends_chunk():
    request = make_request([1, 2, 3])
    request.extend_prompt([4, 5])
    assert list(request.prompt_token_ids) == [1, 2, 3, 4, 5]
    assert list(request.all_token_ids) == [1, 2, 3, 4, 5]
    assert request.num_prompt_tokens == 5


def test_extend_prompt_folds_outputs_except_last_sampled_token():
    request = make_request([1, 2, 3])
    request.append_output_token_ids([10, 11, 12])
    request.extend_prompt([20, 21])
    assert list(request.prompt_token_ids) == [1, 2, 3, 10, 11, 20, 21]
    assert list(request.all_token_ids) == [1, 2, 3, 10, 11, 20, 21]


def test_extend_prompt_clears_outputs():
    request = make_request([1, 2, 3])
    request.append_output_token_ids([10, 11])
    request.extend_prompt([20])
    assert list(request.output_token_ids) == []
    assert request.num_output_tokens == 0


def test_extend_prompt_updates_counts():
    request = make_request([1, 2, 3])
    request.append_output_token_ids([10, 11])
    request.extend_prompt([20, 21, 22])
    assert request.num_prompt_tokens == 7
    assert request.num_tokens == 7


def test_extend_prompt_keeps_views_live():
    request = make_request([1, 2, 3])
    outputs = request.output_token_ids
    all_tokens = request.all_token_ids
    request.append_output_token_ids([10, 11])
    request.extend_prompt([20])
    request.append_output_token_ids(30)
    assert list(outputs) == [30]
    assert list(all_tokens) == [1, 2, 3, 10, 20, 30]


def test_extend_prompt_rehashes_block_that_held_dropped_token():
    # Tokens [1..6] + outputs [7, 8]: the dropped token 8 sat in full block 1 ([5, 6, 7, 8]).
    request = make_request([1, 2, 3, 4, 5, 6])
    request.append_output_token_ids([7, 8])
    request.extend_prompt([20, 21, 22])
    expected = make_request([1, 2, 3, 4, 5, 6, 7, 20, 21, 22])
    assert request.block_hashes == expected.block_hashes
    assert len(request.block_hashes) == 2


def test_extend_prompt_keeps_hashes_of_blocks_before_dropped_token():
    request = make_request([1, 2, 3, 4, 5, 6])
    request.append_output_token_ids([7, 8])
    first_hash = request.block_hashes[0]
    request.extend_prompt([20, 21, 22])
    assert request.block_hashes[0] == first_hash


def test_extend_prompt_dropped_token_in_partial_block():
    # Tokens [1..8] + output 9: the dropped token 9 was in a partial block, both full blocks survive.
    request = make_request([1, 2, 3, 4, 5, 6, 7])
    request.append_output_token_ids([8, 9])
    request.extend_prompt([10, 11, 12, 13])
    assert (
        request.block_hashes == make_request([1, 2, 3, 4, 5, 6, 7, 8, 10, 11, 12, 13]).block_hashes
    )


def test_extend_prompt_dropped_token_first_of_block():
    # Tokens [1..4] + outputs [5, 6, 7, 8, 9]: token 9 starts block 2, which was partial.
    request = make_request([1, 2, 3, 4])
    request.append_output_token_ids([5, 6, 7, 8, 9])
    request.extend_prompt([30, 31, 32, 33])
    assert (
        request.block_hashes == make_request([1, 2, 3, 4, 5, 6, 7, 8, 30, 31, 32, 33]).block_hashes
    )


def test_extend_prompt_dropped_token_last_of_only_block():
    request = make_request([1, 2, 3])
    request.append_output_token_ids([4])
    request.extend_prompt([40, 41, 42, 43, 44])
    assert request.block_hashes == make_request([1, 2, 3, 40, 41, 42, 43, 44]).block_hashes


def test_extend_prompt_with_salt_matches_fresh_request():
    request = make_request([1, 2, 3], cache_salt="s")
    request.append_output_token_ids([4, 5])
    request.extend_prompt([6, 7, 8, 9])
    assert (
        request.block_hashes == make_request([1, 2, 3, 4, 6, 7, 8, 9], cache_salt="s").block_hashes
    )


def test_repeated_extend_prompt_matches_fresh_request():
    request = make_request([1, 2, 3])
    request.append_output_token_ids([4, 5, 6])
    request.extend_prompt([7, 8])
    request.append_output_token_ids([9, 10, 11, 12])
    request.extend_prompt([13])
    expected_tokens = [1, 2, 3, 4, 5, 7, 8, 9, 10, 11, 13]
    assert list(request.all_token_ids) == expected_tokens
    assert request.block_hashes == make_request(expected_tokens).block_hashes


def test_extend_prompt_then_append_hashes_incrementally():
    request = make_request([1, 2, 3, 4, 5, 6])
    request.append_output_token_ids([7, 8])
    request.extend_prompt([20])
    request.append_output_token_ids([21, 22, 23, 24])
    assert (
        request.block_hashes == make_request([1, 2, 3, 4, 5, 6, 7, 20, 21, 22, 23, 24]).block_hashes
    )
