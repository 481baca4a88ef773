"""RequestSlots: slot take / free / reuse, token and block updates, and refusals that leave state unchanged."""

from __future__ import annotations

import pytest

from kvflow.sampling_params import SamplingParams
from kvflow.worker.states import RequestSlots


def make_slots(
    max_num_reqs: int = 3, max_model_len: int = 16, max_blocks_per_req: int = 4
) -> RequestSlots:
    return RequestSlots(max_num_reqs, max_model_len, max_blocks_per_req)


def test_add_takes_slots_in_order_and_stores_state() -> None:
    slots = make_slots()
    params = SamplingParams(max_tokens=3)
    assert slots.add("a", [1, 2, 3], [7], 1, params) == 0
    assert slots.add("b", [4, 5], [2, 9], 0) == 1
    assert slots.req_id_to_index == {"a": 0, "b": 1}
    assert slots.free_indices == [2]
    assert slots.get_token_ids("a") == [1, 2, 3]
    assert slots.get_block_ids("b") == [2, 9]
    assert slots.num_computed_tokens[0] == 1
    assert slots.sampling_params[0] is params
    assert slots.req_ids[:2] == ["a", "b"]
    assert "a" in slots and "c" not in slots and len(slots) == 2


def test_full_slots_raise_no_free_indices_and_change_nothing() -> None:
    slots = make_slots(max_num_reqs=2)
    slots.add("a", [1], [0], 0)
    slots.add("b", [2], [1], 0)
    with pytest.raises(AssertionError, match="No free indices"):
        slots.add("c", [3], [2], 0)
    assert slots.req_id_to_index == {"a": 0, "b": 1}
    assert slots.num_free == 0


def test_remove_frees_and_next_add_reuses_the_slot_without_stale_state() -> None:
    slots = make_slots(max_num_reqs=2)
    slots.add("a", [1, 2, 3, 4, 5], [3, 4], 4)
    slots.add("b", [9], [5], 0)
    assert slots.remove("a") == 0
    assert "a" not in slots and slots.free_indices == [0]
    assert slots.sampling_params[0] is None and slots.req_ids[0] is None
    assert slots.add("c", [7, 8], [6], 0) == 0
    assert slots.get_token_ids("c") == [7, 8]
    assert slots.get_block_ids("c") == [6]
    assert slots.num_computed_tokens[0] == 0
    assert slots.get_token_ids("b") == [9]


def test_remove_unknown_id_is_a_noop() -> None:
    slots = make_slots()
    slots.add("a", [1], [0], 0)
    assert slots.remove("zzz") is None
    assert slots.free_indices == [2, 1]
    assert slots.req_id_to_index == {"a": 0}


def test_slot_count_invariant_over_add_remove_sequence() -> None:
    slots = make_slots(max_num_reqs=3)
    for round_index in range(5):
        ids = [f"{round_index}-{i}" for i in range(3)]
        for req_id in ids:
            slots.add(req_id, [1], [0], 0)
        assert sorted(slots.req_id_to_index.values()) == [0, 1, 2]
        for req_id in ids[::2]:
            slots.remove(req_id)
        assert len(slots.free_indices) + len(slots.req_id_to_index) == 3
        assert set(slots.free_indices).isdisjoint(slots.req_id_to_index.values())
        for req_id in ids[1::2]:
            slots.remove(req_id)


def test_add_of_a_held_id_is_refused() -> None:
    slots = make_slots()
    slots.add("a", [1], [0], 0)
    with pytest.raises(ValueError, match="already holds slot 0"):
        slots.add("a", [2], [1], 0)
    assert slots.get_token_ids("a") == [1]


def test_write_tokens_truncates_then_extends() -> None:
    slots = make_slots()
    index = slots.add("a", [1, 2, 3, 4], [0], 2)
    slots.write_tokens(index, 2, [8, 9, 10])
    assert slots.get_token_ids("a") == [1, 2, 8, 9, 10]
    slots.write_tokens(index, 0, [5])
    assert slots.get_token_ids("a") == [5]
    with pytest.raises(ValueError, match="cannot write at 3"):
        slots.write_tokens(index, 3, [1])


def test_block_table_append_and_replace() -> None:
    slots = make_slots(max_blocks_per_req=4)
    index = slots.add("a", [1], [3], 0)
    slots.append_block_ids(index, [8, 1])
    assert slots.get_block_ids("a") == [3, 8, 1]
    slots.set_block_ids(index, [5])
    assert slots.get_block_ids("a") == [5]
    with pytest.raises(ValueError, match="max_blocks_per_req"):
        slots.append_block_ids(index, [1, 2, 3, 4])
    assert slots.get_block_ids("a") == [5]


@pytest.mark.parametrize(
    ("token_ids", "block_ids", "num_computed", "message"),
    [
        (list(range(17)), [0], 0, "max_model_len"),
        ([1], [0, 1, 2, 3, 4], 0, "max_blocks_per_req"),
        ([1, 2], [0], 3, "num_computed_tokens=3"),
        ([1, 2], [0], -1, "num_computed_tokens=-1"),
    ],
)
def test_failed_add_leaves_every_slot_free(
    token_ids: list[int], block_ids: list[int], num_computed: int, message: str
) -> None:
    slots = make_slots(max_model_len=16, max_blocks_per_req=4)
    with pytest.raises(ValueError, match=message):
        slots.add("a", token_ids, block_ids, num_computed)
    assert slots.num_free == 3 and not slots.req_id_to_index


def test_num_computed_tokens_cannot_pass_known_tokens() -> None:
    slots = make_slots()
    index = slots.add("a", [1, 2], [0], 0)
    slots.set_num_computed_tokens(index, 2)
    assert slots.num_computed_tokens[index] == 2
    with pytest.raises(ValueError, match="outside"):
        slots.set_num_computed_tokens(index, 3)
