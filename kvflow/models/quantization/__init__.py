"""Quantized weights: weight-only int8 quantized at load from any float checkpoint, and llama.cpp's GGUF files.

A quantization is a `QuantizationPlan`, made before the model is built and handed to its constructor: `apply`
swaps the float storage of each layer it covers for its own (int8 rows and scales, or GGUF blocks) before any
weight loads, together with that parameter's `weight_loader` and the layer's kernel (chosen once, here, for this
CPU), so the loader's per-parameter seam fills the quantized storage directly and no dequantized copy of a weight
is ever held. `after_loading` runs after every load (a whole checkpoint or a weight update).

`QUANTIZATION_METHODS` names the values of `quantization=` (`--quantization`); a `.gguf` file as the model is
`"gguf"` whatever the option says (the option may say "gguf" too, as vLLM's does).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from kvflow.registry import LazyRegistry

if TYPE_CHECKING:
    from torch import nn

__all__ = ["GGUF", "INT8", "QUANTIZATION_METHODS", "QuantizationPlan", "check_quantization"]

INT8 = "int8"
GGUF = "gguf"


class QuantizationPlan(Protocol):
    """What one quantization does to a model (see the module docstring)."""

    name: str

    def apply(self, model: nn.Module) -> None:
        """Swap the covered layers' storage, weight loaders and kernels; runs before any weight loads."""
        ...

    def after_loading(self, model: nn.Module) -> None:
        """Finish after a load (e.g. re-quantize a head tied to a float embedding)."""
        ...


QUANTIZATION_METHODS: LazyRegistry[type[QuantizationPlan]] = LazyRegistry(
    "quantization method",
    {
        INT8: "kvflow.models.quantization.int8:Int8Plan",
        GGUF: "kvflow.models.quantization.gguf_plan:GGUFPlan",
    },
)


def check_quantization(quantization: str | None, *, is_gguf: bool, quantize_lm_head: bool) -> None:
    """ValueError naming the option when `quantization` does not fit the model: an unknown method, "gguf" without
    a .gguf file, "int8" on a .gguf file (already quantized), `quantize_lm_head` without "int8"."""
    if quantization is not None and quantization not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization: {QUANTIZATION_METHODS.unknown_message(quantization)}")
    if quantization == GGUF and not is_gguf:
        raise ValueError(
            "quantization='gguf' needs a .gguf file as the model (a checkpoint folder is quantized by "
            "quantization='int8')"
        )
    if is_gguf and quantization not in (None, GGUF):
        raise ValueError(
            f"quantization={quantization!r}: the model is a GGUF file, already quantized as its tensors say; "
            "leave quantization unset (or 'gguf')"
        )
    if quantize_lm_head and quantization != INT8:
        raise ValueError("quantize_lm_head applies to quantization='int8' only")
