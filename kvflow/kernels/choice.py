"""Choosing among interchangeable kernels by timing them on this machine, the choice kept per CPU and kernel build.

A product kind (bfloat16 GEMM for one band of row counts, ...) has candidates that compute the same product. Each is
timed at first use on the model's real shapes, a few milliseconds each: every candidate runs once to warm up, then
`rounds` times, the candidates taking turns within each round so that a load spike on a busy machine lands on all of
them; a candidate's time is its best round, and the fastest candidate wins. A caller may let a clear loser stop
after two rounds (`drop_ratio`).

The choice goes to a JSON file next to the compiled extension (`<kernel build dir>/kernel_choices.json`), written
under a file lock, keyed by the product, its shapes, the thread count and the CPU model: the first process on a
machine measures, every later one (engine cores, tensor-parallel workers, test workers, the next run) reads the same
choice, so processes agree and a given choice's results are deterministic. A cached choice naming a kernel that is
no longer a candidate (AMX refused to this process, say) is measured again.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import platform
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from kvflow.kernels.build import file_lock

logger = logging.getLogger(__name__)

CHOICES_FILE = "kernel_choices.json"
DEFAULT_ROUNDS = 5

ChoiceSource = Literal["measured", "cached"]


@dataclass(frozen=True)
class KernelChoice:
    """The kernel one product runs on and how it was decided.

    Invariant: `kernel` is a key of `times_ms` and has its least value (the best round of each candidate, in
    milliseconds, from the process that measured it: for a "cached" choice, an earlier process).
    """

    key: str
    kernel: str
    times_ms: Mapping[str, float] = field(default_factory=dict)
    source: ChoiceSource = "measured"


def describe_bands(
    bands: Sequence[tuple[int, int | None, str]], choices: Sequence[KernelChoice] | None
) -> str:
    """One line for a plan by row band: each band's rows and kernel and, where `choices` (one per band) were
    measured or read from the cache, the candidates' times in milliseconds."""
    parts = []
    for (first, last, kernel), choice in zip(bands, choices or [None] * len(bands), strict=True):
        rows = f"rows {first}-{last}" if last is not None else f"rows {first}+"
        text = f"{rows} {kernel}"
        if choice is not None:
            times = ", ".join(f"{name} {ms:.2f}" for name, ms in sorted(choice.times_ms.items()))
            text += f" ({choice.source}: {times} ms)"
        parts.append(text)
    return "; ".join(parts)


def time_candidates(
    candidates: Mapping[str, Callable[[], object]],
    rounds: int = DEFAULT_ROUNDS,
    *,
    drop_ratio: float | None = None,
) -> dict[str, float]:
    """Each candidate's best time in milliseconds over `rounds` rounds, after one warm-up call each. Within a round
    the candidates run in turn, the order rotated every round, so neither drift nor a spike favours one of them.
    With `drop_ratio`, a candidate whose best of the first two rounds is more than `drop_ratio` times the fastest
    one's runs no further rounds: a clear loser costs three calls, not `rounds` + 1 (two rounds, so that one
    preemption on a busy machine does not drop the fastest)."""
    if not candidates:
        raise ValueError("time_candidates needs at least one candidate")
    names = list(candidates)
    for name in names:
        candidates[name]()
    best = dict.fromkeys(names, float("inf"))
    running = list(names)
    for round_index in range(max(1, rounds)):
        shift = round_index % len(running)
        for name in running[shift:] + running[:shift]:
            started = time.perf_counter()
            candidates[name]()
            best[name] = min(best[name], (time.perf_counter() - started) * 1e3)
        if round_index == 1 and drop_ratio is not None:
            fastest = min(best.values())
            running = [name for name in running if best[name] <= drop_ratio * fastest]
    return best


def cpu_model_name() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo's "model name"), else the platform's processor name."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


class KernelChoices:
    """Measured kernel choices, kept in `path` (None: in this process only).

    Invariants: an entry is written only after its measurement completed, and the whole file is replaced at once
    (written beside it, then renamed), so readers never see half a file; measuring and writing happen under an
    exclusive lock on `path`'s lock file, so two processes asking for the same key get the same choice.
    """

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._memory: dict[str, dict[str, object]] = {}

    def choose(
        self,
        key: str,
        candidates: Mapping[str, Callable[[], object]],
        *,
        rounds: int = DEFAULT_ROUNDS,
        drop_ratio: float | None = None,
    ) -> KernelChoice:
        """The choice for `key`: the cached one when it names one of `candidates`, else the fastest of them, timed
        now (`time_candidates`, with `drop_ratio`) and cached."""
        timing = functools.partial(time_candidates, rounds=rounds, drop_ratio=drop_ratio)
        if self.path is None:
            return self._choose_in(self._memory, key, candidates, timing)[0]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with file_lock(self.path.with_name(self.path.name + ".lock")):
            entries = self._read()
            choice, changed = self._choose_in(entries, key, candidates, timing)
            if changed:
                self._write(entries)
        return choice

    @staticmethod
    def _choose_in(
        entries: dict[str, dict[str, object]],
        key: str,
        candidates: Mapping[str, Callable[[], object]],
        timing: Callable[[Mapping[str, Callable[[], object]]], dict[str, float]],
    ) -> tuple[KernelChoice, bool]:
        entry = entries.get(key)
        if entry is not None and entry.get("kernel") in candidates:
            times = {str(name): float(ms) for name, ms in dict(entry.get("times_ms", {})).items()}
            return KernelChoice(key, str(entry["kernel"]), times, "cached"), False
        times = timing(candidates)
        kernel = min(times, key=times.__getitem__)
        entries[key] = {"kernel": kernel, "times_ms": {n: round(t, 4) for n, t in times.items()}}
        return KernelChoice(key, kernel, times, "measured"), True

    def _read(self) -> dict[str, dict[str, object]]:
        assert self.path is not None
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):  # absent, or unreadable: measure again and rewrite it
            return {}
        return data if isinstance(data, dict) else {}

    def _write(self, entries: dict[str, dict[str, object]]) -> None:
        assert self.path is not None
        partial = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        try:
            partial.write_text(json.dumps(entries, indent=1, sort_keys=True) + "\n")
            os.replace(partial, self.path)
        except OSError as error:  # a read-only cache only costs the next process a measurement
            logger.warning("could not save kernel choices to %s: %s", self.path, error)
            with contextlib.suppress(OSError):
                partial.unlink()
