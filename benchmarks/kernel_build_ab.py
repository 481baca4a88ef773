"""Two builds of the C++ kernels in one process: one decode step's forward replayed in alternating blocks on this
tree's kernel build (A) and on another checkout's (B, a baseline commit).

Reproduce with `python benchmarks/kernel_build_ab.py --baseline TREE --model FILE.gguf --tokenizer CHECKPOINT`
(TREE: another checkout, e.g. `git worktree add /tmp/base <commit>`; its kernels are built, or found in the kernel
cache, by a child Python run on that tree). `--model CHECKPOINT --quantization int8` runs int8 weights.

Why one process: the host's memory bandwidth moves between runs (and within one), and a change to how the weights
stream (prefetch hints, loop order) is a few percent of a decode step. Here both builds run the same captured
step, on the same loaded weights, on the engine thread (`LLM.run_in_engine`, the thread whose OpenMP pool runs the
steps), in blocks of `--block` forwards: A B B A A B ..., each block's first `--warmup` forwards left out (they run
on caches the other build left). Reported: median ms per forward of each build, and the median over block pairs
of B's median / A's median (below 1: the baseline is faster).

Only the kernels differ: the Python above them is this tree's in both, so the baseline's bindings must accept the
arguments this tree's Python passes (true for changes inside kernels; not across a binding's signature change).
The swap reaches every module global named `load_cpu_kernels` and every `_ops` attribute of the model's own
objects that holds this tree's module.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

# Run as a script, Python puts this folder first on sys.path: the repo root takes its place.
if Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path[0] = str(Path(__file__).resolve().parents[1])

_BUILD_PATH_SCRIPT = (
    "import sys; sys.path.insert(0, sys.argv[1]); "
    "from kvflow.kernels import load_cpu_kernels; "
    "module = load_cpu_kernels(); print(module.__file__ if module else '')"
)


def build_of(tree: Path) -> Path:
    """The compiled kernel library of the checkout at `tree` (built on first use, in the shared kernel cache)."""
    done = subprocess.run(
        [sys.executable, "-c", _BUILD_PATH_SCRIPT, str(tree)],
        capture_output=True,
        text=True,
        check=False,
    )
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines or not lines[-1]:
        raise RuntimeError(f"no kernel build for {tree}: {done.stderr.strip()[-2000:]}")
    return Path(lines[-1])


def import_build(library: Path) -> ModuleType:
    """The kernel module in `library` (its own name: two builds load side by side)."""
    name = library.name.split(".")[0]
    spec = importlib.util.spec_from_file_location(name, library)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"cannot import {library}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class KernelSwitch:
    """Points every user of the kernel module at one build: module globals `load_cpu_kernels` (the cached
    loader) and `_ops` attributes of `holders` that hold the original module. `restore` undoes it."""

    def __init__(self, original: ModuleType, holders: list[Any]) -> None:
        from kvflow.kernels import build

        self._loader = build.load_cpu_kernels
        self._modules = [
            module
            for module in list(sys.modules.values())
            if getattr(module, "load_cpu_kernels", None) is self._loader
        ]
        self._holders = [holder for holder in holders if getattr(holder, "_ops", None) is original]
        self._original = original

    def use(self, build: ModuleType, name: str) -> None:
        """Every user on `build` (`name`: which one, "A" or "B", for whoever watches)."""

        def loader() -> ModuleType:
            return build

        for module in self._modules:
            module.load_cpu_kernels = loader  # type: ignore[attr-defined]
        for holder in self._holders:
            holder._ops = build

    def restore(self) -> None:
        for module in self._modules:
            module.load_cpu_kernels = self._loader  # type: ignore[attr-defined]
        for holder in self._holders:
            holder._ops = self._original


def replay_ab(
    llm: Any, baseline: ModuleType, blocks: int, block: int, warmup: int
) -> dict[str, Any]:
    """Capture one decode step's forward, then replay it on the engine thread in alternating blocks on this
    tree's build (A) and `baseline` (B); see the module docstring."""
    import torch

    from benchmarks.latency import _worker
    from kvflow import SamplingParams
    from kvflow.kernels import load_cpu_kernels

    model = _worker(llm).model_runner.model
    captured: dict[str, Any] = {}
    forward = model.forward

    def capture(*args: Any, **kwargs: Any) -> Any:
        captured["call"] = (args, kwargs)
        return forward(*args, **kwargs)

    model.forward = capture
    try:
        prompt = {"prompt_token_ids": list(range(100, 164))}
        params = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0)
        llm.generate([prompt], params, use_tqdm=False)
    finally:
        model.forward = forward
    args, kwargs = captured["call"]

    def job(_core: Any) -> dict[str, list[float]]:
        own = load_cpu_kernels()
        switch = KernelSwitch(own, list(vars(model).values()))
        seconds: dict[str, list[float]] = {"A": [], "B": []}
        try:
            with torch.inference_mode():
                for pair in range(blocks):
                    order = (("A", own), ("B", baseline))
                    for tag, build in order if pair % 2 == 0 else order[::-1]:
                        switch.use(build, tag)
                        for call in range(block):
                            started = time.perf_counter()
                            forward(*args, **kwargs)
                            if call >= warmup:
                                seconds[tag].append(time.perf_counter() - started)
        finally:
            switch.restore()
        return seconds

    seconds = llm.run_in_engine(job)
    per_block = block - warmup
    ratios = [
        statistics.median(seconds["B"][i : i + per_block])
        / statistics.median(seconds["A"][i : i + per_block])
        for i in range(0, len(seconds["A"]), per_block)
    ]
    return {
        "A_ms": 1000 * statistics.median(seconds["A"]),
        "B_ms": 1000 * statistics.median(seconds["B"]),
        "B_over_A": statistics.median(ratios),
        "block_ratios": ratios,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--baseline", type=Path, required=True, help="the other checkout (its tree root)"
    )
    parser.add_argument("--model", required=True, help="a GGUF file or a checkpoint folder")
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--quantization", default=None, help="e.g. int8 for a bfloat16 checkpoint")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--blocks", type=int, default=16, help="blocks per build")
    parser.add_argument("--block", type=int, default=10, help="forwards per block")
    parser.add_argument(
        "--warmup", type=int, default=2, help="forwards left out at each block's start"
    )
    options = parser.parse_args(argv)
    if not 0 <= options.warmup < options.block:
        parser.error("--warmup must be at least 0 and below --block")

    from kvflow import LLM

    baseline = import_build(build_of(options.baseline))
    llm = LLM(
        model=options.model,
        tokenizer=options.tokenizer,
        quantization=options.quantization,
        max_num_seqs=1,
        max_model_len=options.max_model_len,
    )
    try:
        results = replay_ab(llm, baseline, options.blocks, options.block, options.warmup)
    finally:
        llm.shutdown()
    print(
        f"A (this tree) {results['A_ms']:.2f} ms/forward, B ({options.baseline}) "
        f"{results['B_ms']:.2f} ms/forward, B/A median over block pairs {results['B_over_A']:.4f}"
    )
    return results


if __name__ == "__main__":
    main()
