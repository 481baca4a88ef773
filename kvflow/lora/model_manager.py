"""One rank's adapters: the loaded-adapter cache, the model's adapter slots, and each step's token -> slot map.

The scheduler keeps the distinct adapters of the running requests within `max_loras`, so a step never needs more
slots than there are; this manager puts the step's adapters in slots (keeping those already there) and tells the
model's LoRA layers which slot each token uses (`BatchInputs.lora_token_slots`).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvflow.lora.layers import LoRALayerWeights, LoRAStepState
from kvflow.lora.peft_adapter import LoRAModuleWeights, PEFTAdapter, load_peft_adapter
from kvflow.models.layers.linear import ColumnParallelLinear, Linear, RowParallelLinear
from kvflow.models.layers.mlp import GatedMLP
from kvflow.models.layers.self_attention import SelfAttention

if TYPE_CHECKING:
    from torch import nn

    from kvflow.config import LoRAConfig
    from kvflow.lora.request import LoRARequest
    from kvflow.worker.states import RequestSlots

logger = logging.getLogger(__name__)


def lora_target_layers(model: nn.Module) -> dict[str, Linear]:
    """The linear layers an adapter may target, by module path: every attention block's `qkv_proj` and `o_proj`
    and every dense feed-forward block's `gate_up_proj` and `down_proj` (mixture-of-experts experts are not
    LoRA targets)."""
    layers: dict[str, Linear] = {}
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(module, SelfAttention):
            layers[prefix + "qkv_proj"] = module.qkv_proj
            layers[prefix + "o_proj"] = module.o_proj
        elif isinstance(module, GatedMLP):
            layers[prefix + "gate_up_proj"] = module.gate_up_proj
            layers[prefix + "down_proj"] = module.down_proj
    return layers


class LoRAModelManager:
    """Adapters on one rank's model.

    Invariants:
      * every target layer (`lora_target_layers`) has a `LoRALayerWeights` (`layer.lora`) with `max_loras` slots;
        `slot_adapter_ids[s]` is the adapter whose weights every layer's slot `s` holds (0: empty);
      * `loaded` holds at most `max_cpu_loras` adapters (least recently used first; pinned ones are never evicted)
        read from their PEFT folders in the model's dtype; a slot's adapter need not stay in `loaded`: a request
        whose adapter was evicted or removed loads it again from its `LoRARequest.lora_path`;
      * `token_slots` maps the step's tokens to slots after putting the step's adapters in slots, evicting only
        slots no token of the step uses (least recently used first).
    """

    def __init__(self, model: nn.Module, lora_config: LoRAConfig) -> None:
        self.lora_config = lora_config
        self.max_loras = lora_config.max_loras
        self.model = model
        self.dtype: torch.dtype = model.dtype  # type: ignore[assignment]
        self.device: torch.device = model.device  # type: ignore[assignment]
        tp = getattr(model, "tp", None)
        self.tp_size = 1 if tp is None else tp.size
        targets = lora_target_layers(model)
        if not targets:
            raise ValueError(
                f"enable_lora: {type(model).__name__} has no layers LoRA adapters can apply to"
            )
        self.state = LoRAStepState()
        num_layers = getattr(model, "num_layers", None)
        last_layer_prefix = f"model.layers.{num_layers - 1}." if num_layers else None
        self.layers: dict[str, Linear] = targets
        self.part_counts = {name: len(layer.output_sizes) for name, layer in targets.items()}
        for name, layer in targets.items():
            layer.lora = LoRALayerWeights(
                layer,
                module_name=name,
                max_loras=self.max_loras,
                max_rank=lora_config.max_lora_rank,
                state=self.state,
                reads_output_rows=last_layer_prefix is not None
                and name.startswith(last_layer_prefix)
                and not name.endswith("qkv_proj"),
                dtype=self.dtype,
                device=self.device,
            )
        model.lora_state = self.state  # type: ignore[assignment]
        self.loaded: OrderedDict[int, tuple[LoRARequest, PEFTAdapter]] = OrderedDict()
        self.pinned: set[int] = set()
        self.slot_adapter_ids = [0] * self.max_loras
        self._slot_paths = [""] * self.max_loras
        self._slot_last_used = [0] * self.max_loras
        self._num_steps = 0
        # The checkpoint's (all ranks') shape of every target layer, which the loader checks each adapter against.
        self.full_part_sizes = {
            name: self._full_part_sizes(name, layer) for name, layer in targets.items()
        }
        self.full_input_sizes = {
            name: self._full_input_size(layer) for name, layer in targets.items()
        }
        packed = getattr(type(model), "packed_modules_mapping", {})
        self.packed_modules_mapping: dict[str, list[str]] = dict(packed)

    # ------------------------------------------------------------------------------------------ cache
    def add_adapter(self, lora_request: LoRARequest) -> bool:
        """Load an adapter into the cache now (a ValueError naming what is wrong for a bad one); True."""
        self._load(lora_request)
        return True

    def remove_adapter(self, lora_int_id: int) -> bool:
        """Drop an adapter from the cache and its slot; True when it was loaded or in a slot."""
        removed = self.loaded.pop(lora_int_id, None) is not None
        self.pinned.discard(lora_int_id)
        for slot, adapter_id in enumerate(self.slot_adapter_ids):
            if adapter_id == lora_int_id:
                self.slot_adapter_ids[slot] = 0
                removed = True
        return removed

    def pin_adapter(self, lora_int_id: int) -> bool:
        """Never evict this loaded adapter from the cache; False when it is not loaded."""
        if lora_int_id not in self.loaded:
            return False
        self.pinned.add(lora_int_id)
        return True

    def list_adapters(self) -> set[int]:
        return set(self.loaded)

    def _load(self, lora_request: LoRARequest) -> PEFTAdapter:
        """The adapter from the cache (refreshed as most recently used), else read from its folder; a cached id
        whose path changed is read again (and its slot emptied)."""
        entry = self.loaded.get(lora_request.lora_int_id)
        if entry is not None and entry[0].lora_path == lora_request.lora_path:
            self.loaded.move_to_end(lora_request.lora_int_id)
            return entry[1]
        if entry is not None:
            self.remove_adapter(lora_request.lora_int_id)
        start = time.perf_counter()
        adapter = load_peft_adapter(
            lora_request.lora_path,
            packed_modules_mapping=self.packed_modules_mapping,
            lora_modules=self.part_counts,
            max_lora_rank=self.lora_config.max_lora_rank,
            dtype=self.dtype,
            part_sizes=self.full_part_sizes,
            input_sizes=self.full_input_sizes,
        )
        self.loaded[lora_request.lora_int_id] = (lora_request, adapter)
        self._evict_over_capacity()
        logger.info(
            "LoRA adapter %r (id %d, rank %d, %d modules, %.1f MiB) loaded from %s in %.3f s",
            lora_request.lora_name,
            lora_request.lora_int_id,
            adapter.rank,
            len(adapter.modules),
            adapter.num_bytes / 2**20,
            lora_request.lora_path,
            time.perf_counter() - start,
        )
        return adapter

    def _evict_over_capacity(self) -> None:
        """Evict least recently used adapters down to `max_cpu_loras`, never a pinned one nor the one just loaded
        (the last): with the cache full of pinned adapters it holds one more."""
        capacity = self.lora_config.num_cpu_loras
        for adapter_id in list(self.loaded)[:-1]:
            if len(self.loaded) <= capacity:
                return
            if adapter_id not in self.pinned:
                del self.loaded[adapter_id]

    # ------------------------------------------------------------------------------------------ step
    def token_slots(
        self, slots: RequestSlots, slot_indices: np.ndarray, token_rows: np.ndarray
    ) -> torch.Tensor | None:
        """The adapter slot of each of the step's tokens (`token_rows[t]`: the batch row of token t, row r held in
        request slot `slot_indices[r]`), with the step's adapters put in slots first; None when no token has one."""
        self._num_steps += 1
        adapter_ids = slots.lora_ids[slot_indices]
        if not adapter_ids.any():
            return None
        step_ids = [int(adapter_id) for adapter_id in np.unique(adapter_ids) if adapter_id]
        if len(step_ids) > self.max_loras:
            raise RuntimeError(
                f"a step runs {len(step_ids)} adapters but there are max_loras={self.max_loras} slots"
            )
        row_slots = np.full(len(adapter_ids), -1, dtype=np.int32)
        for adapter_id in step_ids:
            rows = np.flatnonzero(adapter_ids == adapter_id)
            lora_request = slots.lora_requests[int(slot_indices[rows[0]])]
            assert lora_request is not None
            row_slots[rows] = self._activate(lora_request, step_ids)
        return torch.from_numpy(row_slots[token_rows]).to(self.device)

    def _activate(self, lora_request: LoRARequest, step_ids: Sequence[int]) -> int:
        """The slot holding `lora_request`'s adapter, writing it into a free or least recently used slot (one no
        adapter of this step holds) when it is in none."""
        adapter_id = lora_request.lora_int_id
        if adapter_id in self.slot_adapter_ids:
            slot = self.slot_adapter_ids.index(adapter_id)
            if self._slot_paths[slot] == lora_request.lora_path:
                self._slot_last_used[slot] = self._num_steps
                return slot
        adapter = self._load(lora_request)
        candidates = [
            slot
            for slot, held in enumerate(self.slot_adapter_ids)
            if held == adapter_id or held not in step_ids
        ]
        slot = min(
            candidates, key=lambda s: (self.slot_adapter_ids[s] != 0, self._slot_last_used[s])
        )
        for name, layer in self.layers.items():
            module = adapter.modules.get(name)
            if module is None:
                layer.lora.clear_slot(slot)  # type: ignore[union-attr]
            else:
                layer.lora.set_slot(slot, *self._local_parts(layer, module))  # type: ignore[union-attr]
        self.slot_adapter_ids[slot] = adapter_id
        self._slot_paths[slot] = lora_request.lora_path
        self._slot_last_used[slot] = self._num_steps
        return slot

    # ------------------------------------------------------------------------------------------ shapes
    def _full_part_sizes(self, name: str, layer: Linear) -> tuple[int, ...]:
        """The checkpoint rows of each part of `layer` (all ranks' rows together): under tensor parallelism query
        heads and feed-forward rows split evenly, KV heads as the config has them (a rank may repeat them)."""
        if not isinstance(layer, ColumnParallelLinear) or self.tp_size == 1:
            return tuple(layer.output_sizes)
        if name.endswith("qkv_proj"):
            config = self.model.config
            kv_rows = config.num_key_value_heads * config.head_dim
            return (layer.row_ranges[0][1] * self.tp_size, kv_rows, kv_rows)
        return tuple(length * self.tp_size for _, length in layer.row_ranges)

    def _full_input_size(self, layer: Linear) -> int:
        """The checkpoint's input columns of `layer` (a row-parallel layer holds 1/tp of them)."""
        if isinstance(layer, RowParallelLinear):
            return layer.column_range[1] * self.tp_size
        return layer.input_size

    def _local_parts(
        self, layer: Linear, module: LoRAModuleWeights
    ) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
        """This rank's part of each (A, B): a column-parallel layer keeps its rows of B, a row-parallel layer its
        columns of A (its partial product's delta is then summed by the layer's all-reduce, as the base's is)."""
        parts_a: list[torch.Tensor | None] = []
        parts_b: list[torch.Tensor | None] = []
        for part, (part_a, part_b) in enumerate(zip(module.lora_a, module.lora_b, strict=True)):
            if part_a is None or part_b is None:
                parts_a.append(None)
                parts_b.append(None)
                continue
            if isinstance(layer, ColumnParallelLinear):
                start, length = layer.row_ranges[part]
                part_b = part_b[start : start + length]
            elif isinstance(layer, RowParallelLinear):
                start, length = layer.column_range
                part_a = part_a[:, start : start + length]
            parts_a.append(part_a.to(self.device))
            parts_b.append(part_b.to(self.device))
        return parts_a, parts_b
