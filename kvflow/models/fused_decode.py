"""The fused decode path: a decode-only step runs each Llama-family decoder layer as one C++ `decode_layer` call.

`FusedDecodeLayers.select(...)` decides once, when the model is built, whether the model can take this path at all
(bfloat16 on a CPU with the AVX-512 kernels, the "cpu" attention backend, one rank, no per-head q/k norm); a model
that cannot holds None and never asks again. Per step, `run` takes the step only when every row is a decode row
(one token each, every one sampled) and there are at most `max_rows` of them; otherwise it returns None and the
model runs its per-op layers.

Invariants: `decode_layer` chains the very kernels the per-op path calls, in the same order, so a fused step's
results equal the per-op path's bit for bit. That is why `max_rows` is `MAX_GEMV_ROWS` unless `kernels.linear`
itself sends more rows to the kernel's GEMM (`gemm_kernel_wins_here`), and then the extension's own limit
(`kernels.decode_layer_max_rows()`, its `kMaxDecodeLayerRows`). The layer weights are gathered once: weight loaders
copy into the parameters in place, so the tensors gathered here always hold the loaded values.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import TYPE_CHECKING

import torch

from kvflow import kernels
from kvflow.kernels import load_cpu_kernels
from kvflow.models.attention.cpu_paged import CpuPagedAttention, CpuPagedMetadata

if TYPE_CHECKING:
    from torch import nn

    from kvflow.batch import BatchInputs
    from kvflow.distributed import TensorParallelGroup
    from kvflow.models.attention.base import AttentionBackend
    from kvflow.models.hf_config import TransformerConfig

LayerWeights = tuple["torch.Tensor | None", ...]


def decode_layer_weights(layer: nn.Module) -> LayerWeights:
    """A Llama-family decoder layer's weights in `decode_layer`'s order: the two norms, then (weight, bias) of QKV,
    o, gate/up and down."""
    attention, mlp = layer.self_attn, layer.mlp
    return (
        layer.input_layernorm.weight,
        layer.post_attention_layernorm.weight,
        attention.qkv_proj.weight,
        attention.qkv_proj.bias,
        attention.o_proj.weight,
        attention.o_proj.bias,
        mlp.gate_up_proj.weight,
        mlp.gate_up_proj.bias,
        mlp.down_proj.weight,
        mlp.down_proj.bias,
    )


class FusedDecodeLayers:
    """Runs a decode-only step's decoder layers through `decode_layer`, one call per layer (see module docstring)."""

    def __init__(
        self,
        ops: ModuleType,
        layers: Sequence[nn.Module],
        layer_windows: Sequence[int | None],
        *,
        num_heads: int,
        eps: float,
        scale: float,
        max_rows: int,
    ) -> None:
        self._ops = ops
        # Module attribute lookups cost ~1.5 ms a step, so the weights are gathered once.
        self._weights = [decode_layer_weights(layer) for layer in layers]
        self._layer_windows = tuple(layer_windows)
        self.num_heads = num_heads
        self.eps = eps
        self.scale = scale
        self.max_rows = max_rows

    @classmethod
    def select(
        cls,
        config: TransformerConfig,
        layers: Sequence[nn.Module],
        layer_windows: Sequence[int | None],
        backend: AttentionBackend,
        *,
        dtype: torch.dtype,
        device: torch.device,
        tp: TensorParallelGroup,
    ) -> FusedDecodeLayers | None:
        """The fused path for a model built this way, or None when its layers do not match `decode_layer`."""
        if (
            device.type != "cpu"
            or dtype is not torch.bfloat16
            or tp.size != 1
            or config.qk_norm
            or not isinstance(backend, CpuPagedAttention)
            or not layers
        ):
            return None
        ops = load_cpu_kernels()
        if ops is None or not ops.has_avx512():
            return None
        max_rows = (
            kernels.decode_layer_max_rows()
            if kernels.gemm_kernel_wins_here()
            else kernels.MAX_GEMV_ROWS
        )
        return cls(
            ops,
            layers,
            layer_windows,
            num_heads=backend.num_heads,
            eps=config.rms_norm_eps,
            scale=backend.scale,
            max_rows=max_rows,
        )

    def run(
        self,
        batch: BatchInputs,
        num_sampled: int,
        hidden_states: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata_by_window: Mapping[int | None, CpuPagedMetadata],
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`(last layer's output, residual)` of a decode-only step of at most `max_rows` rows, every row sampled;
        None (nothing run, nothing written) for any other step."""
        num_tokens = batch.num_tokens
        if (
            not 0 < num_tokens <= self.max_rows
            or batch.num_reqs != num_tokens
            or num_sampled != num_tokens
        ):
            return None
        rows_by_window = {}
        for window, metadata in metadata_by_window.items():
            rows = metadata.decode_only_rows()
            if rows is None:
                return None
            rows_by_window[window] = rows
        slot_mapping = next(iter(metadata_by_window.values())).slot_mapping
        residual: torch.Tensor | None = None
        for layer_index, weights in enumerate(self._weights):
            rows = rows_by_window[self._layer_windows[layer_index]]
            hidden_states, residual = self._ops.decode_layer(
                hidden_states,
                residual,
                *weights,
                cos,
                sin,
                kv_cache,
                layer_index,
                slot_mapping,
                rows.block_tables,
                rows.seq_lens,
                self.num_heads,
                self.eps,
                self.scale,
                rows.window,
                kernels.MAX_GEMV_ROWS,
            )
        assert residual is not None
        return hidden_states, residual
