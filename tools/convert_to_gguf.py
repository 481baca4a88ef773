"""Convert a kvflow / Hugging Face checkpoint (safetensors, config.json, tokenizer.json) to GGUF: Llama, Mistral,
Qwen 2, Qwen 3, Gemma 2, Gemma 3 (text), Phi-3, Mixtral, Qwen2-MoE and Qwen3-MoE, laid out as llama.cpp's own
converter lays them out.

Usage: `python tools/convert_to_gguf.py CHECKPOINT_DIR OUT.gguf [--dtype bf16|f32] [--outtype TYPE]
[--tokenizer-pre NAME] [--no-embed-hf-tokenizer]`

For `benchmarks/latency.py` and `benchmarks/quantized.py`'s comparisons with llama.cpp on the same weights, and to
make GGUF files kvflow serves alone (`kvflow serve OUT.gguf`): the tokenizer goes into the file as llama.cpp's
converter writes it (`tokenizer.ggml.*`, the chat template) and whole as `tokenizer.huggingface.json`, kvflow's
exact copy of tokenizer.json (`--no-embed-hf-tokenizer` leaves that key out; kvflow then rebuilds a byte-level BPE
tokenizer from llama.cpp's keys). The writer is
`kvflow.models.quantization.gguf_writer.write_gguf` (its docstring says what is written); it needs the optional
`gguf` package.
`--outtype` stores the matrices as F32, F16, BF16, Q8_0, Q4_0, Q5_0, Q4_K, Q5_K, Q6_K or the Q4_K_M mix (kvflow's
own quantizers; llama.cpp's `llama-quantize` makes the same block formats); `--dtype` is the older spelling of F32/BF16.
A checkpoint without tokenizer.json (such as the random-weight benchmark checkpoints) gets a placeholder
vocabulary, enough for `llama-bench`, not for text.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from kvflow.models.quantization.gguf_writer import (  # noqa: F401 (re-exported for the scripts that load this file)
    gguf_tensor_name,
    permute_for_interleaved_rope,
    write_gguf,
)

_DTYPE_TYPES = {"bf16": "BF16", "f32": "F32"}
OUTTYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q5_0", "Q4_K", "Q5_K", "Q6_K", "Q4_K_M")


def convert(
    checkpoint_dir: Path,
    out_path: Path,
    dtype: str = "bf16",
    tokenizer_pre: str | None = None,
    outtype: str | None = None,
    embed_hf_tokenizer: bool = True,
) -> Path:
    """Write `out_path` from `checkpoint_dir`; returns `out_path`. Raises ValueError naming the field or tensor
    that cannot be written."""
    if dtype not in _DTYPE_TYPES:
        raise ValueError(f"dtype must be 'bf16' or 'f32', got {dtype!r}")
    return write_gguf(
        Path(checkpoint_dir),
        Path(out_path),
        outtype or _DTYPE_TYPES[dtype],
        tokenizer_pre=tokenizer_pre,
        embed_hf_tokenizer=embed_hf_tokenizer,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("checkpoint_dir", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--dtype", choices=tuple(_DTYPE_TYPES), default="bf16")
    parser.add_argument("--outtype", choices=OUTTYPES, default=None, help="overrides --dtype")
    parser.add_argument(
        "--tokenizer-pre", default=None, help="llama.cpp pre-tokenizer name (auto: gpt-2 regex)"
    )
    parser.add_argument(
        "--embed-hf-tokenizer",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="store tokenizer.json whole (tokenizer.huggingface.json) beside llama.cpp's keys (default: yes)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    out = convert(
        args.checkpoint_dir,
        args.out,
        args.dtype,
        args.tokenizer_pre,
        args.outtype,
        args.embed_hf_tokenizer,
    )
    print(out)


if __name__ == "__main__":
    sys.exit(main())
