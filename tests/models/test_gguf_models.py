"""GGUF files as the model: loaded from their blocks, matching the same weights dequantized to float32.

Files are made here from random tiny checkpoints (`kvflow.models.quantization.gguf_writer.write_gguf`: gguf-py's
quantizer for Q8_0 / Q4_0, kvflow's NumPy one for the K-quants). The oracle for a quantized file is the float32
checkpoint holding exactly its dequantized weights (`dequantized_checkpoint`), run through kvflow: greedy tokens must
be equal, since both compute in float32 on the same weight values (only the summation order differs).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.models.loader import load_model
from kvflow.models.quantization.gguf_file import GGUFCheckpoint, GGUFTensor
from kvflow.models.quantization.gguf_plan import GGUFLinear
from kvflow.models.quantization.gguf_writer import write_gguf
from kvflow.testing.gguf_files import dequantized_checkpoint
from kvflow.testing.hf_checkpoints import make_tiny_checkpoint
from tests.models.greedy import GREEDY, PROMPTS, greedy_tokens

# Row lengths multiple of 256, so every K-quant applies without a fallback.
SHAPE = {"hidden_size": 256, "intermediate_size": 512, "head_dim": 64}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf_checkpoints")
    return {
        arch: make_tiny_checkpoint(root / arch, arch, **SHAPE)
        for arch in ("llama", "qwen2", "qwen3", "llama3")
    }


def mixed_types(name: str, shape: tuple[int, int]) -> str:
    """Q8_0 and float tensors inside the same fused layers (q, k | v and gate | up in separate runs), the embedding
    (tied head) in Q8_0 blocks: every run kind, each with an exact kernel."""
    return "F16" if name.endswith(("attn_v.weight", "ffn_up.weight")) else "Q8_0"


@pytest.mark.parametrize(
    ("arch", "tensor_type"),
    [("llama", "Q8_0"), ("qwen2", mixed_types), ("qwen3", "Q8_0"), ("llama3", "F16")],
    ids=["llama-Q8_0", "qwen2-mixed", "qwen3-Q8_0", "llama3-F16"],
)
def test_a_gguf_file_decodes_like_its_weights_dequantized_to_float32(
    checkpoints: dict[str, Path],
    tmp_path: Path,
    arch: str,
    tensor_type: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Exact for types whose kernels keep float32 activations (floats, and Q8_0 under
    KVFLOW_Q8_0_ACTIVATIONS=float32; by default its products quantize x per 32 as llama.cpp's do): greedy tokens
    equal. llama: q/k
    rows un-interleaved; qwen2: biases, a tied head on blocks, Q8_0 and F16 runs inside one fused layer; qwen3:
    q/k norms; llama3: Llama 3 rope scaling read back from llama.cpp's `rope_freqs` tensor (the float checkpoint
    has it as config.json's rope_scaling). The 4-bit types quantize activations (as llama.cpp does): their
    end-to-end check is the default model's perplexity against its dequantized weights
    (tests/test_default_model_quality.py)."""
    monkeypatch.setenv("KVFLOW_Q8_0_ACTIVATIONS", "float32")  # the float32-x Q8_0 GEMV: exact
    path = write_gguf(checkpoints[arch], tmp_path / f"{arch}.gguf", tensor_type)
    dequantized = dequantized_checkpoint(path, checkpoints[arch], tmp_path / "dequantized")
    assert greedy_tokens(path) == greedy_tokens(dequantized)


def test_a_q4_k_m_file_keeps_its_type_mix_per_fused_layer(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    path = write_gguf(checkpoints["qwen2"], tmp_path / "mix.gguf", "Q4_K_M")
    infos = GGUFCheckpoint(path).tensor_infos()
    model = load_model(path)
    # The last layer gets more bits in llama.cpp's mix: v (and down) in Q6_K while q and k are Q4_K.
    assert infos["model.layers.1.self_attn.v_proj.weight"].qtype == "Q6_K"
    assert infos["model.layers.1.self_attn.q_proj.weight"].qtype == "Q4_K"
    qkv = model.model.layers[1].self_attn.qkv_proj.quant_method
    assert isinstance(qkv, GGUFLinear)
    assert [(run.qtype, run.shards) for run in qkv.runs] == [("Q4_K", [0, 1]), ("Q6_K", [2])]
    mixed = load_model(write_gguf(checkpoints["qwen2"], tmp_path / "mixed.gguf", mixed_types))
    gate_up = mixed.model.layers[0].mlp.gate_up_proj.quant_method
    assert isinstance(gate_up, GGUFLinear)
    assert [(run.qtype, run.shards) for run in gate_up.runs] == [("Q8_0", [0]), ("F16", [1])]
    assert gate_up.kernel_names == ["ggml_linear_Q8_0_kernel", "float"]
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, on the same blocks
    assert model.model.embed_tokens.weight.dtype == torch.uint8


def test_resident_weight_bytes_are_the_files_tensor_bytes(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """No dequantized copy: what the model holds is within 5 % of the file's tensor bytes (norms stay float32)."""
    for tensor_type in ("Q8_0", "Q4_K_M"):
        path = write_gguf(checkpoints["llama"], tmp_path / f"{tensor_type}.gguf", tensor_type)
        model = load_model(path)
        held = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
        held -= sum(b.numel() * b.element_size() for b in model.rotary_emb.buffers())
        file_bytes = GGUFCheckpoint(path).tensor_bytes()
        assert abs(held / file_bytes - 1) < 0.05, (tensor_type, held, file_bytes)


def test_an_unsupported_tensor_type_is_refused_naming_the_tensor_and_type(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    def float_ffn_up(name: str, shape: tuple[int, int]) -> str:
        return "Q8_0" if "ffn_up" not in name else "F32"

    path = write_gguf(checkpoints["llama"], tmp_path / "q5.gguf", float_ffn_up)
    # Rewrite one tensor as Q5_1 (a type kvflow does not read), with gguf-py's own quantizer.
    reader = GGUFCheckpoint(path)
    writer = gguf.GGUFWriter(str(tmp_path / "q5_1.gguf"), "llama")
    for key, field in reader._reader.fields.items():  # copy the metadata as it is
        if key.startswith(("GGUF.", "general.architecture")):
            continue
        writer.add_key_value(key, field.contents(), field.types[0], field.types[-1])
    for tensor in reader._reader.tensors:
        data = np.asarray(tensor.data)
        if tensor.name == "blk.1.ffn_up.weight":
            blocks = gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q5_1)
            writer.add_tensor(tensor.name, blocks, raw_dtype=gguf.GGMLQuantizationType.Q5_1)
        else:
            writer.add_tensor(tensor.name, data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"blk\.1\.ffn_up\.weight of type Q5_1"):
        LLM(str(tmp_path / "q5_1.gguf"), skip_tokenizer_init=True)


def test_the_tokenizer_comes_from_the_option_or_the_file_else_a_clear_error(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    from kvflow.default_model import ensure_default_model

    default_dir = ensure_default_model()
    bare = write_gguf(checkpoints["llama"], tmp_path / "bare.gguf", "Q8_0")  # no tokenizer.json
    with pytest.raises(ValueError, match=r"no tokenizer kvflow can rebuild.*--tokenizer"):
        LLM(str(bare))
    plain = write_gguf(default_dir, tmp_path / "plain.gguf", "Q8_0", embed_hf_tokenizer=False)
    embedded = write_gguf(default_dir, tmp_path / "embedded.gguf", "Q8_0")
    params = SamplingParams(max_tokens=8, temperature=0.0)
    with_folder = LLM(str(plain), tokenizer=str(default_dir), disable_log_stats=True)
    from_file = LLM(str(embedded), disable_log_stats=True)
    try:
        expected = with_folder.generate(["Once upon a time"], params, use_tqdm=False)[0]
        got = from_file.generate(["Once upon a time"], params, use_tqdm=False)[0]
        assert got.outputs[0].text == expected.outputs[0].text and expected.outputs[0].text
        chat = from_file.chat([{"role": "user", "content": "Hi"}], params, use_tqdm=False)[0]
        assert (
            chat.prompt_token_ids
            == with_folder.chat([{"role": "user", "content": "Hi"}], params, use_tqdm=False)[
                0
            ].prompt_token_ids
        )
    finally:
        with_folder.shutdown()
        from_file.shutdown()


def test_int8_on_a_gguf_file_and_float_weight_updates_into_blocks_are_refused(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    path = write_gguf(checkpoints["llama"], tmp_path / "q8.gguf", "Q8_0")
    with pytest.raises(ValueError, match=r"quantization=.int8..*GGUF file"):
        LLM(str(path), skip_tokenizer_init=True, quantization="int8")
    llm = LLM(str(path), skip_tokenizer_init=True, disable_log_stats=True)
    try:
        before = llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False)
        update = {"model.layers.0.mlp.down_proj.weight": torch.zeros(256, 512)}
        llm.pause_generation()
        with pytest.raises(Exception, match=r"mlp\.down_proj.*GGUF Q8_0 blocks"):
            llm.update_weights(update)
        assert llm.update_weights(str(path)) > 0  # the same file reloads
        llm.resume_generation()
        after = llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False)
        assert after[0].outputs[0].token_ids == before[0].outputs[0].token_ids
    finally:
        llm.shutdown()


def test_row_parallel_splits_fall_on_block_boundaries_or_are_refused() -> None:
    data = torch.arange(4 * 2 * 34, dtype=torch.int32).to(torch.uint8).reshape(4, 68)
    tensor = GGUFTensor("Q8_0", data, (4, 64))
    half = tensor[(slice(None), slice(32, 64))]
    assert half.shape == (4, 32) and torch.equal(half.data, data[:, 34:68])
    rows = tensor[(slice(1, 3),)]
    assert rows.shape == (2, 64) and torch.equal(rows.data, data[1:3])
    with pytest.raises(ValueError, match=r"Q8_0 columns 16:48 .* 32-element block"):
        tensor[(slice(None), slice(16, 48))]


@pytest.mark.slow
def test_tensor_parallel_gguf_decodes_like_one_rank(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """Q8_0 rows split on 32-element blocks: each rank holds half the heads and half of o_proj's columns. Q4_K's
    256-element blocks cannot split o_proj's 256 columns in two: refused, naming the layer and the type."""
    path = write_gguf(checkpoints["llama"], tmp_path / "tp.gguf", "Q8_0")
    assert greedy_tokens(path, tensor_parallel_size=2) == greedy_tokens(path)
    k_quants = write_gguf(checkpoints["llama"], tmp_path / "k.gguf", "Q4_K")
    with pytest.raises(Exception, match=r"o_proj: Q4_K .*256"):
        greedy_tokens(k_quants, tensor_parallel_size=2)
