"""`collective_rpc` callables for tensor-parallel tests: they run on every rank and return plain values.

They live in the package (not in a test module) so that cloudpickle ships them by reference and every worker
process or Ray actor can import them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from kvflow.worker.worker import Worker

_RECORDED = "_kvflow_recorded_logits"


def record_logits(worker: Worker) -> None:
    """From now on keep a CPU copy of every logits tensor the rank's model returns (one per step)."""
    model = worker.model
    if hasattr(model, _RECORDED):
        return
    recorded: list[torch.Tensor] = []
    forward = model.forward

    def recording_forward(*args: Any, **kwargs: Any) -> torch.Tensor:
        output = forward(*args, **kwargs)
        recorded.append(output.detach().to("cpu", copy=True))
        return output

    model.forward = recording_forward  # type: ignore[method-assign]
    setattr(model, _RECORDED, recorded)


def take_logits(worker: Worker) -> list[torch.Tensor]:
    """The logits recorded since the last call (and forget them)."""
    recorded: list[torch.Tensor] = getattr(worker.model, _RECORDED)
    taken = list(recorded)
    recorded.clear()
    return taken


def parameter_shapes(worker: Worker) -> dict[str, tuple[int, ...]]:
    """Every parameter of the rank's model by name, with its shape."""
    return {name: tuple(param.shape) for name, param in worker.model.named_parameters()}
