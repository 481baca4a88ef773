"""Reading safetensors files with positioned reads instead of a memory map, so loading never holds two copies.

`safetensors.safe_open` maps the whole file; every page a tensor copy touches then counts in the process's resident
memory until the handle closes, so loading a one-file checkpoint peaks at about twice the weights. Here each tensor
is read with `os.preadv` straight into a fresh tensor's buffer: the file's pages go through the page cache (not this
process's RSS), and the only memory beyond the model's parameters is the one tensor being copied in.

The format: 8 bytes little-endian header length `n`, `n` bytes of JSON `{name: {"dtype", "shape", "data_offsets":
[begin, end]}, "__metadata__": {...}}`, then the data; offsets are relative to the end of the header; tensors are
stored C-contiguous, little-endian.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from math import prod
from pathlib import Path
from types import TracebackType

import torch

_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_MAX_HEADER_BYTES = 100 * 2**20
# One preadv call moves at most this many bytes (Linux caps a single read near 2 GiB).
_READ_CHUNK_BYTES = 1 << 30


class SafetensorsFormatError(ValueError):
    """The file is not a well-formed safetensors file (the message names the file and what is wrong)."""


@dataclass(frozen=True)
class TensorEntry:
    """One tensor's place in the file. Invariant: `end - begin == prod(shape) * dtype's itemsize`; `begin` is an
    absolute file offset."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def row_bytes(self) -> int:
        """Bytes of one index along the first dimension (the whole tensor for a scalar)."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return prod(self.shape[1:]) * itemsize


class SafetensorsFile:
    """An open safetensors file; `read(name)` returns a tensor of its own (nothing stays mapped).

    Use as a context manager (or call `close`). `read(name, index)` reads only the rows `index` selects in the
    first dimension (a contiguous byte range).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._fd = os.open(self.path, os.O_RDONLY)
        try:
            self.entries, self.metadata = self._read_header()
        except BaseException:
            os.close(self._fd)
            raise

    def _fail(self, problem: str) -> SafetensorsFormatError:
        return SafetensorsFormatError(
            f"{str(self.path)!r} is not a valid safetensors file: {problem}"
        )

    def _read_header(self) -> tuple[dict[str, TensorEntry], dict[str, str]]:
        file_size = os.fstat(self._fd).st_size
        prefix = os.pread(self._fd, 8, 0)
        if len(prefix) != 8:
            raise self._fail("shorter than its 8-byte header length")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > min(_MAX_HEADER_BYTES, file_size - 8):
            raise self._fail(f"header length {header_len} exceeds the file ({file_size} bytes)")
        try:
            header = json.loads(os.pread(self._fd, header_len, 8))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise self._fail(f"header is not JSON ({error})") from None
        if not isinstance(header, dict):
            raise self._fail("header is not a JSON object")
        data_start = 8 + header_len
        metadata = header.pop("__metadata__", None) or {}
        entries: dict[str, TensorEntry] = {}
        for name, info in header.items():
            entries[name] = self._entry(name, info, data_start, file_size)
        return entries, metadata

    def _entry(self, name: str, info: object, data_start: int, file_size: int) -> TensorEntry:
        try:
            dtype = _DTYPES[info["dtype"]]  # type: ignore[index]
            shape = tuple(int(size) for size in info["shape"])  # type: ignore[index]
            begin, end = (int(offset) for offset in info["data_offsets"])  # type: ignore[index]
        except (KeyError, TypeError, ValueError) as error:
            raise self._fail(f"tensor {name!r} has a bad entry ({error!r})") from None
        itemsize = torch.empty((), dtype=dtype).element_size()
        if end - begin != prod(shape) * itemsize or begin < 0 or data_start + end > file_size:
            raise self._fail(
                f"tensor {name!r}'s data_offsets {[begin, end]} do not fit its shape or the file"
            )
        return TensorEntry(dtype, shape, data_start + begin, data_start + end)

    def names(self) -> list[str]:
        """Tensor names in the file's order of data."""
        return sorted(self.entries, key=lambda name: self.entries[name].begin)

    def read(self, name: str, index: slice | tuple[slice, ...] = ()) -> torch.Tensor:
        """Tensor `name`, or the part `index` selects (basic slices, one per leading dimension, as in
        `tensor[index]`), as a new contiguous CPU tensor.

        The first dimension's slice (step 1) becomes a byte range of the file, so a tensor-parallel rank reads
        just its row shard; slices of later dimensions (a row-parallel rank's columns) are cut from those rows in
        memory, a bounded number of rows at a time: the rows in flight never take more than the part returned
        (or one row), so a rank never holds the whole tensor.
        """
        entry = self.entries[name]
        index = index if isinstance(index, tuple) else (index,)
        if not index or not entry.shape:
            tensor = torch.empty(entry.shape, dtype=entry.dtype)
            self._read_exactly(tensor, entry.begin, name)
            return tensor
        start, stop, step = index[0].indices(entry.shape[0])
        if step != 1:
            raise ValueError(f"the first-dimension slice of {name!r} must have step 1, got {step}")
        stop = max(start, stop)
        if len(index) == 1:
            rows = torch.empty((stop - start, *entry.shape[1:]), dtype=entry.dtype)
            self._read_exactly(rows, entry.begin + start * entry.row_bytes, name)
            return rows
        return self._read_rows_cut(entry, start, stop, index[1:], name)

    def _read_rows_cut(
        self, entry: TensorEntry, start: int, stop: int, cut: tuple[slice, ...], name: str
    ) -> torch.Tensor:
        """Rows `start:stop`, each cut by `cut` (slices of the later dimensions), read in chunks of rows no larger
        than the result."""
        cut_shape = torch.empty((0, *entry.shape[1:]), device="meta")[(slice(None), *cut)].shape[1:]
        result = torch.empty((stop - start, *cut_shape), dtype=entry.dtype)
        result_bytes = result.numel() * result.element_size()
        rows_per_chunk = max(1, min(stop - start, result_bytes // max(entry.row_bytes, 1)))
        for chunk_start in range(start, stop, rows_per_chunk):
            chunk_stop = min(stop, chunk_start + rows_per_chunk)
            rows = torch.empty((chunk_stop - chunk_start, *entry.shape[1:]), dtype=entry.dtype)
            self._read_exactly(rows, entry.begin + chunk_start * entry.row_bytes, name)
            result[chunk_start - start : chunk_stop - start] = rows[(slice(None), *cut)]
        return result

    def _read_exactly(self, tensor: torch.Tensor, offset: int, name: str) -> None:
        """Fill contiguous `tensor`'s bytes from the file at `offset`."""
        if tensor.numel() == 0:
            return
        view = memoryview(tensor.view(-1).view(torch.uint8).numpy())
        done = 0
        while done < len(view):
            chunk = view[done : done + _READ_CHUNK_BYTES]
            count = os.preadv(self._fd, [chunk], offset + done)
            if count <= 0:
                raise self._fail(f"tensor {name!r} ends past the end of the file")
            done += count

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
