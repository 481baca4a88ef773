"""The built-in default model (the trained checkpoint shipped in the package, copied into the cache on first use)
and the random-weight builder that tests use for a checkpoint of fixed shape."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

import kvflow.default_model as default_model
from kvflow.default_model import (
    BOS_TOKEN,
    COMPLETE_MARKER,
    DEFAULT_MODEL_NAME,
    END_OF_TEXT_TOKEN,
    IM_END_TOKEN,
    IM_START_TOKEN,
    SHIPPED_CHECKPOINT,
    SPECIAL_TOKENS,
    build_default_model,
    default_model_dir,
    ensure_default_model,
    is_complete,
)
from kvflow.default_model.random_weights import build_random_model
from kvflow.tokenizer import load_tokenizer

MODEL_FILES = (
    "README.md",
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    COMPLETE_MARKER,
)
RANDOM_MODEL_FILES = tuple(sorted(set(MODEL_FILES) - {"README.md", COMPLETE_MARKER}))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_default_model(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def random_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("random") / "model"
    build_random_model(folder)
    return folder


def _file_bytes(folder: Path) -> dict[str, bytes]:
    return {file.name: file.read_bytes() for file in sorted(folder.iterdir())}


# ---------------------------------------------------------------------------------------------------- shipped model
def test_the_cache_holds_the_shipped_checkpoint_and_its_model_card(model_dir: Path) -> None:
    assert model_dir.name == DEFAULT_MODEL_NAME
    assert sorted(file.name for file in model_dir.iterdir()) == sorted(MODEL_FILES)
    for name in MODEL_FILES[:-1]:
        assert (model_dir / name).read_bytes() == (SHIPPED_CHECKPOINT / name).read_bytes(), name
    size = sum(file.stat().st_size for file in SHIPPED_CHECKPOINT.iterdir())
    assert size < 50e6, f"the shipped default model takes {size / 1e6:.1f} MB"
    card = (model_dir / "README.md").read_text()
    assert "perplexity" in card and "public domain" in card


def test_shipped_config_is_a_tied_llama_stored_in_bfloat16_with_chatml_tokens(
    model_dir: Path,
) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert config["tie_word_embeddings"] is True
    assert (
        config["torch_dtype"] == "float32"
    )  # computed as trained; the file holds bfloat16 (below)
    assert config["max_position_embeddings"] >= 512
    tokenizer = load_tokenizer(model_dir)
    assert tokenizer.vocab_size == config["vocab_size"]
    ids = [tokenizer.token_to_id(token) for token in SPECIAL_TOKENS]
    assert ids == list(range(config["vocab_size"] - 4, config["vocab_size"]))  # specials come last
    assert (config["bos_token_id"], config["eos_token_id"]) == (ids[0], ids[3])
    generation_config = json.loads((model_dir / "generation_config.json").read_text())
    assert generation_config["eos_token_id"] == [ids[3], ids[1]]
    assert 0 < generation_config["temperature"] <= 1 and 0 < generation_config["top_p"] <= 1

    from safetensors.torch import load_file

    tensors = load_file(str(model_dir / "model.safetensors"))
    assert all(str(tensor.dtype) == "torch.bfloat16" for tensor in tensors.values())
    assert "lm_head.weight" not in tensors  # tied to the embeddings
    parameters = sum(tensor.numel() for tensor in tensors.values())
    assert 5e6 <= parameters <= 30e6


# ---------------------------------------------------------------------------------------------------- random model
def test_random_model_layout_and_config(random_dir: Path) -> None:
    assert sorted(file.name for file in random_dir.iterdir()) == list(RANDOM_MODEL_FILES)
    config = json.loads((random_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["model_type"] == "llama"
    assert (config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]) == (
        256,
        688,
        4,
    )
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (
        8,
        4,
        32,
    )
    assert (config["rms_norm_eps"], config["rope_theta"], config["max_position_embeddings"]) == (
        1e-5,
        10000.0,
        2048,
    )
    assert config["tie_word_embeddings"] is False
    assert config["torch_dtype"] == "float32"
    assert config["vocab_size"] == 1024
    generation_config = json.loads((random_dir / "generation_config.json").read_text())
    assert generation_config == {"bos_token_id": 1020, "eos_token_id": [1023, 1021]}
    assert (config["bos_token_id"], config["eos_token_id"]) == (1020, 1023)


def test_random_weights_use_hugging_face_names_and_fixed_init(random_dir: Path) -> None:
    from safetensors.torch import load_file

    tensors = load_file(str(random_dir / "model.safetensors"))
    expected = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    for layer in range(4):
        expected |= {
            f"model.layers.{layer}.{name}.weight"
            for name in (
                "self_attn.q_proj",
                "self_attn.k_proj",
                "self_attn.v_proj",
                "self_attn.o_proj",
                "mlp.gate_proj",
                "mlp.up_proj",
                "mlp.down_proj",
                "input_layernorm",
                "post_attention_layernorm",
            )
        }
    assert set(tensors) == expected
    assert tensors["model.embed_tokens.weight"].shape == (1024, 256)
    assert tensors["model.layers.0.self_attn.k_proj.weight"].shape == (128, 256)
    assert tensors["model.layers.3.mlp.down_proj.weight"].shape == (256, 688)
    assert all(
        tensor.dtype.is_floating_point and tensor.dtype.itemsize == 4 for tensor in tensors.values()
    )
    assert bool((tensors["model.norm.weight"] == 1).all())
    assert abs(float(tensors["lm_head.weight"].std()) - 0.02) < 0.002
    assert sum(tensor.numel() for tensor in tensors.values()) == 3_426_560


@pytest.mark.parametrize("which", ["shipped", "random"])
def test_tokenizer_is_byte_level_bpe_covering_every_byte(
    which: str, model_dir: Path, random_dir: Path
) -> None:
    tokenizer = load_tokenizer(model_dir if which == "shipped" else random_dir)
    size = tokenizer.vocab_size
    assert size == (
        1024
        if which == "random"
        else json.loads((model_dir / "config.json").read_text())["vocab_size"]
    )
    special = {
        BOS_TOKEN: size - 4,
        END_OF_TEXT_TOKEN: size - 3,
        IM_START_TOKEN: size - 2,
        IM_END_TOKEN: size - 1,
    }
    assert {token: tokenizer.token_to_id(token) for token in special} == special
    assert tokenizer.all_special_ids == set(special.values())
    # Every single byte is one token, so arbitrary bytes (even invalid UTF-8) have a token sequence.
    from tokenizers import pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    assert len(alphabet) == 256
    assert all(tokenizer.token_to_id(char) is not None for char in alphabet)
    text = "Plain English text encodes compactly: the quick brown fox jumps over the lazy dog."
    assert len(tokenizer.encode(text, add_special_tokens=False)) < len(text) / 2


# ---------------------------------------------------------------------------------------------------- determinism
@pytest.mark.xdist_group("whole_machine")  # a timed bound: never beside its own suite
def test_two_random_builds_are_byte_identical(tmp_path: Path, random_dir: Path) -> None:
    start = time.perf_counter()
    build_random_model(tmp_path / "second")
    build_seconds = time.perf_counter() - start
    assert _file_bytes(tmp_path / "second") == _file_bytes(random_dir)
    assert build_seconds < 10, f"building the random model took {build_seconds:.1f} s"


# ---------------------------------------------------------------------------------------------------- transformers
@pytest.mark.parametrize("which", ["shipped", "random"])
def test_loads_with_transformers(which: str, model_dir: Path, random_dir: Path) -> None:
    import torch
    import transformers
    from safetensors.torch import load_file

    folder = model_dir if which == "shipped" else random_dir
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    assert type(model).__name__ == "LlamaForCausalLM"
    tensors = load_file(str(folder / "model.safetensors"))
    if which == "random":
        assert sum(parameter.numel() for parameter in model.parameters()) == 3_426_560
    state = model.state_dict()
    assert all(
        torch.equal(state[name].to(tensor.dtype), tensor) for name, tensor in tensors.items()
    )
    model_dir = folder

    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    tokenizer = load_tokenizer(model_dir)
    for text in [
        "Hello world",
        " leading space",
        "café 日本語 🚀\n\ttabs",
        "<|im_start|>user\nHi<|im_end|>",
        "",
    ]:
        assert hf_tokenizer(text)["input_ids"] == tokenizer.encode(text), text
        assert hf_tokenizer(text, add_special_tokens=False)["input_ids"] == tokenizer.encode(
            text, False
        ), text
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
    ]
    for add_generation_prompt in (True, False):
        assert hf_tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        ) == tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert list(
        hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    ) == tokenizer.encode_chat(messages)

    prompt = tokenizer.encode("The capital of France is")
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits
    assert logits.shape == (1, len(prompt), tokenizer.vocab_size)
    assert bool(torch.isfinite(logits).all())


# ---------------------------------------------------------------------------------------------------- cache folder
def test_default_dir_honours_env_var(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(tmp_path / "kv"))
    assert default_model_dir() == tmp_path / "kv" / DEFAULT_MODEL_NAME
    monkeypatch.delenv("KVFLOW_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_model_dir() == tmp_path / "home" / ".cache" / "kvflow" / DEFAULT_MODEL_NAME


def test_ensure_without_argument_builds_in_env_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, model_dir: Path
) -> None:
    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(tmp_path))
    path = ensure_default_model()
    assert path == tmp_path / DEFAULT_MODEL_NAME
    assert _file_bytes(path) == _file_bytes(model_dir)


def _fake_builder(label: str, calls: list[str]) -> Callable[[Path], None]:
    def build(out_dir: Path) -> None:
        calls.append(label)
        out_dir.mkdir(parents=True)
        (out_dir / "built-by").write_text(label)
        (out_dir / COMPLETE_MARKER).write_text("done")

    return build


def test_complete_folder_is_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(default_model, "build_default_model", _fake_builder("first", calls))
    first = ensure_default_model(tmp_path)
    monkeypatch.setattr(default_model, "build_default_model", _fake_builder("second", calls))
    assert ensure_default_model(tmp_path) == first
    assert calls == ["first"]
    assert (first / "built-by").read_text() == "first"


def test_incomplete_folder_is_rebuilt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / DEFAULT_MODEL_NAME
    target.mkdir()
    (target / "config.json").write_text("{ half written")
    calls: list[str] = []
    monkeypatch.setattr(default_model, "build_default_model", _fake_builder("fresh", calls))
    assert ensure_default_model(tmp_path) == target
    assert calls == ["fresh"]
    assert is_complete(target)
    assert sorted(file.name for file in target.iterdir()) == sorted([COMPLETE_MARKER, "built-by"])
    assert [entry.name for entry in tmp_path.iterdir()] == [DEFAULT_MODEL_NAME]


def test_race_loser_discards_its_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Process A builds; while it does, process B finishes and publishes; A must keep B's folder."""
    calls: list[str] = []
    build_b = _fake_builder("B", calls)

    def build_a(out_dir: Path) -> None:
        _fake_builder("A", calls)(out_dir)
        monkeypatch.setattr(default_model, "build_default_model", build_b)
        assert ensure_default_model(tmp_path) == tmp_path / DEFAULT_MODEL_NAME  # B wins the race

    monkeypatch.setattr(default_model, "build_default_model", build_a)
    path = ensure_default_model(tmp_path)
    assert calls == ["A", "B"]
    assert (path / "built-by").read_text() == "B"
    assert [entry.name for entry in tmp_path.iterdir()] == [
        DEFAULT_MODEL_NAME
    ]  # A's staging copy is gone


def test_failed_build_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken_build(out_dir: Path) -> None:
        out_dir.mkdir(parents=True)
        (out_dir / "config.json").write_text("{}")
        raise OSError("disk full")

    monkeypatch.setattr(default_model, "build_default_model", broken_build)
    with pytest.raises(OSError, match="disk full"):
        ensure_default_model(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_concurrent_processes_agree(tmp_path: Path, model_dir: Path) -> None:
    """Two fresh interpreters (different hash seeds) build the same folder at once: both return it, one copy
    survives, no staging folder is left, and the bytes equal this process's build."""
    code = (
        "import sys, pathlib; from kvflow.default_model import ensure_default_model; "
        "print(ensure_default_model(pathlib.Path(sys.argv[1])))"
    )
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(tmp_path)],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONHASHSEED": str(seed), "RAYON_NUM_THREADS": "1"},
        )
        for seed in (1, 2)
    ]
    outputs = [process.communicate(timeout=120)[0].strip() for process in processes]
    assert [process.returncode for process in processes] == [0, 0]
    assert outputs == [str(tmp_path / DEFAULT_MODEL_NAME)] * 2
    assert [entry.name for entry in tmp_path.iterdir()] == [DEFAULT_MODEL_NAME]
    assert _file_bytes(tmp_path / DEFAULT_MODEL_NAME) == _file_bytes(model_dir)


def test_build_refuses_existing_folder(tmp_path: Path) -> None:
    with pytest.raises(FileExistsError):
        build_default_model(tmp_path)
