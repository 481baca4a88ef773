"""benchmarks/kv_memory.py: the KV bytes per token an 8k request holds through the real KV cache manager, before
(one group of every layer) and after KV cache groups. Block counts, not timings, so the figures RESULTS.md and
README quote are exact and checked here: a change that made sliding-window layers keep blocks again fails."""

from __future__ import annotations

import importlib
from types import ModuleType

import pytest

from kvflow.models.hf_config import parse_hf_config

KIB = 1024


def load_benchmark() -> ModuleType:
    return importlib.import_module("benchmarks.kv_memory")


@pytest.mark.parametrize(
    ("name", "before_kib", "after_kib"),
    [("GEMMA2_2B", 104.0, 78.0), ("GEMMA3_1B", 26.0, 5.5)],
)
def test_an_8k_request_holds_a_window_per_sliding_group(
    name: str, before_kib: float, after_kib: float
) -> None:
    benchmark = load_benchmark()
    raw_config = getattr(benchmark, name)
    config = parse_hf_config(raw_config)
    windows = [config.layer_sliding_window(i) for i in range(config.num_hidden_layers)]
    options = {"context": 8192, "block_size": 16, "chunk": 2048}
    before = benchmark.measure(raw_config, [None] * len(windows), **options)
    after = benchmark.measure(raw_config, windows, **options)
    assert before.layout.num_groups == 1
    assert after.layout.num_groups > 1 and None in after.layout.group_windows
    assert before.bytes_per_token / KIB == before_kib
    assert after.bytes_per_token / KIB == after_kib
