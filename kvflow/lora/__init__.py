"""LoRA adapters served beside one base model: the request that names an adapter (`LoRARequest`), PEFT adapter
loading, the per-step slot bookkeeping of the worker and the batched delta products of the layers."""

from kvflow.lora.request import LoRARequest

__all__ = ["LoRARequest"]
