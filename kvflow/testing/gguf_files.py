"""Test checkpoints from GGUF files: `dequantized_checkpoint` turns a GGUF file back into the float checkpoint its
quantized weights stand for. The files themselves are written by `kvflow.models.quantization.gguf_writer`."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def dequantized_checkpoint(
    gguf_path: str | Path, config_dir: str | Path, out_dir: str | Path
) -> Path:
    """A float32 checkpoint folder holding exactly the GGUF file's weights, dequantized (`kvflow.kernels.quant.
    dequantize_reference`), under Hugging Face names and layouts, with `config_dir`'s config.json and tokenizer
    files: the float model a quantized file must match. Returns `out_dir`."""
    import shutil

    from safetensors.torch import save_file

    from kvflow.kernels.quant import dequantize_reference
    from kvflow.models.quantization.gguf_file import GGUFCheckpoint, GGUFTensor

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for source in Path(config_dir).iterdir():
        if (
            source.is_file()
            and source.suffix in (".json", ".jinja")
            and source.name != "model.safetensors.index.json"
        ):
            shutil.copy(source, out / source.name)
    tensors = {}
    for name, tensor in GGUFCheckpoint(gguf_path).iterate_weights():
        if isinstance(tensor, GGUFTensor):
            tensor = dequantize_reference(tensor.qtype, tensor.data.contiguous())
        tensors[name] = tensor.to(torch.float32).contiguous()
    config_file = out / "config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "torch_dtype": "float32"}, indent=2))
    save_file(tensors, str(out / "model.safetensors"))
    return out
