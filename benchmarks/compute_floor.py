"""The compute floor of a run: how long the model's matrix products alone take at the batch sizes the run used.

A forward pass of a Llama-family model runs, per decoder layer, four linear layers (fused QKV, output projection,
fused gate/up, down) on every scheduled token, except that kvflow's last layer runs the output projection and MLP
only on the rows it samples; then the LM head on the sampled rows. Everything else (attention, norms, RoPE,
sampling, scheduling) is overhead above the floor. The floor of a run is

    sum over the run's forward passes, over the model's linear layers, of time(the product at that pass's rows)

where `time(N, K, M)` is measured on this machine, now, with the model's weights' dtype and the threads torch
uses: best of a few repeats at a grid of row counts (1, 2, 3, 4, 6, 8, 12, ... up to the largest the run used),
interpolated linearly between grid points. At each grid point both `F.linear` and kvflow's own
`kvflow.kernels.linear` (the GEMV/GEMM kernels, where they apply on this CPU) are timed and the faster counts, so
the floor is the best product kvflow could call, never a slower library's (`GemmFloor.sources` says which won).
Its FLOPs are `2 * M * N * K` per product, so `floor FLOPs / floor seconds` is the GEMM rate the hardware reached
on these shapes.

Weights come from memory, as in a forward pass. A forward pass reads every weight once (737 MiB for the
Qwen2-0.5B shape), so no layer's weight is still in cache when the next pass reaches it; timing one weight over and
over would time it from the last-level cache instead (48 MiB on the development machine holds any one layer's
weights), which no engine can reach. Up to `COLD_MAX_ROWS` rows, where a product's time is mostly reading its
weight, each timed repeat therefore runs the product over enough copies of the weight (`COLD_BYTES` in all) that
each is evicted before its turn comes again, and the time per product is the sweep's time over the number of copies.
Above it each weight byte feeds at least 128 FLOPs, the products are compute-bound, and one weight is timed.

`GemmFloor.measure(model, passes)` does all of this for a list of `(num_tokens, num_sampled)` passes.

`PhysicalFloor` is the bound the hardware itself sets, from two rates measured in the same run rather than from
the products kvflow could call: a pass cannot take less than reading every linear weight once at the machine's
read bandwidth (the best `.sum()` over a large float32 tensor), nor less than its FLOPs at the best GEMM rate a
large matmul reaches here (4096^3, the model's dtype or float32, whichever is faster), so

    physical floor = sum over passes of max(weight bytes / read bandwidth, pass FLOPs / peak GEMM rate)

Decode passes land on the first term, prompt-heavy ones on the second. Where the products kvflow calls fall short
of these rates (bf16 on a CPU whose GEMMs go through oneDNN's generic path, say), the compute floor above is
higher than this one.
"""

from __future__ import annotations

import bisect
import time
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from kvflow import kernels

# Up to this many rows a timed product reads its weight from memory: the copies it sweeps over total COLD_BYTES,
# more than any last-level cache this runs on.
COLD_MAX_ROWS = 64
COLD_BYTES = 256 * 2**20
ROWS_TOKENS = "tokens"
ROWS_SAMPLED = "sampled"
SOURCE_TORCH = "torch"
SOURCE_KERNEL = "kvflow kernel"


@dataclass(frozen=True)
class GemmShape:
    """A linear layer's weight `[out_features, in_features]` and whose rows it runs on (every scheduled token or
    only the sampled ones)."""

    out_features: int
    in_features: int
    rows: str


def row_grid(max_rows: int) -> list[int]:
    """1, 2, 3, 4, 6, 8, 12, 16, 24, ... (powers of two and their midpoints) up to and including `max_rows`."""
    grid: list[int] = []
    power = 1
    while power < max_rows:
        grid.append(power)
        if power >= 2 and power + power // 2 < max_rows:
            grid.append(power + power // 2)
        power *= 2
    grid.append(max_rows)
    return sorted(set(grid))


def model_gemm_shapes(model: nn.Module) -> Counter[GemmShape]:
    """The linear layers of one forward pass of kvflow's Llama-family model, counted by shape.

    Decoder layers: every 2-D weight of a layer's attention and MLP (QKV, o, gate/up, down). The first projection of
    attention (QKV) runs on every token in every layer; in the last layer the others run only on sampled rows. The
    LM head runs on sampled rows.
    """
    layers = list(model.model.layers)  # type: ignore[union-attr]
    shapes: Counter[GemmShape] = Counter()
    for index, layer in enumerate(layers):
        last = index == len(layers) - 1
        for name, parameter in layer.named_parameters():
            if parameter.dim() != 2 or not name.endswith("weight"):
                continue
            rows = ROWS_TOKENS if (not last or "qkv" in name) else ROWS_SAMPLED
            shapes[GemmShape(parameter.shape[0], parameter.shape[1], rows)] += 1
    head = model.lm_head.weight  # type: ignore[union-attr]
    shapes[GemmShape(head.shape[0], head.shape[1], ROWS_SAMPLED)] += 1
    return shapes


def pass_flops(shapes: Counter[GemmShape], num_tokens: int, num_sampled: int) -> float:
    """2 * M * N * K over the model's linear layers for one pass of `num_tokens` tokens, `num_sampled` sampled."""
    return sum(
        count
        * 2.0
        * (num_tokens if shape.rows == ROWS_TOKENS else num_sampled)
        * shape.out_features
        * shape.in_features
        for shape, count in shapes.items()
    )


def time_linear(
    out_features: int,
    in_features: int,
    rows: int,
    dtype: torch.dtype,
    repeats: int,
    *,
    kernel: bool = False,
    cold_bytes: int = COLD_BYTES,
) -> float | None:
    """Best-of-`repeats` seconds of one `F.linear([rows, in], [out, in])` in `dtype` (after one warm-up call),
    with the weight read from memory up to `COLD_MAX_ROWS` rows (see the module docstring); with `kernel`, of
    `kvflow.kernels.linear` instead, or None where no kvflow kernel applies."""
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=generator).to(dtype)
    weight = torch.randn(out_features, in_features, generator=generator).to(dtype)
    with torch.inference_mode():
        if kernel:
            if kernels.linear(x, weight) is None:
                return None
            product = lambda w: kernels.linear(x, w)  # noqa: E731
        else:
            product = lambda w: F.linear(x, w)  # noqa: E731
        product(weight)
        weights = [weight]
        if rows <= COLD_MAX_ROWS:
            num_copies = -(-cold_bytes // (weight.numel() * weight.element_size()))
            weights += [weight.clone() for _ in range(num_copies - 1)]
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            for each_weight in weights:
                product(each_weight)
            best = min(best, (time.perf_counter() - start) / len(weights))
    return best


def fastest_linear(
    out_features: int,
    in_features: int,
    rows: int,
    dtype: torch.dtype,
    repeats: int,
    cold_bytes: int = COLD_BYTES,
) -> tuple[float, str]:
    """The faster of `F.linear` and kvflow's kernel (where one applies): `(seconds, SOURCE_TORCH or
    SOURCE_KERNEL)`."""
    torch_s = time_linear(out_features, in_features, rows, dtype, repeats, cold_bytes=cold_bytes)
    assert torch_s is not None
    kernel_s = time_linear(
        out_features, in_features, rows, dtype, repeats, kernel=True, cold_bytes=cold_bytes
    )
    if kernel_s is not None and kernel_s < torch_s:
        return kernel_s, SOURCE_KERNEL
    return torch_s, SOURCE_TORCH


@dataclass
class GemmFloor:
    """The measured floor of a run (see the module docstring).

    Invariants: `seconds` and `flops` cover exactly the given passes; `seconds_by_rows[shape]` holds the measured
    time at every grid point of that shape's row kind, and `source_by_rows[shape]` the same grid points' faster
    product (`SOURCE_TORCH` or `SOURCE_KERNEL`).
    """

    seconds: float
    flops: float
    num_passes: int
    seconds_by_rows: dict[GemmShape, dict[int, float]] = field(repr=False)
    source_by_rows: dict[GemmShape, dict[int, str]] = field(repr=False)

    @property
    def gflops_per_s(self) -> float:
        return self.flops / self.seconds / 1e9

    def sources(self) -> list[str]:
        """One line per shape: which product the floor used at which grid row counts, e.g.
        `floor GEMM 1152x896 (tokens rows): kvflow kernel at 1,2,3,4,6,8,12,16; torch at none`."""
        lines = []
        for shape, by_rows in self.source_by_rows.items():
            parts = []
            for source in (SOURCE_KERNEL, SOURCE_TORCH):
                rows = [count for count, used in sorted(by_rows.items()) if used == source]
                parts.append(f"{source} at {_rows_text(rows)}")
            lines.append(
                f"floor GEMM {shape.out_features}x{shape.in_features} ({shape.rows} rows): "
                + "; ".join(parts)
            )
        return lines

    @classmethod
    def measure(
        cls,
        model: nn.Module,
        passes: list[tuple[int, int]],
        *,
        dtype: torch.dtype,
        repeats: int = 3,
        cold_bytes: int = COLD_BYTES,
    ) -> GemmFloor:
        """The floor of `passes` (each `(num_tokens, num_sampled)`) through `model`'s linear layers; the weight
        copies a product sweeps total `cold_bytes` (a smoke run passes less: its figures mean nothing anyway)."""
        shapes = model_gemm_shapes(model)
        max_rows = {
            ROWS_TOKENS: max((tokens for tokens, _ in passes), default=1),
            ROWS_SAMPLED: max((sampled for _, sampled in passes), default=1),
        }
        measured = {
            shape: {
                rows: fastest_linear(
                    shape.out_features, shape.in_features, rows, dtype, repeats, cold_bytes
                )
                for rows in row_grid(max_rows[shape.rows])
            }
            for shape in shapes
        }
        seconds_by_rows = {
            shape: {rows: timed[0] for rows, timed in grid.items()}
            for shape, grid in measured.items()
        }
        source_by_rows = {
            shape: {rows: timed[1] for rows, timed in grid.items()}
            for shape, grid in measured.items()
        }
        seconds = flops = 0.0
        for num_tokens, num_sampled in passes:
            for shape, count in shapes.items():
                rows = num_tokens if shape.rows == ROWS_TOKENS else num_sampled
                seconds += count * interpolate(seconds_by_rows[shape], rows)
            flops += pass_flops(shapes, num_tokens, num_sampled)
        return cls(seconds, flops, len(passes), seconds_by_rows, source_by_rows)


def read_bandwidth(num_bytes: int, repeats: int) -> float:
    """Bytes per second of the best of `repeats` `.sum()`s over a float32 tensor of `num_bytes` (torch's threads)."""
    data = torch.ones(num_bytes // 4, dtype=torch.float32)
    data.sum()  # first touch and warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.nbytes / best


def peak_gemm_rate(
    size: int, dtypes: tuple[torch.dtype, ...], repeats: int
) -> tuple[float, torch.dtype]:
    """FLOP/s of the best of `repeats` `size`^3 matmuls in each of `dtypes` (after a warm-up): the fastest and its
    dtype."""
    best: tuple[float, torch.dtype] = (0.0, dtypes[0])
    generator = torch.Generator().manual_seed(0)
    for dtype in dtypes:
        a = torch.randn(size, size, generator=generator).to(dtype)
        b = torch.randn(size, size, generator=generator).to(dtype)
        with torch.inference_mode():
            torch.matmul(a, b)
            for _ in range(repeats):
                start = time.perf_counter()
                torch.matmul(a, b)
                rate = 2.0 * size**3 / (time.perf_counter() - start)
                best = max(best, (rate, dtype), key=lambda item: item[0])
    return best


@dataclass(frozen=True)
class PhysicalFloor:
    """The hardware's bound on a run (see the module docstring).

    Invariant: `seconds` is the sum over the run's passes of max(`weight_bytes` / `read_bytes_per_s`, the pass's
    FLOPs / `peak_flops_per_s`); `memory_bound_passes` counts the passes where the first term is the larger.
    """

    seconds: float
    num_passes: int
    memory_bound_passes: int
    weight_bytes: int
    flops: float
    read_bytes_per_s: float
    peak_flops_per_s: float
    peak_dtype: torch.dtype

    def describe(self) -> str:
        return (
            f"physical floor: {self.seconds:.2f} s over {self.num_passes} passes "
            f"({self.memory_bound_passes} bound by reading {self.weight_bytes / 1e9:.3f} GB of linear weights at "
            f"{self.read_bytes_per_s / 1e9:.1f} GB/s, the rest by {self.flops / 1e12:.2f} TFLOP in all at "
            f"{self.peak_flops_per_s / 1e12:.2f} TFLOP/s, the best square "
            f"{str(self.peak_dtype).removeprefix('torch.')} matmul measured here)"
        )

    @classmethod
    def measure(
        cls,
        model: nn.Module,
        passes: list[tuple[int, int]],
        *,
        dtype: torch.dtype,
        bandwidth_bytes: int = 2 * 2**30,
        matmul_size: int = 4096,
        repeats: int = 3,
    ) -> PhysicalFloor:
        """The physical floor of `passes` (each `(num_tokens, num_sampled)`) through `model`, whose linear
        weights are `dtype`; the two rates measured now over `bandwidth_bytes` and `matmul_size`^3."""
        return cls.from_rates(
            model,
            passes,
            dtype=dtype,
            read_bytes_per_s=read_bandwidth(bandwidth_bytes, repeats),
            peak=peak_gemm_rate(matmul_size, tuple(dict.fromkeys((dtype, torch.float32))), repeats),
        )

    @classmethod
    def from_rates(
        cls,
        model: nn.Module,
        passes: list[tuple[int, int]],
        *,
        dtype: torch.dtype,
        read_bytes_per_s: float,
        peak: tuple[float, torch.dtype],
    ) -> PhysicalFloor:
        """The floor of `passes` at given rates (`peak`: FLOP/s and the dtype that reached it)."""
        shapes = model_gemm_shapes(model)
        element_size = torch.empty((), dtype=dtype).element_size()
        weight_bytes = sum(
            count * shape.out_features * shape.in_features for shape, count in shapes.items()
        )
        weight_bytes *= element_size
        memory_s = weight_bytes / read_bytes_per_s
        seconds = flops = 0.0
        memory_bound = 0
        for num_tokens, num_sampled in passes:
            this_flops = pass_flops(shapes, num_tokens, num_sampled)
            flops += this_flops
            compute_s = this_flops / peak[0]
            memory_bound += memory_s >= compute_s
            seconds += max(memory_s, compute_s)
        return cls(seconds, len(passes), memory_bound, weight_bytes, flops, read_bytes_per_s, *peak)


def _rows_text(rows: list[int]) -> str:
    """`"none"` or the grid row counts, comma-separated."""
    return ",".join(map(str, rows)) if rows else "none"


def interpolate(seconds_at: dict[int, float], rows: int) -> float:
    """Linear interpolation of measured times between the two grid points around `rows` (0 for no rows)."""
    if rows <= 0:
        return 0.0
    grid = sorted(seconds_at)
    if rows in seconds_at:
        return seconds_at[rows]
    right = bisect.bisect_left(grid, rows)
    if right == 0:
        return seconds_at[grid[0]]
    if right == len(grid):
        return seconds_at[grid[-1]] * rows / grid[-1]
    low, high = grid[right - 1], grid[right]
    weight = (rows - low) / (high - low)
    return seconds_at[low] * (1 - weight) + seconds_at[high] * weight
