"""Checks that need a llama.cpp build, so they are not part of the test suite (CI never builds llama.cpp).

Run them after building the binaries:

    tools/build_llama_cpp.sh llama-bench llama-completion
    .venv/bin/python -m pytest tools/llama_cpp_checks.py

* llama-bench decodes a tiny Qwen2 checkpoint converted by tools/convert_to_gguf.py (the latency benchmark's
  `--llama-bench` path parses its JSON);
* llama.cpp's greedy continuation of the default model (converted to float32) is kvflow's, token for token: the
  converter's names, rotary row order, norms and tokenizer all line up.
A missing binary fails with the command that builds it.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from kvflow.testing.hf_checkpoints import make_tiny_checkpoint

REPO = Path(__file__).resolve().parents[1]
TOOLS = REPO / "tools"
DEFAULT_CHECKPOINT = REPO / "kvflow" / "default_model" / "checkpoint"
LLAMA_CPP_BIN = Path(os.environ.get("LLAMA_CPP_DIR", REPO / ".cache" / "llama.cpp")) / "bin"


def load_script(name: str, path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def binary(name: str) -> Path:
    """The built llama.cpp tool `name`; an AssertionError saying how to build it when it is missing."""
    path = LLAMA_CPP_BIN / name
    assert path.is_file(), (
        f"{path} is not built: run tools/build_llama_cpp.sh llama-bench llama-completion"
    )
    return path


def test_llama_bench_decodes_a_converted_checkpoint(tmp_path: Path) -> None:
    converter = load_script("kvflow_convert_to_gguf", TOOLS / "convert_to_gguf.py")
    path = make_tiny_checkpoint(tmp_path / "qwen2", "qwen2", dtype="bfloat16")
    gguf_path = converter.convert(path, tmp_path / "tiny.gguf")
    result = load_script("kvflow_latency", REPO / "benchmarks" / "latency.py").run_llama_bench(
        binary("llama-bench"), gguf_path, threads=1, num_tokens=8
    )
    assert result.tokens_per_s > 0 and "-n 8" in result.command


def test_llama_cpp_continues_the_default_model_greedily_as_kvflow_does(tmp_path: Path) -> None:
    """End to end: the converted default model (float32) under llama.cpp's greedy sampling writes the same text
    as kvflow on the checkpoint: names, rotary row order, norms and the tokenizer all line up."""
    from kvflow import LLM, SamplingParams

    gguf_path = load_script("kvflow_convert_to_gguf", TOOLS / "convert_to_gguf.py").convert(
        DEFAULT_CHECKPOINT, tmp_path / "default.gguf", dtype="f32"
    )
    prompt, num_tokens = "Once upon a time", 12
    llm = LLM(
        str(DEFAULT_CHECKPOINT),
        dtype="float32",
        max_model_len=256,
        num_kv_blocks=32,
        max_num_seqs=1,
    )
    (output,) = llm.generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    )
    llm.engine_core.shutdown()
    completed = subprocess.run(
        [
            str(binary("llama-completion")),
            "-m",
            str(gguf_path),
            "-p",
            prompt,
            "-n",
            str(num_tokens),
            "--temp",
            "0",
            "--top-k",
            "1",
            "--ignore-eos",
            "-no-cnv",
            "--no-display-prompt",
            "--no-warmup",
            "--simple-io",
            "-t",
            "1",
            "-c",
            "256",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert completed.stdout.strip() == output.outputs[0].text.strip(), completed.stderr[-2000:]
