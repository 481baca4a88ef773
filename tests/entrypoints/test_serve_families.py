"""`kvflow serve` takes the new model families as it takes Llama: a Qwen3-MoE checkpoint folder and a Gemma 2 GGUF
file (with `--tokenizer`), each checked with the official `openai` client (completions, streamed completions and
chat) against the in-process `LLM` on the same model.

The checkpoints are tiny random models made with transformers on the default model's tokenizer (its 4096-token
vocabulary, special tokens and ChatML template), so text goes in and out as a user's would.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.default_model import ensure_default_model
from kvflow.models.quantization.gguf_writer import write_gguf
from tests.entrypoints.server import DEFAULT_SERVER, running_server

PROMPT = "It is a truth universally acknowledged"
MAX_TOKENS = 16
_SHAPE: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": False,
}


def _make_checkpoint(folder: Path, family: str) -> Path:
    """A random float32 checkpoint of `family` on the default model's tokenizer files."""
    import transformers

    tokenizer_dir = ensure_default_model()
    special = json.loads((tokenizer_dir / "config.json").read_text())
    ids = {
        key: special[key] for key in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")
    }
    if family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(
            **_SHAPE,
            **ids,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            norm_topk_prob=True,
        )
    else:
        config = transformers.Gemma2Config(
            **_SHAPE, **ids, sliding_window=8, query_pre_attn_scalar=16
        )
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(5)
        model = transformers.AutoModelForCausalLM.from_config(config)
    finally:
        torch.random.set_rng_state(state)
    model.save_pretrained(folder, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, folder / name)
    return folder


@pytest.mark.parametrize("family", ["qwen3_moe", "gemma2_gguf"])
def test_serving_a_new_family_matches_llm_on_it(tmp_path: Path, family: str) -> None:
    folder = _make_checkpoint(tmp_path / family, family.removesuffix("_gguf"))
    model_args: list[str] = [str(folder)]
    llm_options: dict[str, Any] = {}
    if family.endswith("_gguf"):
        gguf = write_gguf(folder, tmp_path / "model-Q8_0.gguf", "Q8_0")
        model_args = [str(gguf), "--tokenizer", str(folder)]
        llm_options["tokenizer"] = str(folder)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    options = {"max_model_len": 1024, "num_kv_blocks": 256, "max_num_seqs": 4}
    reference = LLM(model_args[0], disable_log_stats=True, **options, **llm_options)
    try:
        expected = reference.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].text
        messages = [{"role": "user", "content": "Who is Mr Darcy?"}]
        expected_chat = reference.chat(messages, params, use_tqdm=False)[0].outputs[0].text
    finally:
        reference.shutdown()
    with running_server(*model_args, *DEFAULT_SERVER) as server:
        client = server.client()
        [card] = client.models.list().data
        extra = {"ignore_eos": True}
        completion = client.completions.create(
            model=card.id, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, extra_body=extra
        )
        assert completion.choices[0].text == expected
        assert completion.usage is not None and completion.usage.completion_tokens == MAX_TOKENS
        stream = client.completions.create(
            model=card.id,
            prompt=PROMPT,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            extra_body=extra,
        )
        assert "".join(chunk.choices[0].text for chunk in stream) == expected
        chat = client.chat.completions.create(
            model=card.id,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body=extra,
        )
        assert chat.choices[0].message.content == expected_chat
