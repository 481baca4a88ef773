"""generation_config.json sampling defaults (vLLM's behaviour): the model creator's temperature, top_p, top_k, min_p,
repetition_penalty and max_new_tokens become the defaults of requests that pass no SamplingParams, unless
generation_config="kvflow" (or "vllm"); a folder path reads that folder's file instead."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

import pytest

from kvflow import LLM, AsyncLLM, SamplingParams
from kvflow.testing.hf_checkpoints import make_tiny_checkpoint

PROMPT = {"prompt_token_ids": [5, 17, 42, 9, 77]}
CREATOR_DEFAULTS = {
    "temperature": 0.6,
    "top_p": 0.9,
    "top_k": 20,
    "min_p": 0.05,
    "repetition_penalty": 1.1,
}
ENGINE_OPTIONS: dict[str, Any] = dict(
    dtype="float32", skip_tokenizer_init=True, max_num_seqs=4, max_model_len=64
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama whose generation_config.json recommends sampling settings (and keeps its EOS ids)."""
    folder = make_tiny_checkpoint(tmp_path_factory.mktemp("creator-defaults"), "llama")
    write_generation_config(folder, **CREATOR_DEFAULTS, do_sample=True)
    return folder


@pytest.fixture(scope="module")
def greedy_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama whose creator recommends greedy decoding and 5 new tokens."""
    folder = make_tiny_checkpoint(tmp_path_factory.mktemp("greedy-defaults"), "llama")
    write_generation_config(folder, temperature=0.0, max_new_tokens=5)
    return folder


def write_generation_config(folder: Path, **sampling: Any) -> None:
    path = folder / "generation_config.json"
    data = json.loads(path.read_text()) if path.is_file() else {}
    path.write_text(json.dumps({**data, **sampling}))


def test_checkpoint_defaults_become_the_default_sampling_params(checkpoint: Path) -> None:
    params = LLM(str(checkpoint), **ENGINE_OPTIONS).get_default_sampling_params()
    assert {name: getattr(params, name) for name in CREATOR_DEFAULTS} == CREATOR_DEFAULTS
    assert params.max_tokens == SamplingParams().max_tokens  # the file sets no max_new_tokens


def test_default_sampling_params_is_a_copy(checkpoint: Path) -> None:
    llm = LLM(str(checkpoint), **ENGINE_OPTIONS)
    params = llm.get_default_sampling_params()
    params.temperature = 0.0
    assert llm.get_default_sampling_params().temperature == 0.6


def test_overridden_defaults_are_logged_once_at_info(
    checkpoint: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="kvflow"):
        llm = LLM(str(checkpoint), **ENGINE_OPTIONS)
        llm.generate(PROMPT, use_tqdm=False)
    messages = [
        r.getMessage() for r in caplog.records if "Default sampling parameters" in r.message
    ]
    assert len(messages) == 1
    assert "temperature=0.6" in messages[0] and "top_k=20" in messages[0]
    assert "generation_config='kvflow'" in messages[0]


@pytest.mark.parametrize("source", ["kvflow", "vllm"])
def test_generation_config_kvflow_or_vllm_ignores_the_file(checkpoint: Path, source: str) -> None:
    llm = LLM(str(checkpoint), generation_config=source, **ENGINE_OPTIONS)
    assert llm.get_default_sampling_params() == SamplingParams()


def test_generation_config_folder_reads_that_folder(checkpoint: Path, tmp_path: Path) -> None:
    write_generation_config(tmp_path, temperature=0.3, top_k=5)
    llm = LLM(str(checkpoint), generation_config=str(tmp_path), **ENGINE_OPTIONS)
    params = llm.get_default_sampling_params()
    assert (params.temperature, params.top_k, params.top_p) == (0.3, 5, 1.0)


def test_generation_config_folder_without_the_file_is_a_value_error(
    checkpoint: Path, tmp_path: Path
) -> None:
    with pytest.raises(
        ValueError, match=r"generation_config=.*generation_config\.json does not exist"
    ):
        LLM(str(checkpoint), generation_config=str(tmp_path), **ENGINE_OPTIONS)


def test_unknown_generation_config_source_is_a_value_error(checkpoint: Path) -> None:
    with pytest.raises(ValueError, match="generation_config must be 'auto'"):
        LLM(str(checkpoint), generation_config="hf", **ENGINE_OPTIONS)


def test_generate_without_params_uses_the_creator_defaults(greedy_checkpoint: Path) -> None:
    llm = LLM(str(greedy_checkpoint), **ENGINE_OPTIONS)
    [default_output] = llm.generate(PROMPT, use_tqdm=False)
    [greedy_output] = llm.generate(
        PROMPT, SamplingParams(temperature=0.0, max_tokens=5), use_tqdm=False
    )
    assert len(default_output.outputs[0].token_ids) == 5
    assert default_output.outputs[0].token_ids == greedy_output.outputs[0].token_ids
    # Explicit params are the user's, whole: the creator's max_new_tokens does not cap them.
    [explicit] = llm.generate(PROMPT, SamplingParams(max_tokens=9, ignore_eos=True), use_tqdm=False)
    assert len(explicit.outputs[0].token_ids) == 9


def test_async_generate_without_params_uses_the_creator_defaults(greedy_checkpoint: Path) -> None:
    async def run() -> tuple[list[int], list[int], SamplingParams]:
        engine = AsyncLLM(str(greedy_checkpoint), **ENGINE_OPTIONS)
        try:
            outputs = [out async for out in engine.generate(PROMPT, request_id="default")]
            greedy = SamplingParams(temperature=0.0, max_tokens=5)
            references = [out async for out in engine.generate(PROMPT, greedy, "greedy")]
            return (
                outputs[-1].outputs[0].token_ids,
                references[-1].outputs[0].token_ids,
                engine.get_default_sampling_params(),
            )
        finally:
            engine.shutdown()

    tokens, reference, defaults = asyncio.run(run())
    assert (defaults.temperature, defaults.max_tokens) == (0.0, 5)
    assert len(tokens) == 5 and tokens == reference


@pytest.mark.parametrize(
    ("key", "value"),
    [("temperature", "hot"), ("top_p", 0), ("top_k", 2.5), ("repetition_penalty", -1)],
)
def test_bad_value_names_the_file_and_key(tmp_path: Path, key: str, value: Any) -> None:
    folder = make_tiny_checkpoint(tmp_path / "bad", "llama")
    write_generation_config(folder, **{key: value})
    with pytest.raises(ValueError, match=rf"generation_config\.json: {key}="):
        LLM(str(folder), **ENGINE_OPTIONS)


def test_models_without_creator_defaults_use_kvflow_defaults(tmp_path: Path) -> None:
    from kvflow.default_model.random_weights import build_random_model

    assert LLM("hash", max_model_len=64, num_kv_blocks=16).get_default_sampling_params() == (
        SamplingParams()
    )
    build_random_model(tmp_path / "random")  # its generation_config.json names only BOS and EOS
    assert LLM(str(tmp_path / "random"), max_num_seqs=2).get_default_sampling_params() == (
        SamplingParams()
    )


def test_the_default_model_samples_with_its_generation_config() -> None:
    from kvflow.default_model import SHIPPED_CHECKPOINT

    creator = json.loads((SHIPPED_CHECKPOINT / "generation_config.json").read_text())
    defaults = LLM(max_num_seqs=2).get_default_sampling_params()
    assert (defaults.temperature, defaults.top_p, defaults.top_k) == (
        creator["temperature"],
        creator["top_p"],
        creator["top_k"],
    )
    assert defaults.repetition_penalty == creator["repetition_penalty"]
