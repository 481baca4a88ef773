"""`SafetensorsFile`: reads what `safetensors` wrote, bit for bit, in whole or by rows; clear errors; and loading a
checkpoint through it never holds a second copy of the weights (peak RSS measured in a fresh process)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kvflow.models.safetensors_io import SafetensorsFile, SafetensorsFormatError
from kvflow.testing.hf_checkpoints import make_tiny_checkpoint

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32]
DTYPES += [torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn]


def _random(shape: tuple[int, ...], dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.rand(shape, generator=generator) > 0.5
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=generator) * 3).to(dtype)
    return torch.randint(0, 100, shape, generator=generator).to(dtype)


def test_every_dtype_and_shape_reads_back_bitwise(tmp_path: Path) -> None:
    generator = torch.Generator().manual_seed(0)
    shapes = [(), (1,), (7,), (3, 5), (2, 3, 4), (0, 4)]
    tensors = {
        f"t{index}_{str(dtype).removeprefix('torch.')}": _random(shape, dtype, generator)
        for index, (dtype, shape) in enumerate(
            (dtype, shape) for dtype in DTYPES for shape in shapes
        )
    }
    save_file(tensors, str(tmp_path / "all.safetensors"), metadata={"format": "pt"})
    with SafetensorsFile(tmp_path / "all.safetensors") as handle:
        assert set(handle.names()) == set(tensors) and handle.metadata == {"format": "pt"}
        for name, expected in tensors.items():
            got = handle.read(name)
            assert got.dtype == expected.dtype and got.shape == expected.shape, name
            assert torch.equal(got.view(-1).view(torch.uint8), expected.view(-1).view(torch.uint8))


def test_slices_read_like_tensor_indexing(tmp_path: Path) -> None:
    weight = torch.randn(10, 6, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    save_file({"w": weight}, str(tmp_path / "w.safetensors"))
    with SafetensorsFile(tmp_path / "w.safetensors") as handle:
        for rows in (slice(0, 5), slice(5, 10), slice(3, 4), slice(-2, None), slice(7, 3)):
            assert torch.equal(handle.read("w", rows), weight[rows])
            assert torch.equal(handle.read("w", (rows,)), weight[rows])
        for columns in (slice(0, 3), slice(3, 6), slice(1, 5, 2)):
            part = handle.read("w", (slice(2, 8), columns))
            assert part.is_contiguous() and torch.equal(part, weight[2:8, columns])
        with pytest.raises(ValueError, match="step 1"):
            handle.read("w", slice(0, 10, 2))


def test_files_read_in_data_order_and_handle_closes(tmp_path: Path) -> None:
    save_file({"b": torch.zeros(2), "a": torch.ones(3)}, str(tmp_path / "x.safetensors"))
    handle = SafetensorsFile(tmp_path / "x.safetensors")
    names = handle.names()
    assert [handle.entries[name].begin for name in names] == sorted(
        handle.entries[name].begin for name in names
    )
    handle.close()
    handle.close()  # idempotent


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (b"\x01\x00", "shorter than its 8-byte header"),
        (b"\xff\x00\x00\x00\x00\x00\x00\x00{}", "exceeds the file"),
        (b"\x05\x00\x00\x00\x00\x00\x00\x00{garb", "not JSON"),
        (b"\x02\x00\x00\x00\x00\x00\x00\x00[]", "not a JSON object"),
    ],
)
def test_malformed_headers_name_the_file_and_the_problem(
    tmp_path: Path, content: bytes, problem: str
) -> None:
    path = tmp_path / "bad.safetensors"
    path.write_bytes(content)
    with pytest.raises(SafetensorsFormatError, match=rf"bad\.safetensors.*{problem}"):
        SafetensorsFile(path)


def test_offsets_that_do_not_fit_the_shape_or_the_file_are_rejected(tmp_path: Path) -> None:
    def write(entry: dict[str, object], data: bytes) -> Path:
        header = json.dumps({"w": entry}).encode()
        path = tmp_path / "w.safetensors"
        path.write_bytes(len(header).to_bytes(8, "little") + header + data)
        return path

    wrong_size = write({"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}, bytes(8))
    with pytest.raises(SafetensorsFormatError, match=r"'w'.*do not fit"):
        SafetensorsFile(wrong_size)
    truncated = write({"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}, bytes(8))
    with pytest.raises(SafetensorsFormatError, match=r"'w'.*do not fit"):
        SafetensorsFile(truncated)
    unknown_dtype = write({"dtype": "Q4", "shape": [4], "data_offsets": [0, 4]}, bytes(4))
    with pytest.raises(SafetensorsFormatError, match="'w' has a bad entry"):
        SafetensorsFile(unknown_dtype)


_PEAK_RSS_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    from kvflow.models.attention import resolve_attention_backend
    from kvflow.models.loader import load_model

    # The C++ kernels (the "auto" attention backend's) load before the baseline: their library is not the load's.
    resolve_attention_backend("auto", torch.device("cpu"))

    def status_kib(field):
        for line in open("/proc/self/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1])

    baseline = status_kib("VmRSS")
    model = load_model(sys.argv[1], dtype="float32")
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    growth = (status_kib("VmHWM") - baseline) * 1024
    print(json.dumps({"weights": weight_bytes, "largest": largest, "growth": growth}))
    """
)


def test_loading_peaks_at_the_weights_plus_one_tensor_not_two_copies(tmp_path: Path) -> None:
    """A ~115 MB float32 checkpoint in one file whose largest tensor is 7% of it: the load's peak RSS growth beyond
    the weights stays under half of them. A second copy (a memory-mapped read touches every page of the file) adds
    the whole checkpoint, ~1.0x; what remains here is the tensor in flight plus allocator and library pages that do
    not scale with the model (a few tens of MB on a fresh machine). benchmarks/latency.py holds the real-size figure
    to 1.2x of weights + KV."""
    path = make_tiny_checkpoint(
        tmp_path / "ckpt",
        "llama",
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=4000,
        tie_word_embeddings=False,
    )
    run = subprocess.run(
        [sys.executable, "-c", _PEAK_RSS_SCRIPT, str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    measured = json.loads(run.stdout.strip().splitlines()[-1])
    assert measured["weights"] > 100e6 and measured["largest"] < 0.1 * measured["weights"]
    assert measured["growth"] - measured["weights"] < 0.5 * measured["weights"], measured
