"""Clear ValueErrors from the Python API for the first-hour mistakes, each naming what to change."""

from __future__ import annotations

import pytest
import torch

from kvflow import LLM
from kvflow.engine.arg_utils import EngineArgs

requires_cpu_only_torch = pytest.mark.skipif(
    torch.backends.cuda.is_built(), reason="needs a PyTorch build without CUDA"
)


# ------------------------------------------------------------------------------------------------ engine options
@requires_cpu_only_torch
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_cuda_on_a_cpu_only_build_is_a_value_error(device: str) -> None:
    with pytest.raises(
        ValueError, match=f"device '{device}' requested but this PyTorch build .* no CUDA"
    ):
        LLM("hash", device=device)


@pytest.mark.parametrize("device", ["tpu", "cuda:x", "gpu"])
def test_unknown_device_is_a_value_error_naming_device(device: str) -> None:
    with pytest.raises(ValueError, match=f"device must be .*got '{device}'"):
        EngineArgs(model="hash", device=device)


@pytest.mark.parametrize("max_model_len", [0, 1, -5])
def test_max_model_len_below_two_is_a_value_error_not_the_model_limit(max_model_len: int) -> None:
    with pytest.raises(ValueError, match=f"max_model_len must be >= 2, got {max_model_len}"):
        LLM("hash", max_model_len=max_model_len)
