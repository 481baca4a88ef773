"""The per-parameter weight-loading seam: every `nn.Parameter` a layer owns carries a `weight_loader`.

`param.weight_loader(param, loaded_weight, shard_id=None)` copies one checkpoint tensor into `param`: it takes this
tensor-parallel rank's part of `loaded_weight` (`narrow`), picks where in `param` it goes (a fused layer's
`shard_id`: 0, 1, 2 for q, k, v), checks the shapes and copies, casting to the parameter's dtype. The checkpoint
name mapping (`kvflow.models.weight_loading`) only maps names and calls it, so a layer with another layout
(quantized weights, say) plugs in by setting its own loaders.

Invariants: a weight loader copies into `param` in place (the Parameter object is never replaced, so anything
holding it, like the fused decode path, sees the loaded values); a shape that does not fit raises
`WeightShapeError` before anything is copied.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeAlias

import torch
from torch import nn


@dataclass(frozen=True)
class RankPart:
    """A checkpoint tensor already read as this rank's part (`iterate_safetensors_weights(path,
    model.checkpoint_index)`): `narrow` takes it as it is instead of cutting it again."""

    tensor: torch.Tensor


# What a weight loader receives: the whole checkpoint tensor, or this rank's part of it.
CheckpointTensor: TypeAlias = torch.Tensor | RankPart
WeightLoader: TypeAlias = Callable[[nn.Parameter, CheckpointTensor, "int | None"], None]


class WeightShapeError(ValueError):
    """A checkpoint tensor whose shape does not fit the parameter (the message gives both shapes)."""


def narrow(loaded_weight: CheckpointTensor, index: tuple[slice, ...]) -> torch.Tensor:
    """This rank's part of a checkpoint tensor: `loaded_weight[index]` (`()`: all of it), or a `RankPart`'s
    tensor as it is."""
    if isinstance(loaded_weight, RankPart):
        return loaded_weight.tensor
    return loaded_weight[index] if index else loaded_weight


def copy_checked(destination: torch.Tensor, tensor: torch.Tensor) -> None:
    """`destination.copy_(tensor)` (casting the dtype); a different shape is a `WeightShapeError`."""
    if tuple(destination.shape) != tuple(tensor.shape):
        raise WeightShapeError(
            f"checkpoint {tuple(tensor.shape)}, model {tuple(destination.shape)}"
        )
    with torch.no_grad():
        destination.copy_(tensor)


def default_weight_loader(
    param: nn.Parameter, loaded_weight: CheckpointTensor, shard_id: int | None = None
) -> None:
    """The loader of a parameter every rank holds whole (norm weights): copy the checkpoint tensor as it is."""
    copy_checked(param.data, narrow(loaded_weight, ()))


def set_weight_loader(param: nn.Parameter | None, weight_loader: WeightLoader) -> None:
    """Attach `weight_loader` to `param` (None: the layer has no such parameter, nothing to do)."""
    if param is not None:
        param.weight_loader = weight_loader  # type: ignore[attr-defined]
