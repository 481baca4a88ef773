"""`kvflow bench serve --plot`: latency distributions and throughput over time (matplotlib, the `plot` extra)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from kvflow.benchmarks.request import RequestResult


def plot_results(path: Path, results: list[RequestResult], title: str) -> None:
    """Three panels: the TTFT CDF, the ITL CDF (ms), and output tokens per second over the run (1 s bins)."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no display
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise ValueError("--plot needs matplotlib: pip install 'kvflow[plot]'") from error
    done = [result for result in results if result.success]
    figure, (ttft_axis, itl_axis, throughput_axis) = plt.subplots(1, 3, figsize=(15, 4.5))
    _cdf(ttft_axis, [1000 * result.ttft for result in done], "TTFT (ms)")
    _cdf(itl_axis, [1000 * gap for result in done for gap in result.itl], "ITL (ms)")
    _throughput(throughput_axis, done)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def _cdf(axis: Axes, values: list[float], label: str) -> None:
    ordered = sorted(values)
    fractions = [(index + 1) / len(ordered) for index in range(len(ordered))]
    axis.plot(ordered, fractions)
    axis.set_xlabel(label)
    axis.set_ylabel("fraction of requests" if "TTFT" in label else "fraction of tokens")
    axis.set_title(f"{label.split()[0]} CDF")
    axis.grid(True, alpha=0.3)


def _throughput(axis: Axes, results: list[RequestResult]) -> None:
    """Output tokens per second over about 40 time bins, spreading each request's tokens over its stream (the first
    chunk at its TTFT, later ones after their inter-token gaps)."""
    if not results:
        return
    origin = min(result.start_time for result in results)
    chunk_times: list[tuple[float, float]] = []  # (seconds since start, tokens in that chunk)
    for result in results:
        moment = result.start_time - origin + result.ttft
        moments = [moment]
        for gap in result.itl:
            moment += gap
            moments.append(moment)
        chunk_times += [(moment, result.output_tokens / len(moments)) for moment in moments]
    bin_s = max(max(moment for moment, _ in chunk_times) / 40, 0.05)
    bins: dict[int, float] = {}
    for moment, tokens in chunk_times:
        bins[int(moment / bin_s)] = bins.get(int(moment / bin_s), 0.0) + tokens
    indices = range(max(bins) + 1)
    axis.plot(
        [index * bin_s for index in indices], [bins.get(index, 0.0) / bin_s for index in indices]
    )
    axis.set_xlabel("time since start (s)")
    axis.set_ylabel("output tokens / s")
    axis.set_title("Throughput over time")
    axis.grid(True, alpha=0.3)
