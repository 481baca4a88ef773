"""The pieces of `kvflow bench serve` that need no server: prompts, request bodies, statistics, the table."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from kvflow.benchmarks.datasets import TOKEN_ID_RANGE, SampleRequest, random_requests
from kvflow.benchmarks.request import RequestResult, request_body
from kvflow.benchmarks.serve import format_table, summarize
from kvflow.tokenizer import load_tokenizer

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def test_random_requests_are_reproducible_and_within_the_ranges() -> None:
    first = random_requests(50, input_len=100, output_len=20, range_ratio=0.5, seed=7)
    assert first == random_requests(50, input_len=100, output_len=20, range_ratio=0.5, seed=7)
    assert first != random_requests(50, input_len=100, output_len=20, range_ratio=0.5, seed=8)
    for sample in first:
        assert isinstance(sample.prompt, list) and len(sample.prompt) == sample.prompt_len
        assert 50 <= sample.prompt_len <= 150 and 10 <= sample.expected_output_len <= 30
        assert all(TOKEN_ID_RANGE[0] <= token < TOKEN_ID_RANGE[1] for token in sample.prompt)
    fixed = random_requests(5, input_len=32, output_len=8, range_ratio=0.0, seed=0)
    assert {(sample.prompt_len, sample.expected_output_len) for sample in fixed} == {(32, 8)}
    with pytest.raises(ValueError, match="range-ratio"):
        random_requests(5, 32, 8, range_ratio=1.0, seed=0)


def test_text_prompts_measure_their_length_with_the_tokenizer() -> None:
    from kvflow.default_model import ensure_default_model

    tokenizer = load_tokenizer(ensure_default_model())
    samples = random_requests(
        10, input_len=64, output_len=8, range_ratio=0.0, seed=3, tokenizer=tokenizer
    )
    for sample in samples:
        assert isinstance(sample.prompt, str)
        assert sample.prompt_len == len(tokenizer.encode(sample.prompt))


def test_request_bodies_for_both_endpoints() -> None:
    ids = SampleRequest([5, 6, 7], 3, 4)
    body = request_body("/v1/completions", "m", ids, ignore_eos=True)
    assert body["prompt"] == [5, 6, 7] and body["max_tokens"] == 4 and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True} and body["return_token_ids"] is True
    text = SampleRequest("hello", 2, 4)
    chat = request_body("/v1/chat/completions", "m", text, ignore_eos=False)
    assert (
        chat["messages"] == [{"role": "user", "content": "hello"}]
        and "return_token_ids" not in chat
    )
    with pytest.raises(ValueError, match="--tokenizer"):
        request_body("/v1/chat/completions", "m", ids, ignore_eos=True)


def test_summary_statistics_and_the_table() -> None:
    results = [
        RequestResult(True, "", 10, 5, ttft=0.1, latency=0.5, itl=[0.1, 0.1, 0.1, 0.1]),
        RequestResult(True, "", 20, 3, ttft=0.3, latency=0.7, itl=[0.2, 0.2]),
        RequestResult(False, "HTTP 400: bad", 30, 0),
    ]
    summary = summarize(results, duration_s=2.0)
    assert (summary["completed"], summary["failed"]) == (2, 1)
    assert (summary["total_input_tokens"], summary["total_output_tokens"]) == (30, 8)
    assert summary["request_throughput"] == 1.0 and summary["output_throughput"] == 4.0
    assert summary["mean_ttft_ms"] == pytest.approx(200.0) and summary[
        "median_ttft_ms"
    ] == pytest.approx(200.0)
    assert summary["p99_ttft_ms"] == pytest.approx(
        298.0
    )  # linear interpolation between 100 and 300
    # TPOT: (0.5 - 0.1) / 4 = 0.1 and (0.7 - 0.3) / 2 = 0.2.
    assert summary["mean_tpot_ms"] == pytest.approx(150.0)
    assert summary["mean_itl_ms"] == pytest.approx(1000 * 0.8 / 6)
    assert summary["errors"] == ["HTTP 400: bad"]
    table = format_table(summary).splitlines()
    assert table[0] == "=" * 12 + " Serving Benchmark Result " + "=" * 12
    assert table[1].startswith("Successful requests:") and table[1].split()[-1] == "2"
    assert table[2].split()[-1] == "1" and table[-1] == "=" * 50
    for short in ("TTFT", "TPOT", "ITL", "E2EL"):
        assert any(line.startswith(f"P99 {short} (ms):") for line in table)


def rate_lines(figure: Figure) -> dict[str, list[float]]:
    """{legend label: y values} of the request-rate marks (horizontal lines) on any of the figure's axes."""
    from kvflow.benchmarks.plot import ACHIEVED_RATE_LABEL, CONFIGURED_RATE_LABEL

    return {
        line.get_label(): list(line.get_ydata())
        for axis in figure.axes
        for line in axis.lines
        if line.get_label().startswith((CONFIGURED_RATE_LABEL, ACHIEVED_RATE_LABEL))
    }


def test_plot_draws_tpot_and_e2e_latency_and_marks_the_request_rate(tmp_path: Path) -> None:
    """`--plot`'s figure: TTFT, TPOT, ITL and E2E latency CDFs of the successful requests (ms), and the configured
    and achieved request rates as horizontal lines on the throughput panel; `inf` has no configured line and says
    "all at once" instead, and a run without inter-token gaps has no ITL panel."""
    from kvflow.benchmarks.plot import plot_results

    results = [
        RequestResult(True, "", 10, 5, ttft=0.1, latency=0.5, itl=[0.1] * 4, start_time=10.0),
        RequestResult(True, "", 20, 3, ttft=0.3, latency=0.7, itl=[0.2] * 2, start_time=10.25),
        RequestResult(False, "HTTP 400: bad", 30, 0),
    ]
    path = tmp_path / "finite.png"
    figure = plot_results(path, results, "run", request_rate=4.0, achieved_rate=1.5)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    panels = {axis.get_title(): axis for axis in figure.axes if axis.get_title()}
    throughput_title = "Throughput over time, request rate 4 req/s"
    assert set(panels) == {
        "TTFT CDF",
        "TPOT CDF",
        "ITL CDF",
        "E2E latency CDF",
        throughput_title,
    }
    # TPOT per request: (0.5 - 0.1) / 4 and (0.7 - 0.3) / 2; E2E: the latencies; failed requests left out.
    [tpot_line] = panels["TPOT CDF"].lines
    assert list(tpot_line.get_xdata()) == pytest.approx([100.0, 200.0])
    assert list(tpot_line.get_ydata()) == [0.5, 1.0]
    [e2e_line] = panels["E2E latency CDF"].lines
    assert list(e2e_line.get_xdata()) == pytest.approx([500.0, 700.0])
    assert panels["E2E latency CDF"].get_ylabel() == "fraction of requests"
    assert rate_lines(figure) == {
        "configured request rate (4 req/s)": [4.0, 4.0],
        "achieved request rate (1.50 req/s)": [1.5, 1.5],
    }
    legend = [text.get_text() for text in panels[throughput_title].get_legend().get_texts()]
    assert legend == ["output tokens / s", *rate_lines(figure)]

    single_chunks = [
        RequestResult(True, "", 10, 1, ttft=0.2, latency=0.2, start_time=1.0),
        RequestResult(True, "", 10, 4, ttft=0.1, latency=0.4, start_time=1.0),
    ]
    figure = plot_results(
        tmp_path / "inf.png", single_chunks, "run", request_rate=float("inf"), achieved_rate=5.0
    )
    titles = {axis.get_title() for axis in figure.axes if axis.get_title()}
    assert titles == {
        "TTFT CDF",
        "TPOT CDF",
        "E2E latency CDF",
        "Throughput over time, request rate inf (all at once)",
    }
    assert rate_lines(figure) == {"achieved request rate (5.00 req/s)": [5.0, 5.0]}


def test_vllm_spellings_of_the_target_endpoint_and_dataset() -> None:
    """A `vllm bench serve` command line parses: --host/--port for --base-url, --backend for --endpoint,
    --dataset-name for --dataset; a backend contradicting the endpoint is refused naming both."""
    from kvflow.entrypoints.cli import build_parser
    from kvflow.entrypoints.cli.bench import resolve_target

    def parse(*flags: str):
        return build_parser().parse_args(["bench", "serve", *flags])

    args = parse(
        "--backend",
        "openai-chat",
        "--host",
        "10.0.0.2",
        "--port",
        "9000",
        "--dataset-name",
        "random",
    )
    assert resolve_target(args) == ("http://10.0.0.2:9000", "/v1/chat/completions")
    assert args.dataset == "random"
    assert resolve_target(parse("--backend", "vllm")) == (
        "http://127.0.0.1:8000",
        "/v1/completions",
    )
    assert resolve_target(parse("--base-url", "http://h:1")) == ("http://h:1", "/v1/completions")
    with pytest.raises(
        ValueError, match="--endpoint /v1/completions contradicts --backend openai-chat"
    ):
        resolve_target(parse("--backend", "openai-chat", "--endpoint", "/v1/completions"))


def test_random_prefix_len_shares_one_prefix_across_prompts() -> None:
    requests = random_requests(5, 8, 4, 0.0, seed=3, prefix_len=6)
    prefixes = {tuple(request.prompt[:6]) for request in requests}  # type: ignore[index]
    assert len(prefixes) == 1
    assert all(request.prompt_len == 14 and len(request.prompt) == 14 for request in requests)  # type: ignore[arg-type]
    assert len({tuple(request.prompt[6:]) for request in requests}) == 5  # type: ignore[index]
    assert random_requests(5, 8, 4, 0.0, seed=3) == random_requests(
        5, 8, 4, 0.0, seed=3, prefix_len=0
    )
    with pytest.raises(ValueError, match="--random-prefix-len"):
        random_requests(1, 8, 4, 0.0, seed=3, prefix_len=-1)
