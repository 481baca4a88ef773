"""Loading a PEFT LoRA adapter folder into kvflow's layer layout: per fused kvflow linear layer, one (A, B) pair per
packed part, with the LoRA scaling already in B.

A PEFT folder holds `adapter_config.json` and `adapter_model.safetensors` (or the older `adapter_model.bin`). Its
tensors are named `base_model.model.<module path>.lora_A.weight` / `.lora_B.weight` (peft 0.21 writes exactly
this; an adapter-name infix, `.lora_A.<name>.weight`, is accepted too), where the module path is the Hugging Face
checkpoint's (`model.layers.0.self_attn.k_proj`). kvflow fuses q/k/v and gate/up into one layer each
(`packed_modules_mapping`), so `k_proj` becomes part 1 of `qkv_proj`; a checkpoint that already ships the fused
module (Phi-3's `qkv_proj`, `gate_up_proj`) has one A for all parts and a B whose rows split into the parts.

PEFT computes `y = W x + scaling * B (A x)` with `scaling = lora_alpha / r` (`lora_alpha / sqrt(r)` with rsLoRA),
`r` and `lora_alpha` per module from `rank_pattern` / `alpha_pattern`; here the scaling is multiplied into B once,
so a layer adds `B (A x)`. Anything an adapter may hold that kvflow cannot apply (DoRA, biases, embedding or LM-head
adapters, modules_to_save, MoE experts, ...) is refused with a ValueError naming it, never silently dropped.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from kvflow.models.safetensors_io import SafetensorsFile

logger = logging.getLogger(__name__)

CONFIG_FILE = "adapter_config.json"
SAFETENSORS_FILE = "adapter_model.safetensors"
BIN_FILE = "adapter_model.bin"
# PEFT prefixes every saved tensor with the wrapper's path to the base model.
_PEFT_PREFIX = "base_model.model."
# `<module>.lora_A.weight`, `<module>.lora_B.weight`, optionally with an adapter name: `<module>.lora_A.default.weight`.
_LORA_KEY = re.compile(r"(?P<module>.+)\.lora_(?P<kind>[AB])(?:\.(?P<adapter>[^.]+))?\.weight")
# Where the module path ends in the name of a tensor that is not a LoRA weight (an embedding's `lora_embedding_A`, a
# saved `base_layer` or `modules_to_save` copy, a DoRA magnitude, a bias).
_OWNER_SUFFIX = re.compile(
    r"\.(?:lora_\w+|base_layer|modules_to_save|original_module)\b|\.(?:weight|bias)$"
)
# Config options that change what the adapter computes beyond `W x + scaling * B A x`: kvflow refuses an adapter
# that sets any of them (to anything but its default: None, False, empty).
_UNSUPPORTED_OPTIONS = (
    "modules_to_save",
    "use_dora",
    "lora_bias",
    "use_qalora",
    "use_bdlora",
    "alora_invocation_tokens",
    "layer_replication",
    "trainable_token_indices",
    "target_parameters",
    "arrow_config",
)


@dataclass(frozen=True)
class LoRAModuleWeights:
    """One kvflow linear layer's adapter.

    `module_name` is the kvflow module path (e.g. "model.layers.3.self_attn.qkv_proj"); `lora_a[p]` is packed part
    p's A `[rank_p, in_features]` and `lora_b[p]` its B `[out_features_of_part_p, rank_p]` with the LoRA scaling
    (lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA; per-module rank_pattern / alpha_pattern honoured) already
    multiplied into B; both None for a part the adapter does not target.

    Invariants: `len(lora_a) == len(lora_b)` == the layer's number of packed parts; for each part both are None or
    both are 2-D tensors with `lora_a[p].shape[0] == lora_b[p].shape[1]` (the part's rank); every A has the same
    `in_features`; at least one part is set. Tensors are whole checkpoint tensors (not split for tensor
    parallelism: the layers slice them), on the CPU, in the dtype the adapter was loaded for. Parts of a fused
    checkpoint module share one A tensor.
    """

    module_name: str
    lora_a: tuple[torch.Tensor | None, ...]
    lora_b: tuple[torch.Tensor | None, ...]

    @property
    def rank(self) -> int:
        """The largest rank over this layer's parts."""
        return max(a.shape[0] for a in self.lora_a if a is not None)

    def delta_weight(self, part: int) -> torch.Tensor | None:
        """`B @ A` of part `part` (`[out_features_of_part, in_features]`, scaling included), or None when the
        adapter does not target that part: what the adapter adds to that part's rows of the layer's weight."""
        a, b = self.lora_a[part], self.lora_b[part]
        return None if a is None or b is None else b @ a


@dataclass(frozen=True)
class PEFTAdapter:
    """A loaded PEFT LoRA adapter in kvflow's layout.

    Invariants: `modules` is keyed by kvflow module path and each value's `module_name` is its key; `rank` is the
    largest rank over the modules (>= 1, <= the `max_lora_rank` it was loaded under); `target_modules` holds the
    checkpoint-level module names whose tensors it holds (e.g. {"q_proj", "v_proj"}, or {"qkv_proj"} for a Phi-3
    adapter); `num_bytes` counts each tensor's bytes once (a shared A once).
    """

    rank: int
    modules: dict[str, LoRAModuleWeights]
    target_modules: frozenset[str]
    num_bytes: int


@dataclass(frozen=True)
class _AdapterConfig:
    """The parts of `adapter_config.json` that decide the loaded weights (validated)."""

    r: int
    lora_alpha: float
    use_rslora: bool
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]
    target_modules: str | frozenset[str] | None

    def rank_and_scaling(self, module_path: str) -> tuple[int, float]:
        """The rank PEFT gives checkpoint module `module_path` and its scaling (PEFT's `get_pattern_key`: the first
        pattern key that matches a dot-separated suffix of the path wins)."""
        rank = self.rank_pattern.get(_pattern_key(self.rank_pattern, module_path), self.r)
        alpha = self.alpha_pattern.get(
            _pattern_key(self.alpha_pattern, module_path), self.lora_alpha
        )
        scaling = alpha / math.sqrt(rank) if self.use_rslora else alpha / rank
        return rank, scaling

    def targets(self, module_path: str) -> bool:
        """Whether `target_modules` selects checkpoint module `module_path`, as PEFT decides it: a string is a
        regular expression the whole path must match, a list names modules by their path or any dot-separated
        suffix of it. Unknown (None, or "all-linear" left unexpanded): every module."""
        if self.target_modules is None or self.target_modules == "all-linear":
            return True
        if isinstance(self.target_modules, str):
            return re.fullmatch(self.target_modules, module_path) is not None
        return module_path in self.target_modules or any(
            module_path.endswith(f".{target}") for target in self.target_modules
        )


def _pattern_key(patterns: Mapping[str, object], module_path: str) -> str:
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module_path):
            return key
    return module_path


@dataclass(frozen=True)
class _Placement:
    """Where one checkpoint module's adapter goes: kvflow module `module_name`, into `parts` (one part index for a
    module kvflow fuses, every part of the layer for a checkpoint module that is itself fused)."""

    module_name: str
    parts: tuple[int, ...]


def load_peft_adapter(
    path: str | os.PathLike[str],
    *,
    packed_modules_mapping: Mapping[str, Sequence[str]],
    lora_modules: Mapping[str, int],
    max_lora_rank: int,
    dtype: torch.dtype,
    part_sizes: Mapping[str, Sequence[int]] | None = None,
    input_sizes: Mapping[str, int] | None = None,
) -> PEFTAdapter:
    """Load and validate the PEFT LoRA adapter in folder `path` for a model whose adaptable layers are
    `lora_modules` (kvflow module path -> number of packed parts) under `packed_modules_mapping` (the model class's:
    fused module -> the checkpoint modules it stacks, in part order).

    `part_sizes` (kvflow module path -> the whole checkpoint's output rows of each part, e.g. q, k, v rows) is
    needed only for an adapter on a checkpoint-fused module (Phi-3's `qkv_proj`), whose B is split by those rows;
    when given, every B's rows are checked against it. `input_sizes` (kvflow module path -> in_features), when
    given, is checked against every A's columns. Both are whole-checkpoint sizes, not one tensor-parallel rank's.

    Returns the adapter with each B scaled (see `LoRAModuleWeights`), every tensor cast to `dtype`. Raises
    FileNotFoundError when the folder or a file is missing and ValueError (naming the module, key, option or rank)
    for anything kvflow cannot apply exactly: a module outside `lora_modules` (embeddings, the LM head, MoE
    experts, ...), a rank above `max_lora_rank`, an unsupported option (DoRA, biases, modules_to_save, ...), a
    non-LoRA `peft_type`, a tensor whose shape disagrees with the config or the layer.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"LoRA adapter folder {str(folder)!r} does not exist")
    config = _read_config(folder)
    tensors = _read_tensors(folder)
    pairs = _pair_tensors(tensors, folder)
    placements = _place_modules(pairs, packed_modules_mapping, lora_modules)
    parts = _layer_parts(
        folder, config, pairs, placements, lora_modules, max_lora_rank, dtype, part_sizes
    )
    modules = {
        name: _module_weights(name, module_parts, input_sizes)
        for name, module_parts in sorted(parts.items())
    }
    adapter = PEFTAdapter(
        rank=max(module.rank for module in modules.values()),
        modules=modules,
        target_modules=frozenset(name.rpartition(".")[2] for name in pairs),
        num_bytes=_num_bytes(modules.values()),
    )
    logger.info(
        "loaded LoRA adapter %s: rank %d, %d layers (%s), %d bytes",
        folder,
        adapter.rank,
        len(modules),
        ", ".join(sorted(adapter.target_modules)),
        adapter.num_bytes,
    )
    return adapter


def _layer_parts(
    folder: Path,
    config: _AdapterConfig,
    pairs: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
    placements: Mapping[str, _Placement],
    lora_modules: Mapping[str, int],
    max_lora_rank: int,
    dtype: torch.dtype,
    part_sizes: Mapping[str, Sequence[int]] | None,
) -> dict[str, list[tuple[torch.Tensor | None, torch.Tensor | None]]]:
    """Each adapted kvflow layer's (A, scaled B) per packed part ((None, None) where untargeted), every checkpoint
    module checked against the config (targeted, its rank) and the limit, each part filled at most once."""
    parts: dict[str, list[tuple[torch.Tensor | None, torch.Tensor | None]]] = {
        placement.module_name: [(None, None)] * lora_modules[placement.module_name]
        for placement in placements.values()
    }
    for checkpoint_module, (lora_a, lora_b) in pairs.items():
        if not config.targets(checkpoint_module):
            raise ValueError(
                f"LoRA adapter {str(folder)!r} holds tensors for module {checkpoint_module!r}, which its "
                f"target_modules ({_describe_targets(config.target_modules)}) does not select"
            )
        rank, scaling = config.rank_and_scaling(checkpoint_module)
        _check_rank(checkpoint_module, lora_a, lora_b, rank, max_lora_rank)
        placement = placements[checkpoint_module]
        lora_a = lora_a.to(dtype)
        lora_b = (lora_b.float() * scaling).to(dtype)
        row_blocks = _split_rows(checkpoint_module, placement, lora_b, part_sizes)
        for part, rows in zip(placement.parts, row_blocks, strict=True):
            if parts[placement.module_name][part][0] is not None:
                raise ValueError(
                    f"LoRA adapter {str(folder)!r} targets part {part} of {placement.module_name!r} twice "
                    f"(again through {checkpoint_module!r})"
                )
            parts[placement.module_name][part] = (lora_a, rows)
    return parts


# ------------------------------------------------------------------------------------------------ config and files
def _read_config(folder: Path) -> _AdapterConfig:
    config_path = folder / CONFIG_FILE
    if not config_path.is_file():
        raise FileNotFoundError(f"LoRA adapter folder {str(folder)!r} has no {CONFIG_FILE}")
    try:
        raw = json.loads(config_path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{str(config_path)!r} is not valid JSON: {error}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{str(config_path)!r} is not a JSON object")
    peft_type = raw.get("peft_type")
    if peft_type is None or str(peft_type).upper() != "LORA":
        raise ValueError(
            f"{str(config_path)!r}: peft_type {peft_type!r} is not supported (only LORA)"
        )
    for option in _UNSUPPORTED_OPTIONS:
        if raw.get(option):
            raise ValueError(
                f"{str(config_path)!r}: {option}={raw[option]!r} is not supported by kvflow's LoRA"
            )
    if raw.get("bias", "none") != "none":
        raise ValueError(
            f"{str(config_path)!r}: bias={raw['bias']!r} is not supported (only 'none': kvflow's LoRA adds no "
            "bias terms)"
        )
    return _AdapterConfig(
        r=_positive_int(raw.get("r", 8), "r", config_path),
        lora_alpha=_number(raw.get("lora_alpha", 8), "lora_alpha", config_path),
        use_rslora=bool(raw.get("use_rslora", False)),
        rank_pattern={
            key: _positive_int(value, f"rank_pattern[{key!r}]", config_path)
            for key, value in (raw.get("rank_pattern") or {}).items()
        },
        alpha_pattern={
            key: _number(value, f"alpha_pattern[{key!r}]", config_path)
            for key, value in (raw.get("alpha_pattern") or {}).items()
        },
        target_modules=_target_modules(raw.get("target_modules"), config_path),
    )


def _positive_int(value: object, name: str, config_path: Path) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{str(config_path)!r}: {name} must be a positive integer, got {value!r}")
    return value


def _number(value: object, name: str, config_path: Path) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{str(config_path)!r}: {name} must be a finite number, got {value!r}")
    return float(value)


def _target_modules(value: object, config_path: Path) -> str | frozenset[str] | None:
    if value is None or isinstance(value, str):
        if isinstance(value, str):
            try:
                re.compile(value)
            except re.error as error:
                raise ValueError(
                    f"{str(config_path)!r}: target_modules {value!r} is not a valid regular expression "
                    f"({error})"
                ) from None
        return value
    if isinstance(value, list) and all(isinstance(name, str) for name in value):
        return frozenset(value)
    raise ValueError(
        f"{str(config_path)!r}: target_modules must be a list of names or a regex string, got {value!r}"
    )


def _describe_targets(target_modules: str | frozenset[str] | None) -> str:
    if isinstance(target_modules, frozenset):
        return repr(sorted(target_modules))
    return repr(target_modules)


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """The adapter's tensors by name: from `adapter_model.safetensors`, else `adapter_model.bin` (a plain state
    dict, read with `torch.load(weights_only=True)`)."""
    safetensors_path = folder / SAFETENSORS_FILE
    if safetensors_path.is_file():
        with SafetensorsFile(safetensors_path) as handle:
            return {name: handle.read(name) for name in handle.names()}
    bin_path = folder / BIN_FILE
    if bin_path.is_file():
        try:
            state = torch.load(bin_path, map_location="cpu", weights_only=True)
        except Exception as error:
            raise ValueError(f"cannot read {str(bin_path)!r} as a state dict: {error}") from error
        if not isinstance(state, dict) or not all(
            isinstance(name, str) and isinstance(tensor, torch.Tensor)
            for name, tensor in state.items()
        ):
            raise ValueError(f"{str(bin_path)!r} is not a state dict of named tensors")
        return state
    raise FileNotFoundError(
        f"LoRA adapter folder {str(folder)!r} has neither {SAFETENSORS_FILE} nor {BIN_FILE}"
    )


# --------------------------------------------------------------------------------------------------- tensors
def _pair_tensors(
    tensors: Mapping[str, torch.Tensor], folder: Path
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Checkpoint module path -> its (A, B), every tensor accounted for: a name that is not a LoRA A/B weight
    (an embedding's `lora_embedding_A`, a bias, a DoRA magnitude, a saved module) is an error naming it."""
    found: dict[str, dict[str, torch.Tensor]] = {}
    adapter_names: set[str | None] = set()
    for key, tensor in tensors.items():
        name = key.removeprefix(_PEFT_PREFIX)
        match = _LORA_KEY.fullmatch(name)
        if match is None:
            module = _OWNER_SUFFIX.split(name, maxsplit=1)[0]
            raise ValueError(
                f"LoRA adapter {str(folder)!r}: tensor {key!r} (module {module!r}) is not a lora_A / lora_B "
                "weight of a linear layer; kvflow cannot apply it"
            )
        adapter_names.add(match["adapter"])
        if tensor.dim() != 2 or not tensor.is_floating_point():
            raise ValueError(
                f"LoRA adapter {str(folder)!r}: tensor {key!r} must be a 2-D float tensor, got "
                f"{tuple(tensor.shape)} {tensor.dtype}"
            )
        found.setdefault(match["module"], {})[match["kind"]] = tensor
    if len(adapter_names) > 1:
        raise ValueError(
            f"LoRA adapter {str(folder)!r} mixes tensors of several adapters "
            f"({sorted(str(name) for name in adapter_names)})"
        )
    if not found:
        raise ValueError(f"LoRA adapter {str(folder)!r} holds no LoRA tensors")
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module, kinds in sorted(found.items()):
        missing = {"A", "B"} - kinds.keys()
        if missing:
            raise ValueError(
                f"LoRA adapter {str(folder)!r}: module {module!r} has no lora_{missing.pop()} weight"
            )
        pairs[module] = (kinds["A"], kinds["B"])
    return pairs


def _place_modules(
    pairs: Mapping[str, object],
    packed_modules_mapping: Mapping[str, Sequence[str]],
    lora_modules: Mapping[str, int],
) -> dict[str, _Placement]:
    """Where each checkpoint module's adapter goes in kvflow's layers (see `_Placement`)."""
    packed_part = {
        part: (packed, index)
        for packed, parts in packed_modules_mapping.items()
        for index, part in enumerate(parts)
    }
    placements: dict[str, _Placement] = {}
    for module in pairs:
        parent, _, leaf = module.rpartition(".")
        if leaf in packed_part:
            packed, index = packed_part[leaf]
            name = f"{parent}.{packed}" if parent else packed
            placement = _Placement(name, (index,))
        else:
            placement = _Placement(module, tuple(range(lora_modules.get(module, 1))))
        if placement.module_name not in lora_modules:
            raise ValueError(
                f"LoRA adapter targets module {module!r}, which kvflow cannot apply LoRA to (only the dense "
                "layers' attention and MLP projections take an adapter; not embeddings, the LM head or MoE "
                "experts)"
            )
        if len(placement.parts) == 1 and placement.parts[0] >= lora_modules[placement.module_name]:
            raise ValueError(
                f"LoRA adapter module {module!r} maps to part {placement.parts[0]} of "
                f"{placement.module_name!r}, which has {lora_modules[placement.module_name]} parts"
            )
        placements[module] = placement
    return placements


def _check_rank(
    module: str, lora_a: torch.Tensor, lora_b: torch.Tensor, rank: int, max_lora_rank: int
) -> None:
    if lora_a.shape[0] != lora_b.shape[1]:
        raise ValueError(
            f"LoRA adapter module {module!r}: lora_A {tuple(lora_a.shape)} and lora_B {tuple(lora_b.shape)} "
            "disagree on the rank"
        )
    if lora_a.shape[0] != rank:
        raise ValueError(
            f"LoRA adapter module {module!r}: tensors have rank {lora_a.shape[0]} but adapter_config.json "
            f"gives it rank {rank}"
        )
    if rank > max_lora_rank:
        raise ValueError(
            f"LoRA adapter module {module!r} has rank {rank}, above max_lora_rank={max_lora_rank}"
        )


def _split_rows(
    module: str,
    placement: _Placement,
    lora_b: torch.Tensor,
    part_sizes: Mapping[str, Sequence[int]] | None,
) -> tuple[torch.Tensor, ...]:
    """B's rows for each of `placement.parts`: B whole for one part, else B split by the layer's part sizes
    (checked against them whenever they are given)."""
    sizes = None if part_sizes is None else part_sizes.get(placement.module_name)
    if sizes is None:
        if len(placement.parts) > 1:
            raise ValueError(
                f"LoRA adapter module {module!r} is a fused module of {len(placement.parts)} parts: loading it "
                f"needs part_sizes for {placement.module_name!r} (the output rows of each part)"
            )
        return (lora_b,)
    expected = [int(sizes[part]) for part in placement.parts]
    if lora_b.shape[0] != sum(expected):
        raise ValueError(
            f"LoRA adapter module {module!r}: lora_B has {lora_b.shape[0]} rows, but "
            f"{placement.module_name!r} part(s) {list(placement.parts)} have {sum(expected)} ({expected})"
        )
    return tuple(lora_b.split(expected, dim=0))


def _module_weights(
    name: str,
    parts: Sequence[tuple[torch.Tensor | None, torch.Tensor | None]],
    input_sizes: Mapping[str, int] | None,
) -> LoRAModuleWeights:
    columns = {a.shape[1] for a, _ in parts if a is not None}
    expected = None if input_sizes is None else input_sizes.get(name)
    if len(columns) > 1 or (expected is not None and columns != {expected}):
        raise ValueError(
            f"LoRA adapter for {name!r}: lora_A in_features {sorted(columns)} do not match the layer's "
            f"{expected if expected is not None else 'single input size'}"
        )
    return LoRAModuleWeights(
        module_name=name,
        lora_a=tuple(a for a, _ in parts),
        lora_b=tuple(b for _, b in parts),
    )


def _num_bytes(modules: Iterable[LoRAModuleWeights]) -> int:
    """Bytes of every distinct tensor storage (a shared A counted once)."""
    seen: dict[int, int] = {}
    for module in modules:
        for tensor in (*module.lora_a, *module.lora_b):
            if tensor is not None:
                seen[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
    return sum(seen.values())
