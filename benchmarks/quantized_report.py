"""benchmarks/quantized.py's report: each format's figures as measured and the markdown table RESULTS.md records."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from benchmarks.quantized_checkpoint import Settings
from benchmarks.quantized_runs import BatchedResult, KvflowResult, LlamaBenchResult


# ------------------------------------------------------------------------------------------------ report
@dataclass
class FormatReport:
    """Every figure of one format; None where not measured, `kvflow_error` when kvflow failed."""

    fmt: str
    llama_cpp_file: str
    floor_bytes_per_token: int
    gguf_tensor_bytes: int | None
    kvflow: KvflowResult | None = None
    kvflow_error: str | None = None
    llama: LlamaBenchResult | None = None


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


def _cell(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def markdown_table(
    reports: list[FormatReport],
    bandwidth: float,
    prefill_len: int,
    output_len: int,
    batched: list[BatchedResult],
    batched_format: str,
) -> str:
    """The RESULTS.md table: one row per figure and format, kvflow beside llama.cpp, ratios in the same run."""
    lines = [
        "| figure | format | kvflow | llama.cpp | kvflow / llama.cpp | floor | kvflow / floor | llama.cpp / floor |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for report in reports:
        floor = bandwidth / report.floor_bytes_per_token
        kv_decode = report.kvflow.decode_tokens_per_s if report.kvflow else None
        ll_decode = report.llama.decode_tokens_per_s if report.llama else None
        label = (
            report.fmt
            if report.fmt == report.llama_cpp_file
            else f"{report.fmt} vs {report.llama_cpp_file}"
        )
        lines.append(
            f"| decode tg{output_len} tok/s | {label} | {_cell(kv_decode)} | {_cell(ll_decode)} | "
            f"{_cell(_ratio(kv_decode, ll_decode))} | {floor:.2f} | {_cell(_ratio(kv_decode, floor))} | "
            f"{_cell(_ratio(ll_decode, floor))} |"
        )
    for report in reports:
        per_op = report.kvflow.per_op_decode_tokens_per_s if report.kvflow else None
        if per_op is None:
            continue
        fused = report.kvflow.decode_tokens_per_s  # type: ignore[union-attr]
        lines.append(
            f"| decode tg{output_len} tok/s, fused layers vs per-op | {report.fmt} | {fused:.2f} | "
            f"{per_op:.2f} (kvflow per-op) | {_ratio(fused, per_op):.2f} | | | |"
        )
    for report in reports:
        ratios = report.kvflow.alternated_ratios if report.kvflow else []
        if not ratios:
            continue
        kv_rounds = [kvflow for kvflow, _ in report.kvflow.alternated]  # type: ignore[union-attr]
        ll_rounds = [llama for _, llama in report.kvflow.alternated]  # type: ignore[union-attr]
        lines.append(
            f"| decode tg{output_len} tok/s, {len(ratios)} alternated rounds (medians; ratio: median of rounds' "
            f"ratios, {min(ratios):.2f}-{max(ratios):.2f}) | {report.fmt} | {statistics.median(kv_rounds):.2f} | "
            f"{statistics.median(ll_rounds):.2f} | {statistics.median(ratios):.2f} | | | |"
        )
    for report in reports:
        kv_prefill = report.kvflow.prefill_tokens_per_s(prefill_len) if report.kvflow else None
        ll_prefill = report.llama.prefill_tokens_per_s if report.llama else None
        label = (
            report.fmt
            if report.fmt == report.llama_cpp_file
            else f"{report.fmt} vs {report.llama_cpp_file}"
        )
        lines.append(
            f"| prefill pp{prefill_len} tok/s | {label} | {_cell(kv_prefill, 1)} | {_cell(ll_prefill, 1)} | "
            f"{_cell(_ratio(kv_prefill, ll_prefill))} | | | |"
        )
    for report in reports:
        kv_bytes = report.kvflow.weight_bytes if report.kvflow else None
        file_bytes = report.gguf_tensor_bytes
        label = (
            report.fmt
            if report.fmt == report.llama_cpp_file
            else f"{report.fmt} vs {report.llama_cpp_file}"
        )
        lines.append(
            f"| weight GB (resident / file tensors) | {label} | "
            f"{_cell(None if kv_bytes is None else kv_bytes / 1e9, 3)} | "
            f"{_cell(None if file_bytes is None else file_bytes / 1e9, 3)} | "
            f"{_cell(_ratio(kv_bytes, file_bytes))} | | | |"
        )
    servers = [result for result in batched if result.name.startswith("llama-server")]
    best_server = max(servers, key=lambda result: result.output_tokens_per_s, default=None)
    best_tok_s = best_server.output_tokens_per_s if best_server else None
    for result in batched:
        if result in servers:
            continue
        lines.append(
            f"| batched out tok/s: {result.name} vs {best_server.name if best_server else 'llama-server'} | "
            f"{batched_format} | {result.output_tokens_per_s:.1f} | {_cell(best_tok_s, 1)} | "
            f"{_cell(_ratio(result.output_tokens_per_s, best_tok_s))} | | | |"
        )
    if not [result for result in batched if result not in servers] and best_server is not None:
        lines.append(
            f"| batched out tok/s: {best_server.name} | {batched_format} | - | {best_tok_s:.1f} | - | | | |"
        )
    return "\n".join(lines)


def print_format(report: FormatReport, bandwidth: float, settings: Settings) -> None:
    """One format's figures as soon as they are measured (the table at the end repeats them)."""
    floor = bandwidth / report.floor_bytes_per_token
    parts = [
        f"{report.fmt}: floor {floor:.2f} tok/s ({report.floor_bytes_per_token / 1e9:.3f} GB/token)"
    ]
    if report.kvflow is not None:
        kv = report.kvflow
        parts.append(
            f"kvflow decode {kv.decode_tokens_per_s:.2f} tok/s ({kv.decode_tokens_per_s / floor:.2f} of floor), "
            f"pp{settings.prefill_len} {kv.prefill_tokens_per_s(settings.prefill_len):.1f} tok/s, "
            f"weights {kv.weight_bytes / 1e9:.3f} GB ({kv.model_dtype})"
        )
    if report.llama is not None and report.llama.decode_tokens_per_s is not None:
        ll = report.llama
        parts.append(
            f"llama.cpp {report.llama_cpp_file} tg{settings.output_len} {ll.decode_tokens_per_s:.2f} tok/s "
            f"({ll.decode_tokens_per_s / floor:.2f} of floor), pp{settings.prefill_len} "
            f"{_cell(ll.prefill_tokens_per_s, 1)} tok/s  [{ll.command}]"
        )
    if report.kvflow is not None and report.kvflow.alternated:
        rounds = ", ".join(
            f"{kvflow:.2f}/{llama:.2f}" for kvflow, llama in report.kvflow.alternated
        )
        parts.append(
            f"alternated rounds kvflow/llama.cpp tok/s {rounds}: ratio median "
            f"{statistics.median(report.kvflow.alternated_ratios):.2f}"
        )
    print("; ".join(parts), flush=True)
