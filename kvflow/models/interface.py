"""The one model contract: what the model runner and the worker need of every model, real or the hash model."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from kvflow.batch import BatchInputs
    from kvflow.config import ModelConfig
    from kvflow.distributed import TensorParallelGroup
    from kvflow.model_info import ModelInfo


class RunnerModel(Protocol):
    """A model the runner can drive: a KV cache factory, a forward pass over a `BatchInputs`, and weight loading.

    Invariants every implementation keeps:
      * `forward(batch, kv_cache)` writes the KV of every scheduled token at `batch.slot_mapping` before it reads
        any, and returns one row per sampled request (`batch.sampled_req_indices`) when `samples_own_tokens`, else
        one row per `batch.logits_indices` entry (the sampled rows first, then any prompt-logprob rows);
      * when `samples_own_tokens` is True (the hash model) that row is the sampled token id (int64 `[num_sampled]`)
        and the runner passes it through; when False (a real model) it is float logits
        `[len(logits_indices), vocab_size]`, of which the runner's `Sampler` turns the first `num_sampled` into tokens;
      * `kv_cache_bytes_per_block(block_size)` is what one block of `make_kv_cache(num_blocks, block_size)` takes;
      * `load_weights(weights, strict)` copies Hugging Face-named tensors in place and raises ValueError for
        anything it cannot load (every parameter must be given when `strict`); the shapes never change;
      * the class's `build(model_config, model_info, device, tp)` makes a ready-to-run model (weights loaded), as
        `kvflow.models.registry.build_model` calls it.
    """

    samples_own_tokens: bool

    @classmethod
    def build(
        cls,
        model_config: ModelConfig,
        model_info: ModelInfo,
        device: torch.device,
        tp: TensorParallelGroup | None = None,
    ) -> RunnerModel: ...

    def make_kv_cache(self, num_blocks: int, block_size: int) -> torch.Tensor: ...

    def kv_cache_bytes_per_block(self, block_size: int) -> int: ...

    def forward(self, batch: BatchInputs, kv_cache: torch.Tensor) -> torch.Tensor: ...

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], strict: bool = True
    ) -> None: ...
