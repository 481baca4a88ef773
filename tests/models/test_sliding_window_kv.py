"""Sliding-window layers hold only their window (KV cache groups, `KVCacheLayout`): Gemma 2 (alternating layers),
Gemma 3 (local/global) and Mixtral (every layer slides) on tiny random checkpoints.

The memory test steps an `EngineCore` on a long Gemma 2 request and reads the scheduler's KV cache manager after
every step: the sliding group's blocks stay within a window while the full group grows, and the request costs fewer
bytes than one table of whole-sequence blocks across all layers. The other tests check transformers' greedy output
token for token through `LLM` / `EngineCore` with prompts several windows long, chunked prefill, prefix hits longer
than a window, preemption under a small cache, both runner protocols and async scheduling.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from family_suite import Checkpoint, random_prompt
from test_gemma2_vs_hf import SLIDING_WINDOW as GEMMA2_WINDOW
from test_gemma2_vs_hf import make_gemma2_checkpoint
from test_gemma3_vs_hf import make_gemma3_checkpoint
from test_mixtral_vs_hf import make_mixtral_checkpoint

from kvflow import LLM, SamplingParams
from kvflow.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvflow.core.hybrid_kv_cache_manager import HybridKVCacheManager
from kvflow.engine.core import EngineCore
from kvflow.request import Request
from kvflow.testing.hf_checkpoints import load_hf_model
from kvflow.utils import cdiv

VOCAB_SIZE = 384
BLOCK_SIZE = 4
MAKERS = {
    "gemma2": make_gemma2_checkpoint,
    "gemma3": make_gemma3_checkpoint,
    "mixtral": make_mixtral_checkpoint,
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Checkpoint]:
    made: dict[str, Checkpoint] = {}
    for family, maker in MAKERS.items():
        path = maker(tmp_path_factory.mktemp(family))
        made[family] = Checkpoint(path, load_hf_model(path))
    return made


def prompt(seed: int, length: int) -> list[int]:
    return random_prompt(seed, length, VOCAB_SIZE)


def make_core(path: Path, *, num_kv_blocks: int, **scheduler_options: object) -> EngineCore:
    return EngineCore(
        EngineConfig(
            model_config=ModelConfig(model=str(path), max_model_len=256),
            cache_config=CacheConfig(block_size=BLOCK_SIZE, num_kv_blocks=num_kv_blocks),
            scheduler_config=SchedulerConfig(
                max_num_seqs=4, max_num_batched_tokens=16, max_model_len=256, **scheduler_options
            ),
        )
    )  # type: ignore[arg-type]


def greedy_request(request_id: str, prompt_token_ids: list[int], max_tokens: int) -> Request:
    return Request(
        request_id,
        prompt_token_ids,
        SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
    )


def test_gemma2_sliding_group_holds_its_window_while_the_full_group_grows(
    checkpoints: dict[str, Checkpoint],
) -> None:
    checkpoint = checkpoints["gemma2"]
    core = make_core(checkpoint.path, num_kv_blocks=256)
    try:
        manager = core.scheduler.kv_cache_manager
        assert isinstance(manager, HybridKVCacheManager)
        assert manager.group_windows == (None, GEMMA2_WINDOW)
        model = core.executor.worker.model
        # Four layers, two per group: one tensor per pair, so a block costs two layers' K/V, not four.
        assert model.kv_cache_layout.num_pages == 2
        assert core.executor.worker.model_runner.kv_cache.shape[0] == 2
        bytes_per_block = model.kv_cache_bytes_per_block(BLOCK_SIZE)
        single_group_bytes_per_block = bytes_per_block * model.num_layers // 2

        long_prompt = prompt(1, 50)
        core.add_request(greedy_request("long", long_prompt, 70))
        tokens: list[int] = []
        null_id = manager.null_block.block_id
        # In a decode step the sliding group holds the window before the token and the token's block.
        decode_bound = cdiv(GEMMA2_WINDOW, BLOCK_SIZE) + 1
        max_held_sliding = 0
        while core.has_work():
            for output in core.step():
                tokens.extend(output.new_token_ids)
            request = core.scheduler.requests.get("long")
            if request is None:
                break
            full_ids, sliding_ids = manager.get_block_ids("long")
            held_sliding = [block_id for block_id in sliding_ids if block_id != null_id]
            assert null_id not in full_ids
            assert (
                len(full_ids) == len(sliding_ids) >= cdiv(request.num_computed_tokens, BLOCK_SIZE)
            )
            if request.num_computed_tokens > len(long_prompt):
                assert len(held_sliding) <= decode_bound, (request.num_computed_tokens, sliding_ids)
            max_held_sliding = max(max_held_sliding, len(held_sliding))
            num_used = (
                manager.block_pool.num_usable_blocks - manager.block_pool.get_num_free_blocks()
            )
            assert num_used == len(full_ids) + len(held_sliding)
            # Bytes held now vs one table of whole-sequence blocks across all layers.
            if request.num_computed_tokens > 2 * GEMMA2_WINDOW:
                assert num_used * bytes_per_block < len(full_ids) * single_group_bytes_per_block
        assert len(full_ids) >= cdiv(len(long_prompt) + 69, BLOCK_SIZE)
        assert max_held_sliding <= cdiv(GEMMA2_WINDOW - 1 + 16, BLOCK_SIZE) + 1  # a 16-token chunk
        assert tokens == checkpoint.greedy(long_prompt, 70)
        assert manager.block_pool.get_num_free_blocks() == manager.block_pool.num_usable_blocks
    finally:
        core.shutdown()


@pytest.mark.parametrize("family", ["gemma2", "gemma3", "mixtral"])
@pytest.mark.parametrize(
    ("use_v2_model_runner", "async_scheduling"), [(True, False), (True, True), (False, False)]
)
def test_llm_long_prompts_and_prefix_hits_past_the_window_are_token_exact(
    checkpoints: dict[str, Checkpoint],
    family: str,
    use_v2_model_runner: bool,
    async_scheduling: bool,
) -> None:
    """Prompts of several windows, 16-token chunks, and a prefix hit of 36 tokens (past every window) whose
    sliding groups revive only their window's blocks; greedy output equals transformers'."""
    checkpoint = checkpoints[family]
    first = prompt(30, 45)
    prompts = [first, first[:37] + prompt(31, 10), prompt(32, 30)]
    llm = LLM(
        str(checkpoint.path),
        skip_tokenizer_init=True,
        disable_log_stats=True,
        block_size=BLOCK_SIZE,
        max_num_batched_tokens=16,
        max_num_seqs=4,
        num_kv_blocks=400,
        use_v2_model_runner=use_v2_model_runner,
        async_scheduling=async_scheduling,
    )
    try:
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        llm.generate([{"prompt_token_ids": first}], params, use_tqdm=False)  # fills the cache
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        llm.shutdown()
    cached = [output.metrics.num_cached_tokens if output.metrics else None for output in outputs]
    assert cached[0] == 44 and cached[1] == 36, cached
    for prompt_token_ids, output in zip(prompts, outputs, strict=True):
        assert list(output.outputs[0].token_ids) == checkpoint.greedy(prompt_token_ids, 24)


@pytest.mark.parametrize("family", ["gemma2", "gemma3", "mixtral"])
@pytest.mark.parametrize(
    ("use_v2_model_runner", "async_scheduling"), [(True, False), (True, True), (False, False)]
)
def test_preemption_under_a_small_cache_is_token_exact(
    checkpoints: dict[str, Checkpoint],
    family: str,
    use_v2_model_runner: bool,
    async_scheduling: bool,
) -> None:
    """Three long requests in a cache too small for them all: preempted requests recompute (hitting their own
    freed-window blocks where still cached) and every output equals transformers'."""
    checkpoint = checkpoints[family]
    num_kv_blocks = {"gemma2": 40, "gemma3": 52, "mixtral": 14}[family]
    core = make_core(
        checkpoint.path,
        num_kv_blocks=num_kv_blocks,
        use_v2_model_runner=use_v2_model_runner,
        async_scheduling=async_scheduling,
    )
    prompts = {str(index): prompt(40 + index, 30 + 7 * index) for index in range(3)}
    tokens: dict[str, list[int]] = {request_id: [] for request_id in prompts}
    try:
        for request_id, prompt_token_ids in prompts.items():
            core.add_request(greedy_request(request_id, prompt_token_ids, 30))
        for _ in range(2000):
            if not core.has_work():
                break
            for output in core.step():
                tokens[output.request_id].extend(output.new_token_ids)
        assert not core.has_work()
        assert core.scheduler.num_preemptions_total > 0
        manager = core.scheduler.kv_cache_manager
        assert manager.block_pool.get_num_free_blocks() == manager.block_pool.num_usable_blocks
        assert core.scheduler.reset_prefix_cache()
    finally:
        core.shutdown()
    for request_id, prompt_token_ids in prompts.items():
        assert tokens[request_id] == checkpoint.greedy(prompt_token_ids, 30), request_id


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_speculative_decoding_on_a_hybrid_model_is_token_exact(
    checkpoints: dict[str, Checkpoint], method: str, async_scheduling: bool
) -> None:
    """Gemma 2 verifying drafts (n-gram lookup on a repetitive prompt, or itself as the draft model, which reads the
    full group's blocks through a KV tensor per layer): greedy output equals transformers'; the draft model's
    drafts are all accepted, so its K/V was read back right."""
    checkpoint = checkpoints["gemma2"]
    pattern = prompt(50, 12)
    prompts = [pattern * 4, prompt(51, 40)]
    spec: dict[str, object] = {"method": method, "num_speculative_tokens": 3}
    if method == "draft_model":
        spec["model"] = str(checkpoint.path)
    llm = LLM(
        str(checkpoint.path),
        skip_tokenizer_init=True,
        disable_log_stats=True,
        block_size=BLOCK_SIZE,
        max_num_batched_tokens=16,
        max_num_seqs=4,
        num_kv_blocks=400,
        async_scheduling=async_scheduling,
        speculative_config=spec,
    )
    try:
        params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        stats = llm.run_in_engine(lambda core: core.scheduler.spec_decoding_stats)
    finally:
        llm.shutdown()
    for prompt_token_ids, output in zip(prompts, outputs, strict=True):
        assert list(output.outputs[0].token_ids) == checkpoint.greedy(prompt_token_ids, 30)
    assert stats.num_draft_tokens > 0
    if method == "draft_model":
        assert stats.num_accepted_tokens == stats.num_draft_tokens


def test_tensor_parallel_hybrid_model_is_token_exact(checkpoints: dict[str, Checkpoint]) -> None:
    """Two ranks, each with its KV heads in the grouped layout, on a long prompt with chunked prefill."""
    checkpoint = checkpoints["gemma2"]
    long_prompt = prompt(60, 45)
    llm = LLM(
        str(checkpoint.path),
        skip_tokenizer_init=True,
        disable_log_stats=True,
        block_size=BLOCK_SIZE,
        max_num_batched_tokens=16,
        num_kv_blocks=400,
        tensor_parallel_size=2,
    )
    try:
        params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": long_prompt}], params, use_tqdm=False)
    finally:
        llm.shutdown()
    assert list(outputs[0].outputs[0].token_ids) == checkpoint.greedy(long_prompt, 20)


def run_core(core: EngineCore, tokens: dict[str, list[int]], max_steps: int = 2000) -> None:
    for _ in range(max_steps):
        if not core.has_work():
            return
        for output in core.step():
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
    raise AssertionError("engine did not go idle")


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_forced_reset_abort_and_streaming_session_on_a_hybrid_model(
    checkpoints: dict[str, Checkpoint], async_scheduling: bool
) -> None:
    """Gemma 2 in one engine: a forced prefix-cache reset preempts long requests mid-run (they recompute), an abort
    frees a request's blocks in both groups, and a streaming session's second chunk continues after its kept
    history, past several windows; every output equals transformers' greedy continuation."""
    checkpoint = checkpoints["gemma2"]
    core = make_core(checkpoint.path, num_kv_blocks=300, async_scheduling=async_scheduling)
    manager = core.scheduler.kv_cache_manager
    pool = manager.block_pool
    try:
        prompts = {str(index): prompt(70 + index, 25 + 5 * index) for index in range(3)}
        for request_id, prompt_token_ids in prompts.items():
            core.add_request(greedy_request(request_id, prompt_token_ids, 20))
        core.add_request(greedy_request("aborted", prompt(79, 40), 20))
        tokens: dict[str, list[int]] = {}
        for _ in range(8):
            for output in core.step():
                tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
        core.abort_requests(["aborted"])
        assert core.reset_prefix_cache(reset_running_requests=True)
        run_core(core, tokens)
        for request_id, prompt_token_ids in prompts.items():
            assert tokens[request_id] == checkpoint.greedy(prompt_token_ids, 20), request_id
        assert pool.get_num_free_blocks() == pool.num_usable_blocks

        first_chunk, second_chunk = prompt(80, 30), prompt(81, 12)
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        core.add_request(Request("session", first_chunk, params, resumable=True))
        session_tokens: dict[str, list[int]] = {}
        run_core(core, session_tokens)
        first_outputs = session_tokens["session"]
        assert first_outputs == checkpoint.greedy(first_chunk, 6)
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        core.add_request(Request("session", second_chunk, params, resumable=False))
        session_tokens = {}
        run_core(core, session_tokens)
        # The chunk replaces the session's last sampled token, never fed to the model.
        history = first_chunk + first_outputs[:-1] + second_chunk
        assert session_tokens["session"] == checkpoint.greedy(history, 8)
        assert pool.get_num_free_blocks() == pool.num_usable_blocks
    finally:
        core.shutdown()


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_without_prefix_caching_freed_window_blocks_are_reused_first(
    checkpoints: dict[str, Checkpoint], family: str, async_scheduling: bool
) -> None:
    """No prefix caching: a sliding group's out-of-window blocks carry no hash and go back to the head of the free
    queue, where the next allocation takes them; three long requests in a 110-block cache (Gemma 3's would need 216
    blocks at once without freeing) still give transformers' outputs."""
    checkpoint = checkpoints[family]
    prompts = [prompt(90 + index, 35 + 6 * index) for index in range(3)]
    llm = LLM(
        str(checkpoint.path),
        skip_tokenizer_init=True,
        disable_log_stats=True,
        block_size=BLOCK_SIZE,
        max_num_batched_tokens=16,
        max_num_seqs=3,
        max_model_len=128,
        num_kv_blocks=110,
        enable_prefix_caching=False,
        async_scheduling=async_scheduling,
    )
    try:
        params = SamplingParams(max_tokens=25, temperature=0.0, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        llm.shutdown()
    for prompt_token_ids, output in zip(prompts, outputs, strict=True):
        assert list(output.outputs[0].token_ids) == checkpoint.greedy(prompt_token_ids, 25)
        assert output.metrics is None or output.metrics.num_cached_tokens == 0
