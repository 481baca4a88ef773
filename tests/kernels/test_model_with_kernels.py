"""The Llama-family model with the CPU kernels on and with them forced off (`KVFLOW_CPU_KERNELS=0`), against
transformers' greedy output on a tiny float32 Qwen2 checkpoint (QKV bias, tied embeddings, GQA), through the real
paged layout with decodes mixed into prefill steps. tests/models runs every variant with the kernels on."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvflow.models.loader import load_model
from kvflow.testing.hf_checkpoints import hf_greedy, load_hf_model, make_tiny_checkpoint
from tests.models.paged_model_driver import PagedDriver


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("qwen2"), "qwen2", seed=11)


def _prompts() -> dict[str, list[int]]:
    generator = torch.Generator().manual_seed(3)
    return {
        name: torch.randint(3, 384, (length,), generator=generator).tolist()
        for name, length in (("a", 9), ("b", 21), ("c", 4))
    }


def _greedy_matches_transformers(path: Path, expected_backend: str) -> None:
    model = load_model(path)
    assert model.attention_backend.name == expected_backend
    driver = PagedDriver(model, block_size=4, seed=2)
    prompts = _prompts()
    outputs = driver.generate(prompts, max_new_tokens=12, chunk_size=6, arrival_steps={"c": 2})
    reference = load_hf_model(path)
    for req_id, prompt in prompts.items():
        assert outputs[req_id] == hf_greedy(path, prompt, 12, reference), req_id


def test_greedy_with_kernels(ops: object, checkpoint: Path) -> None:
    _greedy_matches_transformers(checkpoint, "cpu")


def test_greedy_with_kernels_forced_off(ops: object, kernels_off: None, checkpoint: Path) -> None:
    _greedy_matches_transformers(checkpoint, "torch")
