"""Reading a Hugging Face safetensors checkpoint folder: its weight files (one file, or the shards an index names)
and their tensors, whole or only the part a tensor-parallel rank holds."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from kvflow.models.safetensors_io import SafetensorsFile, SafetensorsFormatError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(model_path: str | Path) -> list[Path]:
    """The checkpoint's weight files: the shards named by the index, else the single `model.safetensors`."""
    path = Path(model_path)
    index_file = path / INDEX_FILE
    if index_file.is_file():
        try:
            weight_map = json.loads(index_file.read_text())["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as error:
            raise ValueError(
                f"{str(index_file)!r} is not a safetensors index with a 'weight_map': {error}"
            ) from error
        files = [path / name for name in sorted(set(weight_map.values()))]
        for file in files:
            if not file.is_file():
                raise FileNotFoundError(
                    f"shard {str(file)!r} named by {str(index_file)!r} does not exist"
                )
        return files
    single = path / SINGLE_FILE
    if single.is_file():
        return [single]
    raise FileNotFoundError(f"no {SINGLE_FILE!r} or {INDEX_FILE!r} in {str(path)!r}")


# Which part of a named checkpoint tensor to read: `()` all of it, slices of it, or None for none of it.
TensorSelector = Callable[[str], "tuple[slice, ...] | None"]


def iterate_safetensors_weights(
    model_path: str | Path, select: TensorSelector | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(name, tensor)` for every tensor of the checkpoint, file by file, on the CPU.

    Each tensor is read into memory of its own (`SafetensorsFile`: positioned reads, no memory map), so a consumer
    that copies it into a parameter and drops it holds one tensor beyond the model at any time, never a second copy
    of the checkpoint. With `select` (a tensor-parallel rank's `model.checkpoint_index`) only the part
    `select(name)` names is read (`SafetensorsFile.read(name, index)`), so a rank never materializes a whole
    sharded tensor; tensors it maps to None are skipped. A missing file raises FileNotFoundError naming it; an
    unreadable one ValueError naming it.
    """
    for file in safetensors_files(model_path):
        try:
            with SafetensorsFile(file) as handle:
                for name in handle.names():
                    index = () if select is None else select(name)
                    if index is not None:
                        yield name, handle.read(name, index)
        except SafetensorsFormatError:
            raise
        except OSError as error:
            raise ValueError(f"cannot read safetensors file {str(file)!r}: {error}") from error
