"""Checkpoint names to parameters: how a model's Hugging Face-named tensors load through its `weight_loader`s.

A model names in `packed_modules_mapping` the checkpoint projections each of its fused modules stacks (`q_proj`
loads into shard 0 of `qkv_proj`, and so on); `load_weights` maps each checkpoint name to a parameter and shard and
calls that parameter's `weight_loader`, which cuts this rank's part, places it and casts it
(`kvflow.models.layers.weights`); `checkpoint_index` tells the file reader which part of a tensor a rank needs.
Nothing here knows a model family: a layer with another layout (quantized, or a stack of experts) plugs in through
its parameters' weight loaders and `checkpoint_index`. A stacked parameter filled from many checkpoint tensors (a
`FusedMoE`'s experts) lists the shards it needs in its `checkpoint_shards` attribute, and the model maps those
tensors' names with `checkpoint_target(name) -> (parameter name, shard) | None` (None: the usual mapping).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import nn

from kvflow.models.layers.weights import RankPart, WeightShapeError, default_weight_loader

logger = logging.getLogger(__name__)

# Checkpoint tensors no parameter holds: RoPE frequencies (kvflow computes them from the config).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# The Hugging Face names of the LM head and the token embedding it falls back to when a checkpoint has no head.
LM_HEAD = "lm_head.weight"
EMBEDDING = "model.embed_tokens.weight"


class PackedNames:
    """Checkpoint names <-> (parameter, shard) under a model's `packed_modules_mapping`.

    `packed_modules_mapping` maps a fused module to the checkpoint modules it stacks, in shard order (e.g.
    `{"qkv_proj": ["q_proj", "k_proj", "v_proj"]}`): `...q_proj.weight` loads into shard 0 of `...qkv_proj.weight`.
    Any other name is the parameter's own, shard None (the whole parameter).
    """

    def __init__(self, packed_modules_mapping: Mapping[str, Sequence[str]]) -> None:
        self._parts = {
            f".{part}.": (f".{packed}.", shard)
            for packed, parts in packed_modules_mapping.items()
            for shard, part in enumerate(parts)
        }
        self._num_shards = {
            f".{packed}.": len(parts) for packed, parts in packed_modules_mapping.items()
        }

    def target(self, checkpoint_name: str) -> tuple[str, int | None]:
        """The parameter and shard a checkpoint tensor loads into."""
        for part, (packed, shard) in self._parts.items():
            if part in checkpoint_name:
                return checkpoint_name.replace(part, packed), shard
        return checkpoint_name, None

    def shards(self, param_name: str) -> tuple[int | None, ...]:
        """The shards a whole checkpoint fills in `param_name`: (0, 1, ...) for a packed one, else (None,)."""
        for packed, num_shards in self._num_shards.items():
            if packed in param_name:
                return tuple(range(num_shards))
        return (None,)

    def checkpoint_name(self, param_name: str, shard: int | None) -> str:
        """The checkpoint-side name of shard `shard` of `param_name` (what the file should hold)."""
        for part, (packed, part_shard) in self._parts.items():
            if part_shard == shard and packed in param_name:
                return param_name.replace(packed, part)
        return param_name


def checkpoint_index(model: nn.Module, checkpoint_name: str) -> tuple[slice, ...]:
    """The part of checkpoint tensor `checkpoint_name` `model`'s rank holds (`()`: all of it), as the layer owning
    the parameter says (its `checkpoint_index(param_name, shard)`). Names the model does not know are read whole, so
    `load_weights` reports them."""
    name, shard = PackedNames(getattr(model, "packed_modules_mapping", {})).target(checkpoint_name)
    module_name, _, param_name = name.rpartition(".")
    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        return ()
    index = getattr(module, "checkpoint_index", None)
    return () if index is None else index(param_name, shard)


def load_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    *,
    strict: bool = True,
    sliced: bool = False,
) -> None:
    """Copy Hugging Face-named tensors into `model`'s parameters through their `weight_loader`s.

    `weights` are whole checkpoint tensors (each weight loader cuts this rank's part), or, with `sliced`, already
    this rank's parts (as `iterate_safetensors_weights(path, model.checkpoint_index)` reads them). `rotary_emb.
    inv_freq` is skipped; a checkpoint `lm_head.weight` is ignored when the head is tied to the embedding, and a
    whole checkpoint (`strict`) without one ties it (as transformers does). Raises one ValueError naming every
    unexpected name, shape mismatch and (when `strict`) missing tensor; `strict=False` updates just the tensors given.
    """
    names = PackedNames(getattr(model, "packed_modules_mapping", {}))
    params = dict(model.named_parameters())  # a tied head shares the embedding's entry
    target = getattr(model, "checkpoint_target", None)

    def shards_of(name: str) -> tuple[object, ...]:
        return getattr(params[name], "checkpoint_shards", None) or names.shards(name)

    expected = {(name, shard) for name in params for shard in shards_of(name)}
    loaded: set[tuple[str, object]] = set()
    unexpected: list[str] = []
    mismatched: list[str] = []
    saw_lm_head = False
    for checkpoint_name, tensor in weights:
        if checkpoint_name.endswith(IGNORED_SUFFIXES):
            continue
        if checkpoint_name == LM_HEAD and LM_HEAD not in params:
            saw_lm_head = True  # tied: the embedding provides it
            continue
        custom = target(checkpoint_name) if target is not None else None
        name, shard = custom if custom is not None else names.target(checkpoint_name)
        param = params.get(name)
        if param is None:
            unexpected.append(checkpoint_name)
            continue
        weight_loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            weight_loader(param, RankPart(tensor) if sliced else tensor, shard)
        except WeightShapeError as error:
            mismatched.append(f"{checkpoint_name}: {error}")
            continue
        filled = shards_of(name) if shard is None else (shard,)  # None: the whole parameter
        loaded.update((name, filled_shard) for filled_shard in filled)
    if strict:
        _tie_if_lm_head_absent(model, expected, loaded)
    missing = sorted(expected - loaded, key=str) if strict else []
    _raise_on_load_errors(
        unexpected,
        mismatched,
        [
            f"{name}{list(shard)}"
            if isinstance(shard, tuple)
            else names.checkpoint_name(name, shard)
            for name, shard in missing
        ],
    )
    if saw_lm_head:
        logger.debug("tie_word_embeddings: ignored the checkpoint's lm_head.weight")


def _tie_if_lm_head_absent(
    model: nn.Module,
    expected: set[tuple[str, object]],
    loaded: set[tuple[str, object]],
) -> None:
    """A checkpoint without `lm_head.weight` ties the head to the embedding (as transformers does)."""
    lm_head = (LM_HEAD, None)
    if lm_head in expected and lm_head not in loaded and (EMBEDDING, None) in loaded:
        logger.warning("checkpoint has no lm_head.weight: tying the LM head to the token embedding")
        model.get_submodule("lm_head").tie(model.get_submodule("model.embed_tokens"))
        expected.discard(lm_head)


def _raise_on_load_errors(unexpected: list[str], mismatched: list[str], missing: list[str]) -> None:
    problems = []
    if unexpected:
        problems.append(f"unexpected parameters: {', '.join(unexpected)}")
    if mismatched:
        problems.append(f"shape mismatches: {'; '.join(mismatched)}")
    if missing:
        problems.append(f"missing parameters: {', '.join(missing)}")
    if problems:
        raise ValueError("cannot load checkpoint weights: " + " | ".join(problems))
