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
    """Output tokens per 1 s bin, spreading each request's tokens over its stream (first token at TTFT)."""
    if not results:
        return
    origin = min(result.start_time for result in results)
    bins: dict[int, float] = {}
    for result in results:
        moment = result.start_time - origin + result.ttft
        token_times = [moment]
        for gap in result.itl:
            moment += gap
            token_times.append(moment)
        tokens_per_chunk = result.output_tokens / len(token_times)
        for token_time in token_times:
            bins[int(token_time)] = bins.get(int(token_time), 0.0) + tokens_per_chunk
    seconds = sorted(bins)
    axis.plot(seconds, [bins[second] for second in seconds])
    axis.set_xlabel("time since start (s)")
    axis.set_ylabel("output tokens / s")
    axis.set_title("Throughput over time")
    axis.grid(True, alpha=0.3)
