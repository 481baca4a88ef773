"""`kvflow bench serve --plot`: latency distributions and throughput over time (matplotlib, the `plot` extra).

The figure's panels, each found by its title: "TTFT CDF", "TPOT CDF" and "E2E latency CDF" (one value per
successful request, ms), "ITL CDF" (one value per gap between streamed chunks, ms; only when some request streamed
more than one chunk), and "Throughput over time, request rate R" (output tokens / s), which also marks the request
rate on a second y axis in requests / s: the configured `--request-rate` as a dashed line (for `inf` there is no line
and R reads "inf (all at once)") and the achieved rate (completed requests / duration) as a dotted one.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from kvflow.benchmarks.request import RequestResult

THROUGHPUT_TITLE = "Throughput over time"
CONFIGURED_RATE_LABEL = "configured request rate"
ACHIEVED_RATE_LABEL = "achieved request rate"


def plot_results(
    path: Path,
    results: list[RequestResult],
    title: str,
    *,
    request_rate: float,
    achieved_rate: float,
) -> Figure:
    """Draw the panels the module docstring lists into the PNG at `path` and return the figure (already closed:
    for inspection, not for showing). `request_rate` is the configured rate (`inf`: all at once) and
    `achieved_rate` the completed requests per second of the run, both in requests / s."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no display
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise ValueError("--plot needs matplotlib: pip install 'kvflow[plot]'") from error
    done = [result for result in results if result.success]
    gaps_ms = [1000 * gap for result in done for gap in result.itl]
    bottom_row = ["itl", "throughput", "throughput"] if gaps_ms else ["throughput"] * 3
    figure, axes = plt.subplot_mosaic([["ttft", "tpot", "e2el"], bottom_row], figsize=(15, 8))
    per_request = "fraction of requests"
    _cdf(axes["ttft"], [1000 * result.ttft for result in done], "TTFT (ms)", per_request, "TTFT")
    tpots_ms = [1000 * tpot for result in done if (tpot := result.tpot) is not None]
    _cdf(axes["tpot"], tpots_ms, "TPOT (ms)", per_request, "TPOT")
    e2els_ms = [1000 * result.latency for result in done]
    _cdf(axes["e2el"], e2els_ms, "E2E latency (ms)", per_request, "E2E latency")
    if gaps_ms:
        _cdf(axes["itl"], gaps_ms, "ITL (ms)", "fraction of token gaps", "ITL")
    _throughput(axes["throughput"], done)
    _mark_request_rate(axes["throughput"], request_rate, achieved_rate)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return figure


def rate_text(request_rate: float) -> str:
    """How a configured request rate reads in titles: `4 req/s`, or `inf (all at once)`."""
    return "inf (all at once)" if math.isinf(request_rate) else f"{request_rate:g} req/s"


def _cdf(axis: Axes, values: list[float], xlabel: str, ylabel: str, name: str) -> None:
    ordered = sorted(values)
    fractions = [(index + 1) / len(ordered) for index in range(len(ordered))]
    axis.plot(ordered, fractions)
    if not ordered:
        axis.text(0.5, 0.5, "no data", ha="center", va="center", transform=axis.transAxes)
    axis.set_xlabel(xlabel)
    axis.set_ylabel(ylabel)
    axis.set_title(f"{name} CDF")
    axis.grid(True, alpha=0.3)


def _throughput(axis: Axes, results: list[RequestResult]) -> None:
    """Output tokens per second over about 40 time bins, spreading each request's tokens over its stream (the first
    chunk at its TTFT, later ones after their inter-token gaps)."""
    axis.set_xlabel("time since start (s)")
    axis.set_ylabel("output tokens / s")
    axis.set_title(THROUGHPUT_TITLE)
    axis.grid(True, alpha=0.3)
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
        [index * bin_s for index in indices],
        [bins.get(index, 0.0) / bin_s for index in indices],
        label="output tokens / s",
    )


def _mark_request_rate(axis: Axes, request_rate: float, achieved_rate: float) -> None:
    """Horizontal lines at the configured and achieved request rates on a second y axis (requests / s) of the
    throughput panel, with one legend for both axes; the title names the configured rate."""
    rate_axis = axis.twinx()
    rate_axis.set_ylabel("requests / s")
    marked = [achieved_rate]
    if not math.isinf(request_rate):
        rate_axis.axhline(
            request_rate,
            color="tab:red",
            linestyle="--",
            label=f"{CONFIGURED_RATE_LABEL} ({request_rate:g} req/s)",
        )
        marked.append(request_rate)
    rate_axis.axhline(
        achieved_rate,
        color="tab:green",
        linestyle=":",
        label=f"{ACHIEVED_RATE_LABEL} ({achieved_rate:.2f} req/s)",
    )
    rate_axis.set_ylim(0, 1.25 * max(max(marked), 1e-9))
    axis.set_title(f"{THROUGHPUT_TITLE}, request rate {rate_text(request_rate)}")
    lines, labels = axis.get_legend_handles_labels()
    rate_lines, rate_labels = rate_axis.get_legend_handles_labels()
    axis.legend(lines + rate_lines, labels + rate_labels, loc="best", fontsize="small")
