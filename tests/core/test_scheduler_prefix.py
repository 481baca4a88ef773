"""Prefix caching at admission: hit sizes, shared blocks, stats, and that hits keep tokens correct."""

from __future__ import annotations

from sched_helpers import SimWorker, run_to_completion, step

from kvflow.testing import make_request, make_scheduler
from kvflow.testing.hash_model import reference_tokens

PREFIX = list(range(1000, 1032))  # two full blocks of 16


def admit(scheduler, request):
    scheduler.add_request(request)
    output, _ = step(scheduler)
    (new_req,) = [
        new_req for new_req in output.scheduled_new_reqs if new_req.req_id == request.request_id
    ]
    return output, new_req


def test_second_request_hits_two_block_prefix():
    scheduler = make_scheduler()
    admit(scheduler, make_request("a", [*PREFIX, 1, 2, 3, 4, 5, 6, 7, 8]))
    output, new_req = admit(scheduler, make_request("b", [*PREFIX, 9, 9, 9, 9, 9, 9, 9, 9]))
    assert new_req.num_computed_tokens == 32
    assert output.num_scheduled_tokens["b"] == 8
    assert scheduler.requests["b"].num_computed_tokens == 40


def test_prefix_hit_shares_block_ids():
    scheduler = make_scheduler()
    admit(scheduler, make_request("a", [*PREFIX, 1, 2, 3]))
    _, new_req = admit(scheduler, make_request("b", [*PREFIX, 4, 5, 6]))
    a_blocks = scheduler.kv_cache_manager.get_block_ids("a")[0]
    b_blocks = new_req.block_ids[0]
    assert b_blocks[:2] == a_blocks[:2]
    assert b_blocks[2] != a_blocks[2]


def test_identical_prompt_of_two_full_blocks_recomputes_last_block():
    scheduler = make_scheduler()
    admit(scheduler, make_request("a", list(PREFIX)))
    output, new_req = admit(scheduler, make_request("b", list(PREFIX)))
    assert new_req.num_computed_tokens == 16  # never the last prompt token
    assert output.num_scheduled_tokens["b"] == 16


def test_identical_prompt_one_past_block_boundary_hits_both_blocks():
    scheduler = make_scheduler()
    admit(scheduler, make_request("a", [*PREFIX, 5]))
    _, new_req = admit(scheduler, make_request("b", [*PREFIX, 5]))
    assert new_req.num_computed_tokens == 32


def test_partial_block_prefix_does_not_hit():
    scheduler = make_scheduler()
    admit(scheduler, make_request("a", [*PREFIX[:15], 1, 2]))
    _, new_req = admit(scheduler, make_request("b", [*PREFIX[:15], 3, 4]))
    assert new_req.num_computed_tokens == 0


def test_prefix_hit_after_first_request_finished():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", [*PREFIX, 1], max_tokens=2))
    run_to_completion(scheduler)
    assert scheduler.kv_cache_manager.usage == 0.0
    _, new_req = admit(scheduler, make_request("b", [*PREFIX, 2]))
    assert new_req.num_computed_tokens == 32


def test_generated_tokens_are_cached_too():
    scheduler = make_scheduler(block_size=4)
    prompt = [7] * 6
    scheduler.add_request(make_request("a", prompt, max_tokens=6))
    run_to_completion(scheduler)
    full = prompt + reference_tokens(prompt, 6)  # 12 tokens; the last one never had KV computed
    _, new_req = admit(scheduler, make_request("b", [*full[:11], 3]))
    assert new_req.num_computed_tokens == 8


def test_prefix_caching_disabled_gives_no_hits():
    scheduler = make_scheduler(enable_prefix_caching=False)
    admit(scheduler, make_request("a", [*PREFIX, 1]))
    output, new_req = admit(scheduler, make_request("b", [*PREFIX, 1]))
    assert new_req.num_computed_tokens == 0
    assert output.num_scheduled_tokens["b"] == 33
    assert set(new_req.block_ids[0]).isdisjoint(scheduler.kv_cache_manager.get_block_ids("a")[0])


def test_prefix_cache_stats_count_lookups():
    scheduler = make_scheduler()
    admit(scheduler, make_request("a", [*PREFIX, 1]))
    admit(scheduler, make_request("b", [*PREFIX, 2, 3]))
    admit(scheduler, make_request("c", list(PREFIX)))
    stats = scheduler.prefix_cache_stats
    assert stats.num_queries == 3
    assert stats.num_query_tokens == 33 + 34 + 32
    assert stats.num_hit_tokens == 0 + 32 + 16
    assert stats.hit_rate == 48 / 99


def test_num_cached_tokens_reported_in_engine_output():
    scheduler = make_scheduler()
    admit(scheduler, make_request("a", [*PREFIX, 1]))
    scheduler.add_request(make_request("b", [*PREFIX, 2]))
    _, outputs = step(scheduler)
    (b_output,) = [o for o in outputs if o.request_id == "b"]
    assert b_output.num_cached_tokens == 32


def test_same_step_admissions_share_prefix_and_tokens_are_correct():
    scheduler = make_scheduler()
    prompts = {"a": [*PREFIX, 1, 2], "b": [*PREFIX, 3], "c": [*PREFIX, 1, 2]}
    for req_id, prompt in prompts.items():
        scheduler.add_request(make_request(req_id, prompt, max_tokens=5))
    worker = SimWorker.for_scheduler(scheduler)
    outputs = []
    tokens = run_to_completion(
        scheduler, worker=worker, on_step=lambda output, _: outputs.append(output)
    )
    hits = {
        new_req.req_id: new_req.num_computed_tokens for new_req in outputs[0].scheduled_new_reqs
    }
    assert hits == {"a": 0, "b": 32, "c": 32}
    assert tokens == {req_id: reference_tokens(prompt, 5) for req_id, prompt in prompts.items()}


def test_prefix_hits_keep_tokens_correct_across_many_requests():
    scheduler = make_scheduler(
        block_size=4, max_num_batched_tokens=40, max_model_len=256, num_blocks=64
    )
    shared = list(range(500, 514))
    prompts = {str(i): shared[: 4 + i] + [i] * (i % 3 + 1) for i in range(10)}
    for req_id, prompt in prompts.items():
        scheduler.add_request(make_request(req_id, prompt, max_tokens=4))
    worker = SimWorker.for_scheduler(scheduler)
    tokens = run_to_completion(scheduler, worker=worker)
    assert tokens == {req_id: reference_tokens(prompt, 4) for req_id, prompt in prompts.items()}
    assert scheduler.prefix_cache_stats.num_hit_tokens > 0
