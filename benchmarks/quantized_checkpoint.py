"""benchmarks/quantized.py's settings and files: the sizes a run uses, the format names, the random-weight
checkpoint with its synthetic tokenizer, its GGUF files (converted, quantized, cached) and their byte counts."""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
CONVERTER = REPO / "tools" / "convert_to_gguf.py"
DEFAULT_LLAMA_CPP_BIN = Path(os.environ.get("LLAMA_CPP_DIR", REPO / ".cache" / "llama.cpp")) / "bin"
DEFAULT_CACHE_DIR = REPO / ".cache" / "quantized-bench"
CHECKPOINT_MARKER = "kvflow-quantized-benchmark.json"

# The real Llama-3.2-1B's config, less its trained weights.
LLAMA_32_1B_SHAPE: dict[str, int] = {
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "vocab_size": 128256,
}
# A smoke-run shape whose matrices are still multiples of 256 wide (Q4_K's super-block).
QUICK_SHAPE: dict[str, int] = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 2048,
}
LLAMA3_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
NUM_SPECIAL_TOKENS = 256  # as Llama 3: the last 256 ids are special tokens
INITIALIZER_RANGE = 0.02  # the real model's init std (the helper's 0.2 overflows at this width)
QUANTIZED_FORMATS = ("Q8_0", "Q4_0", "Q4_K_M")  # made by llama-quantize from the bf16 file
ALL_FORMATS = ("BF16", *QUANTIZED_FORMATS, "int8")
DEFAULT_FORMATS = ("Q8_0", "Q4_0", "Q4_K_M", "int8")
INT8_REFERENCE_FORMAT = "Q8_0"  # llama.cpp's file that kvflow's int8 is compared with
CPU_FLAGS = (
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512_vnni",
    "avx_vnni",
    "avx512_bf16",
    "amx_tile",
    "amx_int8",
    "amx_bf16",
)
SERVER_START_TIMEOUT_S = 600.0


# ------------------------------------------------------------------------------------------------ settings
@dataclass(frozen=True)
class Settings:
    """Every size the run uses; `--quick` picks the small one."""

    shape: dict[str, int]
    prompt_len: int
    output_len: int
    prefill_len: int
    num_requests: int
    prompt_range: tuple[int, int]
    output_range: tuple[int, int]
    bandwidth_bytes: int
    repeat: int

    @classmethod
    def for_args(cls, args: argparse.Namespace) -> Settings:
        if args.quick:
            settings = cls(QUICK_SHAPE, 16, 16, 64, 8, (8, 32), (4, 16), 256 * 2**20, 1)
        else:
            settings = cls(LLAMA_32_1B_SHAPE, 32, 128, 512, 64, (32, 256), (32, 128), 2**31, 3)
        overrides = {
            "repeat": args.repeat,
            "num_requests": args.num_requests,
            "output_len": args.output_len,
            "prefill_len": args.prefill_len,
        }
        return cls(
            **{
                **asdict(settings),
                **{key: value for key, value in overrides.items() if value is not None},
            }
        )

    @property
    def max_model_len(self) -> int:
        return max(self.prompt_len + self.output_len, self.prefill_len + 16, 512)


def shape_key(shape: dict[str, int]) -> str:
    """The cache folder's name: every size of the shape."""
    return "llama-h{hidden_size}-i{intermediate_size}-l{num_hidden_layers}-a{num_attention_heads}-kv{num_key_value_heads}-d{head_dim}-v{vocab_size}".format(  # noqa: E501
        **shape
    )


def parse_formats(text: str) -> tuple[str, ...]:
    """`--formats`: a comma-separated subset of ALL_FORMATS (case-insensitive), in the order given."""
    by_upper = {name.upper(): name for name in ALL_FORMATS}
    formats = []
    for part in text.split(","):
        name = by_upper.get(part.strip().upper())
        if name is None:
            raise argparse.ArgumentTypeError(
                f"unknown format {part.strip()!r}; known: {', '.join(ALL_FORMATS)}"
            )
        if name not in formats:
            formats.append(name)
    if not formats:
        raise argparse.ArgumentTypeError("no format given")
    return tuple(formats)


def gguf_file_name(fmt: str) -> str:
    return f"{fmt.lower()}.gguf"


def llama_cpp_format(fmt: str) -> str:
    """The GGUF file llama.cpp runs for kvflow's format `fmt`."""
    return INT8_REFERENCE_FORMAT if fmt == "int8" else fmt


def cpu_description() -> tuple[str, list[str]]:
    """The CPU's model name and which of CPU_FLAGS it has."""
    from benchmarks import latency

    name, flags = latency.cpu_name_and_flags()
    return name, [flag for flag in CPU_FLAGS if flag in flags]


# ------------------------------------------------------------------------------------------------ checkpoint
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: every byte as a printable character (what ByteLevel pre-tokenizers emit)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    characters = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            characters.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, characters), strict=True))


def synthetic_tokenizer(vocab_size: int, num_special: int = NUM_SPECIAL_TOKENS) -> dict[str, Any]:
    """A byte-level BPE tokenizer.json of exactly `vocab_size` ids: the 256 bytes, then every pair of bytes, then
    pair + byte merges, as many as fit; the last `num_special` ids are special tokens (<|begin_of_text|>,
    <|end_of_text|>, <|reserved_special_token_N|>), as in Llama 3."""
    num_bpe = vocab_size - num_special
    if num_bpe < 256 or num_special < 2:
        raise ValueError(f"vocab_size {vocab_size} leaves no room for 256 bytes + specials")
    alphabet = list(bytes_to_unicode().values())
    vocab = {character: index for index, character in enumerate(alphabet)}
    merges: list[str] = []
    pairs = [(first, second) for first in alphabet for second in alphabet]
    triples = ((first + second, third) for first, second in pairs for third in alphabet)
    for left, right in itertools.chain(pairs, triples):
        if len(vocab) == num_bpe:
            break
        vocab[left + right] = len(vocab)
        merges.append(f"{left} {right}")
    specials = ["<|begin_of_text|>", "<|end_of_text|>"] + [
        f"<|reserved_special_token_{index}|>" for index in range(num_special - 2)
    ]
    added = [
        {
            "id": num_bpe + index,
            "content": content,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for index, content in enumerate(specials)
    ]
    byte_level = {"add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", **byte_level},
        "post_processor": {"type": "ByteLevel", **byte_level},
        "decoder": {"type": "ByteLevel", **byte_level},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": merges,
        },
    }


def checkpoint_config(shape: dict[str, int]) -> dict[str, Any]:
    """make_tiny_checkpoint's overrides: the shape plus Llama-3.2-1B's other settings."""
    num_bpe = shape["vocab_size"] - NUM_SPECIAL_TOKENS
    return {
        **shape,
        "tie_word_embeddings": True,
        "rope_theta": 500000.0,
        "rope_scaling": dict(LLAMA3_ROPE_SCALING),
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "initializer_range": INITIALIZER_RANGE,
        "bos_token_id": num_bpe,
        "eos_token_id": num_bpe + 1,
        "pad_token_id": None,
    }


def ensure_checkpoint(folder: Path, shape: dict[str, int]) -> Path:
    """The random-weight bf16 checkpoint of `shape` with its synthetic tokenizer; made once (seed 0), reused."""
    config = checkpoint_config(shape)
    marker = folder / CHECKPOINT_MARKER
    if marker.is_file() and json.loads(marker.read_text()) == config:
        return folder
    from kvflow.testing.hf_checkpoints import make_tiny_checkpoint

    if folder.exists():
        shutil.rmtree(folder)
    for stale in folder.parent.glob("*.gguf*"):  # made from the previous checkpoint
        stale.unlink()
    make_tiny_checkpoint(folder, "llama", dtype="bfloat16", **copy.deepcopy(config))
    (folder / "tokenizer.json").write_text(json.dumps(synthetic_tokenizer(shape["vocab_size"])))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<|begin_of_text|>",
                "eos_token": "<|end_of_text|>",
                "add_bos_token": True,
                "add_eos_token": False,
                "model_max_length": config["max_position_embeddings"],
            }
        )
    )
    marker.write_text(json.dumps(config))
    return folder


def run_logged(command: list[str], what: str) -> subprocess.CompletedProcess[str]:
    completed = subprocess.run(command, capture_output=True, text=True, check=False)
    if completed.returncode != 0:
        raise RuntimeError(
            f"{what} failed ({shlex.join(command)}):\n{(completed.stdout + completed.stderr)[-4000:]}"
        )
    return completed


def convert_checkpoint(checkpoint: Path, out: Path) -> str | None:
    """`tools/convert_to_gguf.py CHECKPOINT OUT --dtype bf16`. A converter that refuses the llama3 rope scaling gets a
    shadow folder without it (the same tensors, linked): decode speed does not depend on the rotary frequencies.
    Returns a note saying so, or None."""
    python = sys.executable
    command = [python, str(CONVERTER), str(checkpoint), str(out), "--dtype", "bf16"]
    completed = subprocess.run(command, capture_output=True, text=True, check=False)
    if completed.returncode == 0:
        return None
    if "rope_scaling" not in completed.stderr:
        raise RuntimeError(f"{shlex.join(command)} failed:\n{completed.stderr[-4000:]}")
    shadow = out.parent / "checkpoint-without-rope-scaling"
    shutil.rmtree(shadow, ignore_errors=True)
    shadow.mkdir()
    for item in checkpoint.iterdir():
        if item.name != "config.json":
            (shadow / item.name).symlink_to(item.resolve())
    config = json.loads((checkpoint / "config.json").read_text())
    config.pop("rope_scaling", None)
    config.pop("rope_parameters", None)
    (shadow / "config.json").write_text(json.dumps(config, indent=2))
    command[2] = str(shadow)
    run_logged(command, "converting the checkpoint to GGUF")
    shutil.rmtree(shadow)
    return (
        "the converter refuses llama3 rope_scaling: the GGUF files were converted without it "
        "(rotary frequencies only; the same tensors and speed)"
    )


def ensure_gguf_files(
    cache: Path, checkpoint: Path, formats: tuple[str, ...], llama_quantize: Path | None
) -> tuple[dict[str, Path], list[str]]:
    """The GGUF file of every format in `formats` (BF16 always: the source of the others), made when missing;
    without `llama_quantize` a missing quantized file is left out, with a note. Returns (format -> path, notes)."""
    notes: list[str] = []
    bf16 = cache / gguf_file_name("BF16")
    note_file = cache / "bf16.gguf.note"
    if not bf16.is_file():
        partial = bf16.with_suffix(".partial")
        note = convert_checkpoint(checkpoint, partial)
        partial.rename(bf16)
        note_file.write_text(note or "")
    if note_file.is_file() and note_file.read_text():
        notes.append(note_file.read_text())
    rope_note = rope_base_note(bf16, json.loads((checkpoint / "config.json").read_text()))
    if rope_note:
        notes.append(rope_note)
    files = {"BF16": bf16}
    for fmt in formats:
        if fmt not in QUANTIZED_FORMATS:
            continue
        path = cache / gguf_file_name(fmt)
        if not path.is_file():
            if llama_quantize is None or not llama_quantize.is_file():
                notes.append(
                    f"{path.name} is missing and llama-quantize is not at hand: {fmt} skipped"
                )
                continue
            partial = path.with_suffix(".partial")
            run_logged([str(llama_quantize), str(bf16), str(partial), fmt], f"quantizing to {fmt}")
            partial.rename(path)
        files[fmt] = path
    return files, notes


def rope_base_note(gguf_path: Path, config: dict[str, Any]) -> str | None:
    """A note when the GGUF's rotary base is not the checkpoint's (transformers 5 writes it under
    `rope_parameters`): the files then compute other rotary angles than the folder, at the same speed."""
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))
    field = reader.fields.get("llama.rope.freq_base")
    expected = config.get("rope_theta", (config.get("rope_parameters") or {}).get("rope_theta"))
    if field is None or expected is None:
        return None
    written = float(field.parts[field.data[0]][0])
    if math.isclose(written, float(expected)):
        return None
    return (
        f"the GGUF files' llama.rope.freq_base is {written:g}, the checkpoint's rope_theta {expected:g} "
        "(tools/convert_to_gguf.py missed it): other rotary angles, the same work per token"
    )


def gguf_tensor_bytes(path: Path) -> dict[str, int]:
    """Bytes of every tensor of a GGUF file, by name (`gguf.GGUFReader`)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    return {tensor.name: int(tensor.n_bytes) for tensor in reader.tensors}


def decode_bytes_per_token(tensor_bytes: dict[str, int]) -> int:
    """What one decode token reads of a GGUF file: every tensor, less the token embedding when it is not also the
    LM head (an untied model has an `output.weight`; the embedding's one looked-up row is negligible)."""
    total = sum(tensor_bytes.values())
    if "output.weight" in tensor_bytes:
        total -= tensor_bytes.get("token_embd.weight", 0)
    return total


def int8_bytes_per_token(shape: dict[str, int]) -> int:
    """Weight-only int8 per channel: one byte per weight of every matrix (the tied LM head included) plus a float32
    scale per output row; the norms in float32."""
    hidden, heads, kv_heads = (
        shape["hidden_size"],
        shape["num_attention_heads"],
        shape["num_key_value_heads"],
    )
    head_dim, intermediate = shape["head_dim"], shape["intermediate_size"]
    matrices = [
        ((heads + 2 * kv_heads) * head_dim, hidden),
        (hidden, heads * head_dim),
        (2 * intermediate, hidden),
        (hidden, intermediate),
    ] * shape["num_hidden_layers"] + [(shape["vocab_size"], hidden)]
    norms = (2 * shape["num_hidden_layers"] + 1) * hidden * 4
    return sum(rows * columns + 4 * rows for rows, columns in matrices) + norms
