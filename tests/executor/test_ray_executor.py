"""The `ray` executor on a local Ray instance this module starts (2 CPUs, no dashboard): TP=2 greedy outputs equal
one rank's and transformers', RPCs come back in rank order, a killed actor fails the engine naming its rank, and
shutdown leaves no live actor.

Ray is the optional extra `kvflow[ray]` (CI installs it): without it these tests FAIL saying how to install it.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvflow import LLM, SamplingParams
from kvflow.engine.death import EngineDeadError
from kvflow.executor.broadcast import WorkerDiedError
from kvflow.testing.hf_checkpoints import hf_greedy, load_hf_model, make_tiny_checkpoint

MAX_TOKENS = 10
OPTIONS: dict[str, Any] = dict(
    dtype="float32",
    skip_tokenizer_init=True,
    max_model_len=96,
    block_size=4,
    num_kv_blocks=48,
    max_num_batched_tokens=32,
    max_num_seqs=4,
)


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        pytest.fail(
            "the Ray executor tests need Ray, which is not installed: pip install 'kvflow[ray]'"
        )
    return ray


@pytest.fixture(scope="module")
def ray_instance() -> Iterator[Any]:
    ray = import_ray()
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1")
    yield ray
    ray.shutdown()


def _live_actor_pids(ray: Any) -> list[int]:
    """Pids of the actors the Ray cluster still counts as alive (from its control store)."""
    actors = ray._private.state.actors()
    return [actor["Pid"] for actor in actors.values() if actor["State"] != "DEAD"]


def test_tp2_on_ray_matches_one_rank_and_transformers_and_leaves_no_actor(
    ray_instance: Any, tmp_path: Path
) -> None:
    path = make_tiny_checkpoint(tmp_path, "llama", seed=5, num_key_value_heads=2)
    rng = random.Random(9)
    prompts = [[rng.randrange(3, 300) for _ in range(length)] for length in (5, 38, 14, 27, 9)]
    hf_model = load_hf_model(path)
    expected = [hf_greedy(path, prompt, MAX_TOKENS, hf_model) for prompt in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    batch = [{"prompt_token_ids": prompt} for prompt in prompts]

    one_rank = LLM(str(path), **OPTIONS)
    assert [
        list(o.outputs[0].token_ids) for o in one_rank.generate(batch, params, use_tqdm=False)
    ] == expected

    llm = LLM(str(path), tensor_parallel_size=2, distributed_executor_backend="ray", **OPTIONS)
    try:
        outputs = llm.generate(batch, params, use_tqdm=False)
        assert [list(output.outputs[0].token_ids) for output in outputs] == expected
        infos = llm.collective_rpc("rank_info")
        assert [info["rank"] for info in infos] == [0, 1]
        assert [info["kv_cache_shape"][2] for info in infos] == [1, 1]  # 2 KV heads, 1 per rank
        assert sorted(_live_actor_pids(ray_instance)) == sorted(info["pid"] for info in infos)
        # A rank's actor dies: the next step fails naming that rank (no hang), and so does every later call.
        ray_instance.kill(llm.run_in_engine(lambda core: core.executor.actors[1]), no_restart=True)
        with pytest.raises(
            EngineDeadError, match=r"tensor-parallel rank 1 \(Ray actor\) died or failed"
        ) as died:
            llm.generate(batch[:2], params, use_tqdm=False)
        assert isinstance(died.value.__cause__, WorkerDiedError)
        with pytest.raises(EngineDeadError, match="rank 1"):
            llm.collective_rpc("rank_info")
    finally:
        llm.shutdown()
    deadline = time.monotonic() + 30
    while _live_actor_pids(ray_instance):
        assert time.monotonic() < deadline, f"actors left: {_live_actor_pids(ray_instance)}"
        time.sleep(0.1)


def test_missing_ray_is_an_import_error_naming_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from kvflow.executor.ray_executor import import_ray as executor_import_ray

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'kvflow\[ray\]'"):
        executor_import_ray()
