"""Multi-LoRA end to end: real PEFT adapters on a tiny random Llama, served by `LLM(enable_lora=True)`, against the
PEFT-merged model in transformers (float32, greedy, token-exact): each target module set and rank alone, mixed in
one batch with base-model requests (whose rows stay bit-identical to a batch without adapters), under preemption
with one adapter slot, with both runner protocols, sync and async scheduling, speculative decoding, tensor
parallelism and int8 base weights; and the errors a user can make."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from kvflow import LLM, LoRARequest, SamplingParams
from kvflow.engine.async_llm import AsyncLLM
from kvflow.lora.punica import lora_add_reference
from kvflow.testing import hf_checkpoints
from tests.lora.adapters import (
    ALL_LINEAR,
    greedy_reference,
    make_peft_adapter,
    make_tiny_llama,
    merged_model,
)

MAX_TOKENS = 10
PROMPTS = [
    [5, 17, 300, 42, 9, 100, 7, 1000, 2000, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20],
    [11, 12, 13, 14],
    [900, 901, 902, 903, 904, 905, 906],
]
# name -> (target modules, rank, extra LoraConfig options)
ADAPTER_SPECS = {
    "qv": (("q_proj", "v_proj"), 8, {}),
    "attn": (("q_proj", "k_proj", "v_proj", "o_proj"), 4, {"use_rslora": True}),
    "mlp": (("gate_proj", "up_proj", "down_proj"), 16, {}),
    "all": (ALL_LINEAR, 8, {"rank_pattern": {"down_proj": 4}}),
}
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@dataclass
class LoRASetup:
    base: Path
    requests: dict[str, LoRARequest]
    # adapter name (or "base") -> the merged model's greedy tokens for each prompt
    references: dict[str, list[list[int]]]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> LoRASetup:
    folder = tmp_path_factory.mktemp("lora")
    base = make_tiny_llama(folder / "base")
    requests: dict[str, LoRARequest] = {}
    references = {
        "base": [
            greedy_reference(hf_checkpoints.load_hf_model(base), p, MAX_TOKENS) for p in PROMPTS
        ]
    }
    for adapter_id, (name, (targets, rank, options)) in enumerate(ADAPTER_SPECS.items(), 1):
        path = make_peft_adapter(
            base, folder / name, target_modules=targets, r=rank, seed=adapter_id, **options
        )
        requests[name] = LoRARequest(name, adapter_id, str(path))
        model = merged_model(base, path)
        references[name] = [greedy_reference(model, p, MAX_TOKENS) for p in PROMPTS]
    for name in ADAPTER_SPECS:  # each adapter changes what the model says
        assert references[name] != references["base"], name
    return LoRASetup(base, requests, references)


def make_llm(setup: LoRASetup, **options) -> LLM:
    defaults = dict(
        enable_lora=True,
        max_loras=4,
        max_lora_rank=16,
        dtype="float32",
        disable_log_stats=True,
        block_size=4,
    )
    model = options.pop("model", str(setup.base))
    return LLM(model, **{**defaults, **options})


def run_mix(llm: LLM, setup: LoRASetup, names: list[str], **generate_options):
    """Every prompt with every name in `names` ("base": no adapter), in one call; tokens by (name, prompt)."""
    pairs = [(name, index) for index in range(len(PROMPTS)) for name in names]
    outputs = llm.generate(
        [{"prompt_token_ids": PROMPTS[index]} for _, index in pairs],
        generate_options.pop("params", GREEDY),
        lora_request=[None if name == "base" else setup.requests[name] for name, _ in pairs],
        use_tqdm=False,
        **generate_options,
    )
    return {pair: output for pair, output in zip(pairs, outputs, strict=True)}


def assert_matches_references(setup: LoRASetup, outputs) -> None:
    """Each output's tokens are its adapter's (or the base's) reference, and it names the adapter it ran with."""
    for (name, index), output in outputs.items():
        assert list(output.outputs[0].token_ids) == setup.references[name][index], (
            f"{name}, prompt {index}"
        )
        assert output.lora_request == setup.requests.get(name)


def assert_only_adapter_rows_change(without, mixed, stride: int) -> None:
    """The same prompts run without adapters (`without`) and with adapters on every row but each `stride`-th
    (`mixed`): the base rows give the same tokens, and some adapter row does not."""
    for row in range(0, len(mixed), stride):
        assert mixed[row].outputs[0].token_ids == without[row].outputs[0].token_ids, f"row {row}"
    assert any(
        mixed[row].outputs[0].token_ids != without[row].outputs[0].token_ids
        for row in range(len(mixed))
        if row % stride
    )


def mixed_rows(setup: LoRASetup, stride: int) -> tuple[list[dict], list[LoRARequest | None]]:
    """Each prompt `stride` times; row r runs the base model when r % stride == 0, else one of the adapters."""
    prompts = [{"prompt_token_ids": prompt} for prompt in PROMPTS for _ in range(stride)]
    adapters = [setup.requests["all"], setup.requests["qv"]]
    lora_requests = [
        None if row % stride == 0 else adapters[row % stride - 1] for row in range(len(prompts))
    ]
    return prompts, lora_requests


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_each_adapter_alone_and_all_mixed_equal_the_peft_merged_model(
    setup: LoRASetup, async_scheduling: bool
) -> None:
    llm = make_llm(setup, async_scheduling=async_scheduling)
    try:
        for name in ADAPTER_SPECS:
            assert_matches_references(setup, run_mix(llm, setup, [name]))
        assert_matches_references(setup, run_mix(llm, setup, ["base", *ADAPTER_SPECS]))
        assert llm.list_loras() == {request.lora_int_id for request in setup.requests.values()}
    finally:
        llm.shutdown()


def test_base_rows_beside_adapters_are_bit_identical_to_the_same_batch_without_adapters(
    setup: LoRASetup,
) -> None:
    """The same batch twice, once with two of each prompt's three rows on adapters: the base rows' tokens and
    logprobs are the same floats (the adapter deltas touch only their own rows). Without prefix caching, so that
    both runs compute the same rows in every step (a prefix hit would shorten the second run's prefill)."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=3)
    prompts, lora_requests = mixed_rows(setup, stride=3)
    llm = make_llm(setup, enable_prefix_caching=False)
    try:
        without = llm.generate(prompts, params, use_tqdm=False)
        mixed = llm.generate(prompts, params, lora_request=lora_requests, use_tqdm=False)
    finally:
        llm.shutdown()
    assert_only_adapter_rows_change(without, mixed, stride=3)
    for row in range(0, len(prompts), 3):
        assert mixed[row].outputs[0].logprobs == without[row].outputs[0].logprobs  # exact floats


@pytest.mark.parametrize("use_v2_model_runner", [True, False], ids=["slot", "persistent"])
def test_one_adapter_slot_and_preemption_keep_every_request_exact(
    setup: LoRASetup, use_v2_model_runner: bool
) -> None:
    """One adapter slot for four adapters, a KV cache too small for the batch (preemptions): every request still
    equals its reference."""
    llm = make_llm(
        setup,
        max_loras=1,
        num_kv_blocks=16,
        max_model_len=48,
        max_num_batched_tokens=16,
        use_v2_model_runner=use_v2_model_runner,
    )
    try:
        outputs = run_mix(llm, setup, ["base", *ADAPTER_SPECS])
        preemptions = sum(stats.num_preemptions_total for stats in llm.scheduler_stats())
    finally:
        llm.shutdown()
    assert_matches_references(setup, outputs)
    assert preemptions > 0


def test_ngram_speculative_decoding_verifies_with_the_adapter(setup: LoRASetup) -> None:
    llm = make_llm(
        setup,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
    )
    try:
        outputs = run_mix(llm, setup, ["base", "all", "mlp"])
    finally:
        llm.shutdown()
    assert_matches_references(setup, outputs)


def test_two_tensor_parallel_ranks_apply_their_slices_of_each_adapter(setup: LoRASetup) -> None:
    llm = make_llm(setup, tensor_parallel_size=2, distributed_executor_backend="mp")
    try:
        outputs = run_mix(llm, setup, ["base", "all", "attn"])
    finally:
        llm.shutdown()
    assert_matches_references(setup, outputs)


def test_int8_base_weights_take_the_adapter_delta_in_the_model_dtype(setup: LoRASetup) -> None:
    """Beside int8 base products, a LoRA layer adds exactly the reference delta to the quantized product (on its
    rows only), base rows stay bit-identical to the same batch without adapters, and adapter rows change."""
    prompts, lora_requests = mixed_rows(setup, stride=2)
    llm = make_llm(setup, quantization="int8", enable_prefix_caching=False)
    try:
        without = llm.generate(prompts, GREEDY, use_tqdm=False)
        mixed = llm.generate(prompts, GREEDY, lora_request=lora_requests, use_tqdm=False)
        layer_check = llm.collective_rpc(_check_quantized_layer_delta)
    finally:
        llm.shutdown()
    assert layer_check == [True]
    assert_only_adapter_rows_change(without, mixed, stride=2)


def _check_quantized_layer_delta(worker) -> bool:
    """On the worker: layer 0's int8 qkv_proj with adapter slot 0 active for rows 1 and 3 gives the quantized
    product plus the reference delta on those rows only."""
    layer = worker.model.model.layers[0].self_attn.qkv_proj
    assert layer.quant_method is not None and layer.lora is not None
    hidden = torch.randn(5, layer.input_size, generator=torch.Generator().manual_seed(0))
    slots = torch.tensor([-1, 0, -1, 0, -1], dtype=torch.int32)
    state = layer.lora.state
    state.token_slots, state.output_token_slots = slots, None
    try:
        got = layer(hidden)
    finally:
        state.token_slots = None
    expected = layer.quant_method.apply(hidden, layer.bias)
    lora_add_reference(
        expected, hidden, layer.lora.lora_a, layer.lora.lora_b, slots, layer.lora.part_offsets
    )
    base = layer.quant_method.apply(hidden, layer.bias)
    return bool(
        torch.allclose(got, expected, atol=1e-5, rtol=1e-5)
        and torch.equal(got[[0, 2, 4]], base[[0, 2, 4]])
        and not torch.equal(got[1], base[1])
    )


def test_removing_an_adapter_while_its_requests_run_loses_nothing(setup: LoRASetup) -> None:
    """`remove_lora` mid-stream (the engine paused with the request kept, so steps remain): the request reloads
    the adapter from its folder and finishes exactly."""
    request = setup.requests["all"]

    async def scenario() -> tuple[list[int], set[int], set[int]]:
        engine = AsyncLLM(
            model=str(setup.base),
            enable_lora=True,
            max_loras=2,
            dtype="float32",
            disable_log_stats=True,
        )
        try:
            stream = engine.generate(
                {"prompt_token_ids": PROMPTS[0]}, GREEDY, request_id="r", lora_request=request
            )
            tokens: list[int] = []
            removed = False
            loaded_before: set[int] = set()
            async for output in stream:
                tokens = list(output.outputs[0].token_ids)
                if not removed:
                    # Paused with the request kept, so that it still has steps to run after the removal.
                    await engine.pause_generation(mode="keep")
                    loaded_before = await engine.list_loras()
                    assert await engine.remove_lora(request.lora_int_id)
                    assert request.lora_int_id not in await engine.list_loras()
                    removed = True
                    await engine.resume_generation()
            return tokens, loaded_before, await engine.list_loras()
        finally:
            engine.shutdown()

    tokens, loaded_before, loaded_after = asyncio.run(scenario())
    assert tokens == setup.references["all"][0]
    assert request.lora_int_id in loaded_before
    assert request.lora_int_id in loaded_after  # reloaded by the steps that still ran with it


def test_adapter_requests_are_errors_naming_what_is_wrong(setup: LoRASetup, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max_loras needs enable_lora"):
        LLM(str(setup.base), max_loras=2)
    plain = LLM(str(setup.base), dtype="float32", disable_log_stats=True)
    try:
        with pytest.raises(ValueError, match="LoRA is not enabled"):
            plain.generate("hello", GREEDY, lora_request=setup.requests["qv"], use_tqdm=False)
        assert plain.generate("hello", GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    finally:
        plain.shutdown()
    too_big = make_peft_adapter(setup.base, tmp_path / "r32", target_modules=["q_proj"], r=32)
    embedding = make_peft_adapter(
        setup.base, tmp_path / "embed", target_modules=["embed_tokens", "q_proj"]
    )
    llm = make_llm(setup, max_lora_rank=16)
    try:
        with pytest.raises(ValueError, match=r"rank 32.*max_lora_rank=16"):
            llm.generate("hi", GREEDY, lora_request=LoRARequest("big", 9, str(too_big)))
        with pytest.raises(ValueError, match="embed_tokens"):
            llm.generate("hi", GREEDY, lora_request=LoRARequest("emb", 10, str(embedding)))
        with pytest.raises(FileNotFoundError, match="missing"):
            llm.add_lora(LoRARequest("gone", 11, str(tmp_path / "missing")))
        with pytest.raises(ValueError, match="lora_request has 1 entries for 2 prompts"):
            llm.generate(["a", "b"], GREEDY, lora_request=[setup.requests["qv"]])
        with pytest.raises(ValueError, match="lora_request must be a LoRARequest"):
            llm.generate("a", GREEDY, lora_request="qv")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="lora_int_id must be >= 1"):
            LoRARequest("zero", 0, str(too_big))
        # the engine is unharmed: an adapter request still runs exactly
        assert_matches_references(setup, run_mix(llm, setup, ["qv"]))
    finally:
        llm.shutdown()


def test_draft_model_speculation_drafts_with_the_base_and_verifies_with_the_adapter(
    setup: LoRASetup,
) -> None:
    """The base checkpoint as its own draft model (no adapter): the adapter requests' drafts are often wrong,
    yet verification with the adapter keeps every token the merged model's."""
    llm = make_llm(
        setup,
        speculative_config={
            "method": "draft_model",
            "model": str(setup.base),
            "num_speculative_tokens": 3,
        },
    )
    try:
        outputs = run_mix(llm, setup, ["base", "all", "qv"])
    finally:
        llm.shutdown()
    assert_matches_references(setup, outputs)


def test_gguf_base_weights_serve_adapters(setup: LoRASetup, tmp_path: Path) -> None:
    """A GGUF file of the base: F32 blocks give the merged model's tokens exactly; on Q8_0 blocks the adapter's
    delta runs beside the quantized products, base rows untouched by it."""
    from tools.convert_to_gguf import convert

    f32 = convert(setup.base, tmp_path / "base-f32.gguf", dtype="f32", embed_hf_tokenizer=True)
    q8 = convert(setup.base, tmp_path / "base-q8.gguf", outtype="Q8_0", embed_hf_tokenizer=True)
    llm = make_llm(setup, model=str(f32))
    try:
        assert_matches_references(setup, run_mix(llm, setup, ["base", "all", "mlp"]))
    finally:
        llm.shutdown()
    prompts, lora_requests = mixed_rows(setup, stride=2)
    llm = make_llm(setup, model=str(q8), enable_prefix_caching=False)
    try:
        without = llm.generate(prompts, GREEDY, use_tqdm=False)
        mixed = llm.generate(prompts, GREEDY, lora_request=lora_requests, use_tqdm=False)
    finally:
        llm.shutdown()
    assert_only_adapter_rows_change(without, mixed, stride=2)


def test_chat_runs_each_conversation_with_its_adapter(setup: LoRASetup) -> None:
    conversation = [{"role": "user", "content": "Name a color."}]
    llm = make_llm(setup)
    try:
        chat = llm.chat(
            [conversation, conversation],
            GREEDY,
            use_tqdm=False,
            lora_request=[setup.requests["all"], None],
        )
        prompt = chat[0].prompt_token_ids
        direct = llm.generate(
            [{"prompt_token_ids": prompt}] * 2,
            GREEDY,
            use_tqdm=False,
            lora_request=[setup.requests["all"], None],
        )
    finally:
        llm.shutdown()
    assert [output.outputs[0].token_ids for output in chat] == [
        output.outputs[0].token_ids for output in direct
    ]
    assert chat[0].outputs[0].token_ids != chat[1].outputs[0].token_ids


def _has_fused_decode(worker) -> bool:
    return worker.model.fused_decode is not None


def _drop_fused_decode(worker) -> bool:
    """On the worker: send every step through the per-op layers; True when the model had a fused path."""
    had_fused = worker.model.fused_decode is not None
    worker.model.fused_decode = None
    return had_fused


def _fused_decode_took_adapters(worker) -> bool:
    """On the worker: whether the fused decode path ran a step with adapter rows (it gathers their slots then)."""
    fused = worker.model.fused_decode
    return fused is not None and fused._lora_args is not None


@pytest.mark.parametrize(
    ("dtype", "quantization"), [("bfloat16", None), ("float32", "int8")], ids=["bf16", "int8"]
)
def test_fused_decode_layer_adds_the_deltas_bit_for_bit_as_the_per_op_layers(
    setup: LoRASetup, dtype: str, quantization: str | None
) -> None:
    """On the C++ kernels (bfloat16 weights, or int8 beside float32 activations): decode steps with adapter rows
    stay on the fused decode layer, which adds each product's LoRA delta itself, and its tokens and logprobs are
    the per-op layers' exactly."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=2)
    prompts, lora_requests = mixed_rows(setup, stride=3)
    runs = []
    for fused in (True, False):
        llm = make_llm(
            setup,
            dtype=dtype,
            quantization=quantization,
            enable_prefix_caching=False,
            max_num_seqs=4,
        )
        try:
            if not llm.collective_rpc(_has_fused_decode)[0]:
                pytest.skip(
                    "no fused bfloat16 decode path on this CPU (needs the kernels on AVX-512)"
                )
            if not fused:
                assert llm.collective_rpc(_drop_fused_decode) == [True]
            outputs = llm.generate(prompts, params, lora_request=lora_requests, use_tqdm=False)
            if fused:
                assert llm.collective_rpc(_fused_decode_took_adapters) == [True]
        finally:
            llm.shutdown()
        runs.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs])
    assert runs[0] == runs[1]


def test_the_adapter_cache_keeps_max_cpu_loras_evicting_the_least_recently_used_but_never_a_pinned_one(
    setup: LoRASetup,
) -> None:
    names = list(ADAPTER_SPECS)
    llm = make_llm(setup, max_loras=1, max_cpu_loras=2)
    try:
        for name in names[:3]:
            assert llm.add_lora(setup.requests[name])
        assert llm.list_loras() == {setup.requests[name].lora_int_id for name in names[1:3]}
        assert not llm.pin_lora(setup.requests[names[0]].lora_int_id)  # evicted: nothing to pin
        assert llm.pin_lora(setup.requests[names[1]].lora_int_id)
        # names[1] is pinned and names[2] the least recently used: loading names[3] evicts names[2]
        assert_matches_references(setup, run_mix(llm, setup, [names[3]]))
        assert llm.list_loras() == {
            setup.requests[names[1]].lora_int_id,
            setup.requests[names[3]].lora_int_id,
        }
        assert llm.remove_lora(setup.requests[names[1]].lora_int_id)
        assert not llm.remove_lora(setup.requests[names[1]].lora_int_id)
        # evicted adapters come back from their folders when a request names them
        assert_matches_references(setup, run_mix(llm, setup, ["base", names[0], names[2]]))
    finally:
        llm.shutdown()


def test_two_data_parallel_engine_cores_each_serve_the_adapters(setup: LoRASetup) -> None:
    """`data_parallel_size=2`: `add_lora` reaches both cores, and requests routed to either one run their adapter
    exactly."""
    llm = make_llm(setup, data_parallel_size=2, max_loras=2)
    try:
        outputs = run_mix(llm, setup, ["base", "all", "attn"])
        loaded = llm.list_loras()
    finally:
        llm.shutdown()
    assert_matches_references(setup, outputs)
    assert loaded == {setup.requests["all"].lora_int_id, setup.requests["attn"].lora_int_id}


def test_parallel_samples_all_run_the_adapter(setup: LoRASetup) -> None:
    """`n=2`: both samples run with the prompt's adapter, and the folded output names it."""
    params = SamplingParams(n=2, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    llm = make_llm(setup)
    try:
        [output] = llm.generate(
            [{"prompt_token_ids": PROMPTS[1]}],
            params,
            lora_request=setup.requests["mlp"],
            use_tqdm=False,
        )
    finally:
        llm.shutdown()
    assert [list(sample.token_ids) for sample in output.outputs] == [setup.references["mlp"][1]] * 2
    assert output.lora_request == setup.requests["mlp"]
