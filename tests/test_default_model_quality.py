"""The shipped default model's quality, measured through kvflow's own engine.

The training script recorded the held-out perplexity of the shipped weights (`eval.json`, quoted in the model card),
computed with its own plain PyTorch model. kvflow must reproduce it through the engine (prompt logprobs): a numerics
bug in attention, a GEMM, RoPE, the KV cache or the loader shows up here as a perplexity that drifts, not just as a
different token.
"""

from __future__ import annotations

import json
import math
import re
import unicodedata
from pathlib import Path

import pytest

from kvflow import LLM, SamplingParams
from kvflow.default_model import (
    SAMPLE_SEPARATOR,
    SHIPPED_CHECKPOINT,
    ensure_default_model,
    perplexity_windows,
)
from kvflow.tokenizer import load_tokenizer

# float32 (what `dtype="auto"` picks for this checkpoint) runs the same arithmetic as the training script's evaluation,
# up to summation order; bfloat16 rounds every activation and may drift a little further.
TOLERANCE = {"auto": 1e-4, "bfloat16": 0.01}
DEMO_PROMPTS = ["The capital of France is", "Once upon a time", "She walked into the room and"]


def recorded_evaluation() -> dict:
    return json.loads((SHIPPED_CHECKPOINT / "eval.json").read_text())


def held_out_documents() -> list[str]:
    return (
        (SHIPPED_CHECKPOINT / "heldout_sample.txt")
        .read_text(encoding="utf-8")
        .split(SAMPLE_SEPARATOR)
    )


def kvflow_perplexity(
    llm: LLM, model_dir: Path, num_documents: int | None = None
) -> tuple[float, int]:
    """exp(mean NLL) of the held-out sample's windows (of its first `num_documents` documents; None: all), from
    the engine's prompt logprobs."""
    tokenizer = load_tokenizer(model_dir)
    windows = perplexity_windows(
        [tokenizer.encode(document) for document in held_out_documents()[:num_documents]],
        tokenizer.bos_token_id,
    )
    outputs = llm.generate(
        [{"prompt_token_ids": window} for window in windows],
        SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0),
        use_tqdm=False,
    )
    total, count = 0.0, 0
    for window, output in zip(windows, outputs, strict=True):
        assert output.prompt_logprobs is not None and output.prompt_logprobs[0] is None
        for token_id, entry in zip(window[1:], output.prompt_logprobs[1:], strict=True):
            total -= entry[token_id].logprob
            count += 1
    return math.exp(total / count), count


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["auto", "bfloat16"])
def test_held_out_perplexity_through_the_engine_matches_the_training_script(dtype: str) -> None:
    model_dir = ensure_default_model()
    recorded = recorded_evaluation()
    llm = LLM(str(model_dir), dtype=dtype, max_num_seqs=16, disable_log_stats=True)
    perplexity, count = kvflow_perplexity(llm, model_dir)
    assert count == recorded["sample_tokens"]
    drift = abs(perplexity / recorded["sample_ppl"] - 1)
    assert drift <= TOLERANCE[dtype], (
        f"kvflow's held-out perplexity ({dtype}) is {perplexity:.3f}, the training script measured "
        f"{recorded['sample_ppl']:.3f}: {100 * drift:.2f} % apart"
    )


def test_the_model_card_quotes_the_recorded_perplexity_and_the_model_learned_something() -> None:
    recorded = recorded_evaluation()
    card = (SHIPPED_CHECKPOINT / "README.md").read_text()
    assert f"{recorded['held_out_ppl']:.3f}" in card and f"{recorded['sample_ppl']:.3f}" in card
    vocab_size = json.loads((SHIPPED_CHECKPOINT / "config.json").read_text())["vocab_size"]
    # A model that learned nothing scores about the vocabulary size; this one must do far better.
    assert recorded["held_out_ppl"] < vocab_size / 40


def test_greedy_continuations_are_printable_english_words() -> None:
    """What `make demo` shows: every character printable (no raw control bytes from the byte-level vocabulary),
    and most words are words of the held-out English text."""
    llm = LLM(disable_log_stats=True)
    outputs = llm.generate(DEMO_PROMPTS, SamplingParams(temperature=0.0, max_tokens=32))
    english = {word.lower() for word in re.findall(r"[A-Za-z]+", " ".join(held_out_documents()))}
    for prompt, output in zip(DEMO_PROMPTS, outputs, strict=True):
        text = output.outputs[0].text
        assert len(output.outputs[0].token_ids) == 32 or output.outputs[0].finish_reason == "stop"
        controls = [ch for ch in text if ch != "\n" and unicodedata.category(ch).startswith("C")]
        assert not controls, f"{prompt!r} -> {text!r} holds control characters {controls!r}"
        assert "\ufffd" not in text, f"{prompt!r} -> {text!r} holds undecodable bytes"
        words = re.findall(r"[A-Za-z]+", text)
        assert len(words) >= 5, f"{prompt!r} -> {text!r}"
        known = sum(word.lower() in english for word in words)
        assert known >= 0.8 * len(words), (
            f"{prompt!r} -> {text!r}: {known} of {len(words)} words known"
        )


# The bounds for quantized forms of the model against float32 on the same windows (relative perplexity).
QUANTIZED_PERPLEXITY_TOLERANCE = {"int8": 0.005, "Q8_0": 0.005, "Q4_0": 0.05, "Q4_K_M": 0.05}
# The default suite scores the first document (~1/6 of the sample); the slow test all of them.
QUICK_DOCUMENTS = 1


# The 4-bit GGUF types quantize activations to int8 per block (as llama.cpp does); against the float32 model of the
# very weights in the file, that alone may move perplexity this much (measured: 0.01-0.04 %).
ACTIVATION_QUANTIZATION_TOLERANCE = 0.002
_LLM_OPTIONS = {"max_num_seqs": 16, "disable_log_stats": True}


def quantized_model(kind: str, model_dir: Path, tmp_path: Path) -> Path:
    """The default model as a GGUF file of type `kind` (the 384-wide rows take Q4_K_M's fallback, Q4_0; the
    1024-wide down projection is Q4_K / Q6_K), or the folder itself for int8 (quantized at load)."""
    if kind == "int8":
        return model_dir
    from kvflow.models.quantization.gguf_writer import write_gguf

    return write_gguf(model_dir, tmp_path / f"default-{kind}.gguf", kind)


def quantized_llm(kind: str, model_dir: Path, tmp_path: Path) -> LLM:
    path = quantized_model(kind, model_dir, tmp_path)
    if kind == "int8":
        return LLM(str(path), quantization="int8", **_LLM_OPTIONS)
    return LLM(str(path), tokenizer=str(model_dir), **_LLM_OPTIONS)


@pytest.fixture(scope="module")
def quick_float_perplexity() -> float:
    model_dir = ensure_default_model()
    llm = LLM(str(model_dir), max_num_seqs=16, disable_log_stats=True)
    try:
        return kvflow_perplexity(llm, model_dir, QUICK_DOCUMENTS)[0]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("kind", list(QUANTIZED_PERPLEXITY_TOLERANCE))
def test_quantized_held_out_perplexity_stays_near_float32(
    kind: str, tmp_path: Path, quick_float_perplexity: float
) -> None:
    model_dir = ensure_default_model()
    llm = quantized_llm(kind, model_dir, tmp_path)
    try:
        perplexity, _ = kvflow_perplexity(llm, model_dir, QUICK_DOCUMENTS)
    finally:
        llm.shutdown()
    drift = perplexity / quick_float_perplexity - 1
    assert abs(drift) <= QUANTIZED_PERPLEXITY_TOLERANCE[kind], (
        f"{kind}: held-out perplexity {perplexity:.3f}, float32 {quick_float_perplexity:.3f} "
        f"({100 * drift:.2f} % apart)"
    )


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_K_M"])
def test_a_4bit_file_scores_like_the_float32_model_of_its_own_weights(
    kind: str, tmp_path: Path
) -> None:
    """The 4-bit kernels (integer dots on int8-quantized activations) compute the file's model: the perplexity of
    the float32 checkpoint holding exactly the file's dequantized weights, up to activation quantization."""
    from kvflow.testing.gguf_files import dequantized_checkpoint

    model_dir = ensure_default_model()
    path = quantized_model(kind, model_dir, tmp_path)
    perplexities = []
    for model in (path, dequantized_checkpoint(path, model_dir, tmp_path / "dequantized")):
        llm = LLM(str(model), tokenizer=str(model_dir), **_LLM_OPTIONS)
        try:
            perplexities.append(kvflow_perplexity(llm, model_dir, QUICK_DOCUMENTS)[0])
        finally:
            llm.shutdown()
    quantized, dequantized = perplexities
    assert abs(quantized / dequantized - 1) <= ACTIVATION_QUANTIZATION_TOLERANCE, (
        f"{kind}: kvflow on the file {quantized:.4f}, the float32 model of its weights {dequantized:.4f}"
    )


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(QUANTIZED_PERPLEXITY_TOLERANCE))
def test_quantized_perplexity_on_the_whole_sample(kind: str, tmp_path: Path) -> None:
    """Against the training script's recorded float32 figure, on every window (the model card's measurement)."""
    model_dir = ensure_default_model()
    llm = quantized_llm(kind, model_dir, tmp_path)
    try:
        perplexity, count = kvflow_perplexity(llm, model_dir)
    finally:
        llm.shutdown()
    recorded = recorded_evaluation()
    assert count == recorded["sample_tokens"]
    drift = perplexity / recorded["sample_ppl"] - 1
    assert abs(drift) <= QUANTIZED_PERPLEXITY_TOLERANCE[kind], (
        f"{kind}: held-out perplexity {perplexity:.3f}, float32 {recorded['sample_ppl']:.3f}"
    )


# Every step of at most this many tokens, so that every product runs the GEMV (decode's kernel), not the prefill ones.
GEMV_ROWS = 8


def test_q8_0_decode_kernel_scores_like_the_float32_model_of_its_own_weights(
    tmp_path: Path,
) -> None:
    """Q8_0's GEMV (decode rows; by default on x quantized per 32, as llama.cpp's) computes the file's model: with
    steps of at most `GEMV_ROWS` tokens (chunked prefill, one request at a time) every window is scored by the decode
    kernel alone, and its perplexity is the float32 model's of exactly the file's weights, up to activation
    quantization. The default windows (prefill-sized steps) run W8A8 and never reach this kernel."""
    from kvflow.testing.gguf_files import dequantized_checkpoint

    model_dir = ensure_default_model()
    path = quantized_model("Q8_0", model_dir, tmp_path)
    llm = LLM(
        str(path),
        tokenizer=str(model_dir),
        max_num_seqs=1,
        max_num_batched_tokens=GEMV_ROWS,
        disable_log_stats=True,
    )
    try:
        quantized, _ = kvflow_perplexity(llm, model_dir, QUICK_DOCUMENTS)
    finally:
        llm.shutdown()
    llm = LLM(
        str(dequantized_checkpoint(path, model_dir, tmp_path / "dequantized")), **_LLM_OPTIONS
    )
    try:
        dequantized, _ = kvflow_perplexity(llm, model_dir, QUICK_DOCUMENTS)
    finally:
        llm.shutdown()
    assert abs(quantized / dequantized - 1) <= ACTIVATION_QUANTIZATION_TOLERANCE, (
        f"Q8_0 on its GEMV {quantized:.4f}, the float32 model of the file's weights {dequantized:.4f}"
    )
