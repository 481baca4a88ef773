"""The fused decode path: a decode-only step runs each Llama-family decoder layer as one C++ `decode_layer` call.

`FusedDecodeLayers.select(...)` decides once, when the model is built, whether the model can take this path at all
(a CPU with the C++ kernels, the "cpu" attention backend, one rank, RoPE over whole heads (`decode_layer` rotates
every dim of a head: a partial-rotary model stays per-op), a per-head q/k norm only as Qwen3's `RMSNorm` (which
`decode_layer` applies after the QKV product, before rotary), and either bfloat16 float weights on AVX-512 or
quantized weights: GGUF blocks or int8 in every layer's four products, float32 or bfloat16 activations); a model
that cannot holds None and never asks again. Per step, `run` takes the step only when
every row is a decode row (one token each, every one sampled) and there are at most `max_rows` of them; otherwise it
returns None and the model runs its per-op layers.

Invariants: `decode_layer` chains the very kernels the per-op path calls, in the same order, so a fused step's
results equal the per-op path's bit for bit (with LoRA adapter rows in the step, `BatchInputs.lora_token_slots`,
each product is followed by the same `lora_add` the per-op `Linear` calls after its product). That is why `max_rows`
never exceeds the row count up to which the per-op products stay on those kernels, as each states it: dense bfloat16
layers `kernels.bf16_kernel_max_rows()` (the rows `kernels.linear` runs on the kernels), quantized layers their
method's `fused_decode_product()` (its runs and their row limit); and never the extension's own limit
(`kernels.decode_layer_max_rows()`). This module inspects no quantization method: a layer whose method states no
fused product keeps its model on the per-op path. A float32 quantized model's per-op norms run the C++ RMSNorm too
(`RMSNorm.float32_kernel`, set here), which the fused layer calls: torch's float32 RMSNorm sums in another order; so
do its per-head q/k norms (`RMSNorm.forward_heads`), whose bfloat16 rows always run on that kernel. The layer
weights are gathered once: weight loaders copy into the parameters in place, so the tensors gathered here always
hold the loaded values. A step without LoRA rows is one extension call (`DecodeLayerStack.run`, built from those
tensors at the first fused step and checked then), which chains `decode_layer` over every layer in C++ exactly as
the per-layer calls do; a step with adapter rows calls `decode_layer` / `decode_layer_quantized` once per layer.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch

from kvflow import kernels
from kvflow.kernels import load_cpu_kernels
from kvflow.models.attention.cpu_paged import CpuPagedAttention, CpuPagedMetadata
from kvflow.models.layers.norm import RMSNorm
from kvflow.models.layers.rotary import rotary_dimension

if TYPE_CHECKING:
    from torch import nn

    from kvflow.batch import BatchInputs
    from kvflow.distributed import TensorParallelGroup
    from kvflow.models.attention.base import AttentionBackend
    from kvflow.models.hf_config import TransformerConfig
    from kvflow.models.layers.linear import FusedProduct

LayerWeights = tuple["torch.Tensor | None", ...]


def decode_layer_weights(layer: nn.Module) -> LayerWeights:
    """A Llama-family decoder layer's weights in `decode_layer`'s order: the two norms, the per-head q and k norms
    (None without), then (weight, bias) of QKV, o, gate/up and down."""
    attention, mlp = layer.self_attn, layer.mlp
    return (
        layer.input_layernorm.weight,
        layer.post_attention_layernorm.weight,
        *_head_norms(attention),
        attention.qkv_proj.weight,
        attention.qkv_proj.bias,
        attention.o_proj.weight,
        attention.o_proj.bias,
        mlp.gate_up_proj.weight,
        mlp.gate_up_proj.bias,
        mlp.down_proj.weight,
        mlp.down_proj.bias,
    )


def _head_norms(attention: nn.Module) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The attention's per-head q and k norm weights, or (None, None) for a model without them."""
    if attention.q_norm is None:
        return None, None
    return attention.q_norm.weight, attention.k_norm.weight


@functools.cache
def _no_tensor() -> torch.Tensor:
    """The empty tensor that stands for "none" (a GGUF run's scale, a missing bias); made on first use, so that
    importing this module creates no tensor (a front-end process holds none)."""
    return torch.empty(0)


class QuantizedLayerArgs:
    """One layer's arguments for `decode_layer_quantized`, gathered once: the norms (the per-head q/k norms None
    without), then per run of the four
    products (qkv, o, gate_up, down) its weight, type code, int8 scale (else empty), bias (float32, else empty) and
    `gemv_max_rows` (a run whose product is the same at every row count gets `max_rows`, which no step exceeds).
    A bias in another dtype is converted per call (`biases`), as the per-op path does, so weight updates show."""

    def __init__(self, layer: nn.Module, products: Sequence[FusedProduct], max_rows: int) -> None:
        runs = [run for product in products for run in product.runs]
        self.input_norm = layer.input_layernorm.weight
        self.post_norm = layer.post_attention_layernorm.weight
        self.q_norm, self.k_norm = _head_norms(layer.self_attn)
        self.weights = [run.weight for run in runs]
        self.types = [run.type_code for run in runs]
        self.scales = [_no_tensor() if run.scale is None else run.scale for run in runs]
        self.gemv_max_rows = [
            max_rows if run.gemv_max_rows is None else run.gemv_max_rows for run in runs
        ]
        self._biases = [run.bias for run in runs]
        self._convert = any(
            bias is not None and bias.dtype is not torch.float32 for bias in self._biases
        )
        self._float_biases = [_no_tensor() if bias is None else bias for bias in self._biases]
        self.runs_per_product = [len(product.runs) for product in products]
        self.intermediate = layer.mlp.down_proj.input_size

    def layer_args(self, *, float_biases: bool) -> tuple[Any, ...]:
        """The layer's arguments in the order `decode_layer_quantized` and `DecodeLayerStack.add_quantized_layer`
        both take them (norms, the per-run lists, runs per product, intermediate size). `float_biases`: each run's
        bias as float32, converted now if stored otherwise (the per-layer call); else in its own dtype (the stack
        keeps a float32 copy of any other dtype and refreshes it every step, so weight updates show there too)."""
        return (
            self.input_norm,
            self.post_norm,
            self.q_norm,
            self.k_norm,
            self.weights,
            self.types,
            self.scales,
            self.biases() if float_biases else self.raw_biases(),
            self.gemv_max_rows,
            self.runs_per_product,
            self.intermediate,
        )

    def raw_biases(self) -> list[torch.Tensor]:
        """Each run's bias in its own dtype (empty: none)."""
        return [_no_tensor() if bias is None else bias for bias in self._biases]

    def biases(self) -> list[torch.Tensor]:
        """Each run's float32 bias (empty: none), converted now if stored otherwise."""
        if not self._convert:
            return self._float_biases
        return [
            _no_tensor() if bias is None else bias.float().contiguous() for bias in self._biases
        ]


def fused_products(layer: nn.Module) -> list[FusedProduct] | None:
    """The fused products of a decoder layer's four linear layers (qkv, o, gate_up, down), as their quantization
    methods state them; None when any layer has no method or its method states none."""
    attention, mlp = layer.self_attn, layer.mlp
    products = []
    for linear in (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj):
        method = linear.quant_method
        product = None if method is None else method.fused_decode_product()
        if product is None:
            return None
        products.append(product)
    return products


def _all_quantized_layer_args(
    layers: Sequence[nn.Module],
) -> tuple[list[QuantizedLayerArgs], int] | None:
    """Every layer's `QuantizedLayerArgs` and the fused path's row limit (the extension's, or the fewest rows any
    product stays on its kernels), or None when any layer's products are not all fused products."""
    products_by_layer = []
    for layer in layers:
        products = fused_products(layer)
        if products is None:
            return None
        products_by_layer.append(products)
    max_rows = kernels.decode_layer_max_rows()
    for products in products_by_layer:
        for product in products:
            if product.max_rows is not None:
                max_rows = min(max_rows, product.max_rows)
    args = [
        QuantizedLayerArgs(layer, products, max_rows)
        for layer, products in zip(layers, products_by_layer, strict=True)
    ]
    return args, max_rows


def _has_rms_head_norms(layers: Sequence[nn.Module]) -> bool:
    """Whether every layer's per-head q/k norms are plain `RMSNorm`s (Qwen3's; Gemma's offset weights are not)."""
    return all(
        type(layer.self_attn.q_norm) is RMSNorm and type(layer.self_attn.k_norm) is RMSNorm
        for layer in layers
    )


class FusedDecodeLayers:
    """Runs a decode-only step's decoder layers through `decode_layer` (see module docstring): a step without LoRA
    rows in one `DecodeLayerStack.run` call when `use_stack` (the default), else one binding call per layer.

    Invariants: both routes run the same kernels in the same order, so they give equal results bit for bit; the
    stack, once built, holds the very tensors `_weights` / `_quantized` gather (never copies of them, except the
    float32 copy of a non-float32 quantized bias, which it refreshes every step).
    """

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
        quantized: Sequence[QuantizedLayerArgs] | None = None,
    ) -> None:
        self._ops = ops
        # Module attribute lookups are paid per step, so the weights are gathered once.
        self._weights = (
            None if quantized is not None else [decode_layer_weights(layer) for layer in layers]
        )
        self._quantized = None if quantized is None else list(quantized)
        self._layer_windows = tuple(layer_windows)
        self._layers = list(layers)
        # Per layer, the LoRA slots of its four products as decode_layer's keyword arguments (gathered at the first
        # step with adapter rows: the LoRA manager attaches them after the model is built; their tensors are updated
        # in place, so the gathered ones stay current).
        self._lora_args: list[dict[str, Any]] | None = None
        # Each layer's window group: the index of its window among the distinct windows in order of first use.
        self._windows = tuple(dict.fromkeys(self._layer_windows))
        self._window_groups = [self._windows.index(window) for window in self._layer_windows]
        self._stack: Any = None  # ops.DecodeLayerStack, built at the first step that runs it
        self._stack_ops: ModuleType | None = None  # the module that built `_stack`
        # Whether steps without LoRA rows take the one-call stack (False: the per-layer calls; for A/B measurements).
        self.use_stack = True
        self.num_heads = num_heads
        self.eps = eps
        self.scale = scale
        self.max_rows = max_rows

    @property
    def is_quantized(self) -> bool:
        return self._quantized is not None

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
        quantized: bool = False,
    ) -> FusedDecodeLayers | None:
        """The fused path for a model built this way, or None when its layers do not match `decode_layer`.
        `quantized`: the model's linear layers belong to a quantization plan (call once its layers exist)."""
        if (
            device.type != "cpu"
            or dtype not in (torch.bfloat16, torch.float32)
            or tp.size != 1
            or (config.qk_norm and not _has_rms_head_norms(layers))
            or rotary_dimension(config.head_dim, config.rope_scaling) != config.head_dim
            or config.hidden_act != "silu"  # decode_layer's MLP is SwiGLU
            or config.num_experts  # and dense (a mixture-of-experts block is not)
            or backend.softcap is not None  # and its attention does not soft-cap
            or not isinstance(backend, CpuPagedAttention)
            or not layers
        ):
            return None
        ops = load_cpu_kernels()
        if ops is None:
            return None
        quantized_args: list[QuantizedLayerArgs] | None = None
        if quantized:
            gathered = _all_quantized_layer_args(layers) if ops.has_avx2() else None
            if gathered is None:
                return None
            quantized_args, max_rows = gathered
            if dtype is torch.float32:  # the per-op norms must be the C++ ones decode_layer calls
                for layer in layers:
                    layer.input_layernorm.float32_kernel = True
                    layer.post_attention_layernorm.float32_kernel = True
                    if layer.self_attn.q_norm is not None:
                        layer.self_attn.q_norm.float32_kernel = True
                        layer.self_attn.k_norm.float32_kernel = True
        elif dtype is not torch.bfloat16 or not ops.has_avx512():
            return None
        else:
            max_rows = kernels.decode_layer_max_rows()
            dense_rows = kernels.bf16_kernel_max_rows()
            if dense_rows is not None:
                max_rows = min(max_rows, dense_rows)
        return cls(
            ops,
            layers,
            layer_windows,
            num_heads=backend.num_heads,
            eps=config.rms_norm_eps,
            scale=backend.scale,
            max_rows=max_rows,
            quantized=quantized_args,
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
        lora_token_slots = batch.lora_token_slots
        lora_args = None if lora_token_slots is None else self._layer_lora_args()
        if lora_token_slots is not None and lora_args is None:
            return None  # a product without LoRA slots: the per-op layers run the step
        if lora_token_slots is None and self.use_stack:
            window_rows = [rows_by_window[window] for window in self._windows]
            return self._layer_stack(hidden_states, kv_cache).run(
                hidden_states,
                cos,
                sin,
                kv_cache,
                slot_mapping,
                [rows.block_tables for rows in window_rows],
                [rows.seq_lens for rows in window_rows],
                [rows.window for rows in window_rows],
            )
        residual: torch.Tensor | None = None
        for layer_index in range(len(self._layer_windows)):
            rows = rows_by_window[self._layer_windows[layer_index]]
            step = (
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
            )
            lora = {} if lora_args is None else lora_args[layer_index]
            if self._quantized is not None:
                hidden_states, residual = self._ops.decode_layer_quantized(
                    hidden_states,
                    residual,
                    *self._quantized[layer_index].layer_args(float_biases=True),
                    *step,
                    lora_token_slots=lora_token_slots,
                    **lora,
                )
            else:
                assert self._weights is not None
                hidden_states, residual = self._ops.decode_layer(
                    hidden_states,
                    residual,
                    *self._weights[layer_index],
                    *step,
                    kernels.MAX_GEMV_ROWS,
                    lora_token_slots=lora_token_slots,
                    **lora,
                )
        assert residual is not None
        return hidden_states, residual

    def _layer_stack(self, hidden_states: torch.Tensor, kv_cache: torch.Tensor) -> Any:
        """The `DecodeLayerStack` of these layers (built and checked on first use, for the step's dtype and the cache's
        kv heads and head size, which never change for a model; built again when `_ops` was swapped for another
        build of the kernels, as A/B measurements of two builds do)."""
        if self._stack is None or self._stack_ops is not self._ops:
            stack = self._ops.DecodeLayerStack(
                hidden_states.dtype,
                hidden_states.shape[1],
                self.num_heads,
                kv_cache.shape[2],
                kv_cache.shape[5],
                self.eps,
                self.scale,
                0 if self._quantized is not None else kernels.MAX_GEMV_ROWS,
            )
            for layer_index, group in enumerate(self._window_groups):
                if self._quantized is not None:
                    stack.add_quantized_layer(
                        *self._quantized[layer_index].layer_args(float_biases=False), group
                    )
                else:
                    assert self._weights is not None
                    stack.add_dense_layer(*self._weights[layer_index], group)
            self._stack, self._stack_ops = stack, self._ops
        return self._stack

    def _layer_lora_args(self) -> list[dict[str, Any]] | None:
        """Each layer's LoRA slots for `decode_layer` (`lora_a`, `lora_b`, `lora_part_offsets` of qkv, o, gate_up,
        down), or None when a product has none."""
        if self._lora_args is None:
            gathered = []
            for layer in self._layers:
                attention, mlp = layer.self_attn, layer.mlp
                linears = (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj)
                if any(linear.lora is None for linear in linears):
                    return None
                gathered.append(
                    {
                        "lora_a": [linear.lora.lora_a for linear in linears],
                        "lora_b": [linear.lora.lora_b for linear in linears],
                        "lora_part_offsets": [list(linear.lora.part_offsets) for linear in linears],
                    }
                )
            self._lora_args = gathered
        return self._lora_args
