"""Phi-3 (`Phi3ForCausalLM`: Phi-3 / Phi-3.5 mini and medium, Phi-4-mini) over the paged KV cache.

After loading, a Phi-3 layer is a Llama layer: pre-norm RMSNorm blocks, one fused QKV product (no bias), RoPE (on
the whole head but for Phi-4-mini, below), the SwiGLU MLP with gate rows before up rows. So `Phi3ForCausalLM` is
`LlamaForCausalLM` (its layers, and the fused decode path where that one takes the model) with two differences:

* The checkpoint already stores the fused `qkv_proj` and `gate_up_proj` tensors. `load_weights` splits each into its
  q / k / v (gate / up) parts by the config's head counts and loads them as a Llama checkpoint's separate tensors,
  so every layer's own `weight_loader` places them; under tensor parallelism the fused tensor is read whole
  (`checkpoint_index`) and each part is cut to this rank's rows, as a Llama checkpoint's would be.
* LongRoPE (`rope_type` "longrope", legacy "su"): `LongRopeRotaryEmbedding`, see its rule below.

`partial_rotary_factor` below 1 (Phi-4-mini: 0.75) rotates only the first `int(head_dim * partial_rotary_factor)`
dims of each head (`kvflow.models.layers.rotary`), with plain RoPE or LongRoPE (whose factor lists then hold one
entry per rotated frequency). The fused decode path rotates whole heads, so it declines such a model.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from kvflow.models.layers.rotary import RotaryEmbedding
from kvflow.models.llama import LlamaForCausalLM
from kvflow.models.weight_loading import checkpoint_index

if TYPE_CHECKING:
    from kvflow.config import ModelConfig
    from kvflow.distributed import TensorParallelGroup
    from kvflow.model_info import ModelInfo
    from kvflow.models.hf_config import TransformerConfig
    from kvflow.models.loader import CheckpointModel
    from kvflow.models.quantization import QuantizationPlan

LONGROPE_TYPES = ("longrope", "su")
# The fused checkpoint modules and the Llama-named parts each splits into, in row order.
_FUSED_PARTS = {
    ".qkv_proj.": (".q_proj.", ".k_proj.", ".v_proj."),
    ".gate_up_proj.": (".gate_proj.", ".up_proj."),
}


def _plain_rope(scaling: dict[str, Any]) -> dict[str, Any] | None:
    """Plain RoPE over the rotary dims `scaling` gives (its `partial_rotary_factor`): None for whole heads."""
    partial = float(scaling.get("partial_rotary_factor", 1.0))
    return None if partial == 1.0 else {"rope_type": "default", "partial_rotary_factor": partial}


class LongRopeRotaryEmbedding(RotaryEmbedding):
    """LongRoPE as transformers computes it: inverse frequencies `1 / (ext_factor * theta ** (2i / rotary_dim))`
    (`rotary_dim` the head size, or its rotated part under `partial_rotary_factor`) with `ext_factor` the
    `short_factor` or the `long_factor` list (`rotary_dim // 2` entries each), and cos/sin multiplied by the
    attention factor (`attention_factor`, else `sqrt(1 + ln(factor) / ln(original_max_position_embeddings))` when
    `factor` (default `max_position_embeddings / original_max_position_embeddings`) exceeds 1, else 1) for both
    lists. Partial rotary scales only the rotated dims; the others pass through unscaled, as in transformers.

    The rule (the factor set is fixed for the engine, chosen once): the long factors when the engine's
    `max_model_len` exceeds `original_max_position_embeddings`, else the short ones (vLLM's rule since
    vllm-project/vllm#27431). transformers picks per forward from the current length (`max(position) + 1 >
    original_max_position_embeddings`) and, in `generate`, recomputes the whole KV cache with the long factors when
    a sequence first grows past that length; a paged engine cannot re-rotate cached keys, and a mix of rotations in
    one sequence's cache is wrong. The two agree token for token on every sequence that never crosses the threshold
    in a way the engine's choice disagrees with: with `max_model_len <= original_max_position_embeddings` (short
    factors, every sequence short), and with a longer `max_model_len` for sequences whose prompt is already longer
    than `original_max_position_embeddings`. A short request on an engine that allows long ones gets the long
    factors (transformers would use the short ones until it crossed).
    """

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        theta: float,
        scaling: dict[str, Any],
        max_position_embeddings: int,
        *,
        device: torch.device | str,
    ) -> None:
        super().__init__(head_dim, max_position, theta, _plain_rope(scaling), device=device)
        for key in ("short_factor", "long_factor", "original_max_position_embeddings"):
            if scaling.get(key) is None:
                raise ValueError(f"rope_scaling of type {scaling['rope_type']!r} lacks {key!r}")
        self.original_max_position_embeddings = int(scaling["original_max_position_embeddings"])
        factor = scaling.get("factor")
        if factor is None:
            factor = max_position_embeddings / self.original_max_position_embeddings
        attention_factor = scaling.get("attention_factor")
        if attention_factor is None:
            attention_factor = (
                1.0
                if factor <= 1.0
                else math.sqrt(
                    1 + math.log(factor) / math.log(self.original_max_position_embeddings)
                )
            )
        self.attention_factor = float(attention_factor)
        exponents = torch.arange(0, self.rotary_dim, 2, dtype=torch.int64).float() / self.rotary_dim
        self.inverse_frequencies: dict[bool, torch.Tensor] = {}
        for long, key in ((False, "short_factor"), (True, "long_factor")):
            ext_factors = torch.tensor(scaling[key], dtype=torch.float32)
            if ext_factors.shape != exponents.shape:
                raise ValueError(
                    f"rope_scaling {key} has {ext_factors.numel()} entries for {exponents.numel()} "
                    "frequencies"
                )
            self.inverse_frequencies[long] = (1.0 / (ext_factors * theta**exponents)).to(device)
        self.long = False
        self.use_long_factors(max_position_embeddings > self.original_max_position_embeddings)

    def use_long_factors(self, long: bool) -> None:
        """Rebuild the cos/sin cache from the long (True) or the short factors."""
        self.long = long
        self.inv_freq = self.inverse_frequencies[long]
        self._grow(self.cos_cache.shape[0])

    def set_max_model_len(self, max_model_len: int) -> None:
        """Apply the rule: long factors exactly when `max_model_len` exceeds the original context length."""
        self.use_long_factors(max_model_len > self.original_max_position_embeddings)

    def _grow(self, num_positions: int) -> None:
        super()._grow(num_positions)
        attention_factor = getattr(self, "attention_factor", 1.0)
        if attention_factor != 1.0:
            self.cos_cache = self.cos_cache * attention_factor
            self.sin_cache = self.sin_cache * attention_factor


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3: `LlamaForCausalLM` loading the checkpoint's fused tensors, with LongRoPE where the config says.

    With LongRoPE the model starts on the factor set `max_position_embeddings` selects (the engine's default
    `max_model_len`); `build` applies the engine's `max_model_len` (`LongRopeRotaryEmbedding.set_max_model_len`).
    """

    def __init__(
        self,
        config: TransformerConfig,
        *,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        attention_backend: str = "torch",
        tp: TensorParallelGroup | None = None,
        quantization: QuantizationPlan | None = None,
    ) -> None:
        scaling = config.rope_scaling or {}
        longrope = scaling.get("rope_type") in LONGROPE_TYPES
        super().__init__(
            dataclasses.replace(config, rope_scaling=_plain_rope(scaling)) if longrope else config,
            dtype=dtype,
            device=device,
            attention_backend=attention_backend,
            tp=tp,
            quantization=quantization,
        )
        self.config = config
        if longrope:
            self.rotary_emb = LongRopeRotaryEmbedding(
                config.head_dim,
                config.max_position_embeddings,
                config.rope_theta,
                scaling,
                config.max_position_embeddings,
                device=self.device,
            )

    @classmethod
    def build(
        cls,
        model_config: ModelConfig,
        model_info: ModelInfo,
        device: torch.device,
        tp: TensorParallelGroup | None = None,
    ) -> CheckpointModel:
        model = super().build(model_config, model_info, device, tp)
        if isinstance(model, Phi3ForCausalLM) and model_config.max_model_len is not None:
            model.set_max_model_len(model_config.max_model_len)
        return model

    def set_max_model_len(self, max_model_len: int) -> None:
        """Choose the LongRoPE factor set for an engine of `max_model_len` (no-op without LongRoPE)."""
        if isinstance(self.rotary_emb, LongRopeRotaryEmbedding):
            self.rotary_emb.set_max_model_len(max_model_len)

    # ------------------------------------------------------------------------------------------ weights
    def _fused_part_sizes(self, fused: str) -> tuple[int, ...]:
        config = self.config
        if fused == ".qkv_proj.":
            kv_rows = config.num_key_value_heads * config.head_dim
            return (config.num_attention_heads * config.head_dim, kv_rows, kv_rows)
        return (config.intermediate_size, config.intermediate_size)

    def checkpoint_index(self, checkpoint_name: str) -> tuple[slice, ...]:
        """A fused checkpoint tensor is read whole (a rank's q, k and v rows are not one range); `load_weights`
        cuts each part. Any other tensor: as for Llama."""
        if any(fused in checkpoint_name for fused in _FUSED_PARTS):
            return ()
        return super().checkpoint_index(checkpoint_name)

    def load_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        strict: bool = True,
        sliced: bool = False,
    ) -> None:
        """Load as `CheckpointModel.load_weights` does, after splitting each fused `qkv_proj` / `gate_up_proj`
        tensor into its Llama-named parts (with `sliced`, each part cut to this rank's rows, since the fused tensor
        was read whole)."""
        super().load_weights(self._split_fused(weights, sliced), strict=strict, sliced=sliced)

    def _split_fused(
        self, weights: Iterable[tuple[str, torch.Tensor]], sliced: bool
    ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            fused = next((fused for fused in _FUSED_PARTS if fused in name), None)
            if fused is None:
                yield name, tensor
                continue
            sizes = self._fused_part_sizes(fused)
            if not isinstance(tensor, torch.Tensor) or tensor.shape[0] != sum(sizes):
                yield name, tensor  # not a plain fused tensor of this config: the loader reports it
                continue
            for part, rows in zip(_FUSED_PARTS[fused], tensor.split(sizes, dim=0), strict=True):
                part_name = name.replace(fused, part)
                if sliced:
                    index = checkpoint_index(self, part_name) if self.tp.size > 1 else ()
                    rows = rows[index] if index else rows
                yield part_name, rows
