"""benchmarks/spec_decode.py's analysis and report: ratios, step costs, the rows of each table, the goals, and their
printed tables."""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from benchmarks.spec_decode_runs import EngineSpec, Series, StepRecord


# ------------------------------------------------------------------------------------------------ analysis
def median_ratio(series: Series, baseline: Series) -> float:
    """The median over measurements of each one's value / the baseline's (same prompt, same round, seconds
    apart)."""
    return statistics.median(a / b for a, b in zip(series.values, baseline.values, strict=True))


@dataclass
class StepCost:
    """Median wall time of a kind of step and of its parts, in seconds, over `count` steps."""

    count: int
    step_s: float
    forward_s: float
    sample_s: float
    propose_s: float
    other_s: float

    @classmethod
    def of(cls, records: Sequence[StepRecord]) -> StepCost | None:
        if not records:
            return None

        def median(attribute: str) -> float:
            return statistics.median(getattr(record, attribute) for record in records)

        parts = ("step_s", "forward_s", "sample_s", "propose_s", "other_s")
        return cls(len(records), *(median(part) for part in parts))


def plain_decode_steps(records: Sequence[StepRecord]) -> list[StepRecord]:
    return [record for record in records if record.num_tokens == 1]


def verify_steps(records: Sequence[StepRecord], k: int) -> list[StepRecord]:
    """Single-stream steps verifying a full draft of k tokens."""
    return [
        record for record in records if record.num_draft_tokens == k and record.num_tokens == k + 1
    ]


@dataclass
class SingleStreamRow:
    """One engine on one workload of one model."""

    model: str
    workload: str
    engine: str
    k: int | None
    tokens_per_s: float
    vs_sync: float
    vs_async: float
    mean_acceptance_length: float | None = None
    acceptance_rate: float | None = None
    drafted_step_share: float | None = None  # decode steps that verified a draft / all decode steps
    # Plain: its decode step; speculative: a full-draft verification step.
    step_ms: float | None = None
    ideal_speedup: float | None = None
    measured_over_ideal: float | None = None
    # The ideal at the observed share d of drafted steps (the others cost and yield a plain step's):
    # (d L + 1 - d) / (d c_k / c_1 + 1 - d). Info only: it tells a slow verification from a slow engine.
    ideal_at_draft_share: float | None = None


def single_stream_rows(
    model: str, series: dict[str, dict[str, Series]], specs: Sequence[EngineSpec]
) -> list[SingleStreamRow]:
    rows = []
    for workload, by_engine in series.items():
        sync, asynchronous = by_engine["sync"], by_engine["async"]
        plain_cost = StepCost.of(plain_decode_steps(sync.records))
        for spec in specs:
            one = by_engine[spec.name]
            row = SingleStreamRow(
                model,
                workload,
                spec.name,
                spec.k,
                one.median,
                median_ratio(one, sync),
                median_ratio(one, asynchronous),
            )
            if spec.name == "sync" and plain_cost is not None:
                row.step_ms = 1e3 * plain_cost.step_s
            if spec.k is not None:
                verify_cost = StepCost.of(verify_steps(one.records, spec.k))
                row.mean_acceptance_length = one.mean_acceptance_length
                row.acceptance_rate = one.acceptance_rate
                decode_records = [
                    record for record in one.records if record.num_tokens <= spec.k + 1
                ]
                if decode_records:
                    drafted = sum(1 for record in decode_records if record.num_draft_tokens)
                    row.drafted_step_share = drafted / len(decode_records)
                if verify_cost is not None and plain_cost is not None and one.drafts:
                    row.step_ms = 1e3 * verify_cost.step_s
                    assert row.mean_acceptance_length is not None
                    row.ideal_speedup = (
                        row.mean_acceptance_length * plain_cost.step_s / verify_cost.step_s
                    )
                    row.measured_over_ideal = row.vs_sync / row.ideal_speedup
                    if row.drafted_step_share is not None:
                        share = row.drafted_step_share
                        row.ideal_at_draft_share = (
                            share * row.mean_acceptance_length + 1 - share
                        ) / (share * verify_cost.step_s / plain_cost.step_s + 1 - share)
            rows.append(row)
    return rows


def step_breakdown(
    series: dict[str, dict[str, Series]], specs: Sequence[EngineSpec]
) -> dict[str, StepCost | None]:
    """Per engine, over all its workloads: the plain decode step ("sync") and full-draft verification steps."""
    breakdown: dict[str, StepCost | None] = {}
    for spec in specs:
        if spec.async_scheduling:
            continue
        records = [
            record for by_engine in series.values() for record in by_engine[spec.name].records
        ]
        if spec.k is None:
            breakdown[spec.name] = StepCost.of(plain_decode_steps(records))
        else:
            breakdown[spec.name] = StepCost.of(verify_steps(records, spec.k))
    return breakdown


@dataclass
class BatchRow:
    """One engine at batch 64; the step figures need a probe (synchronous engines), else None."""

    engine: str
    k: int | None
    tokens_per_s: float
    vs_sync: float
    vs_async: float
    mean_acceptance_length: float | None
    acceptance_rate: float | None
    drafts_per_step: float | None  # requests verifying a draft per step (of up to the batch size)
    tokens_per_step: float | None  # scheduled tokens per step, mean (prefill chunks included)
    step_ms: float | None  # median step
    forward_ms: float | None  # median model forward of a step


def batch_rows(series: dict[str, Series], specs: Sequence[EngineSpec]) -> list[BatchRow]:
    rows = []
    for spec in specs:
        one = series[spec.name]
        drafts_per_step = one.drafts / len(one.records) if one.records and spec.k else None
        records = one.records
        tokens = statistics.mean(r.num_tokens for r in records) if records else None
        cost = StepCost.of(records)
        rows.append(
            BatchRow(
                spec.name,
                spec.k,
                one.median,
                median_ratio(one, series["sync"]),
                median_ratio(one, series["async"]),
                one.mean_acceptance_length,
                one.acceptance_rate,
                drafts_per_step,
                tokens,
                None if cost is None else 1e3 * cost.step_s,
                None if cost is None else 1e3 * cost.forward_s,
            )
        )
    return rows


# ------------------------------------------------------------------------------------------------ goals
@dataclass
class Goal:
    """One row of the goals table; `measured` None when it could not be measured (SKIP)."""

    name: str
    measured: float | None
    comparison: str  # ">=" or "<="
    target: float

    @property
    def status(self) -> str:
        if self.measured is None:
            return "SKIP"
        if self.comparison == ">=":
            return "PASS" if self.measured >= self.target else "MISS"
        return "PASS" if self.measured <= self.target else "MISS"


def goals_for(
    single: Sequence[SingleStreamRow], batch: Sequence[BatchRow], models: Sequence[str]
) -> list[Goal]:
    goals = []
    for model in models:
        repeat = [
            row for row in single if row.model == model and row.workload == "repeat" and row.k
        ]
        best = max(repeat, key=lambda row: row.vs_sync)
        goals.append(Goal(f"{model}: repeat tok/s, {best.engine} / sync", best.vs_sync, ">=", 1.5))
        best_async = max(repeat, key=lambda row: row.vs_async)
        goals.append(
            Goal(
                f"{model}: repeat tok/s, {best_async.engine} / async",
                best_async.vs_async,
                ">=",
                1.5,
            )
        )
    for model in models:
        rated = [
            row
            for row in single
            if row.model == model and row.k and row.measured_over_ideal is not None
        ]
        worst = min(rated, key=lambda row: row.measured_over_ideal or 0.0, default=None)
        name = f"{model}: measured/ideal"
        if worst is not None:
            name += f", worst ({worst.workload} {worst.engine})"
        goals.append(Goal(name, None if worst is None else worst.measured_over_ideal, ">=", 0.8))
    for row in batch:
        if row.k is not None:
            goals.append(Goal(f"batch cost vs sync, {row.engine}", 1.0 - row.vs_sync, "<=", 0.05))
            goals.append(Goal(f"batch cost vs async, {row.engine}", 1.0 - row.vs_async, "<=", 0.05))
    return goals


# ------------------------------------------------------------------------------------------------ report
def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _engine_width(names: Iterable[str]) -> int:
    return max(len(name) for name in names) + 2


def format_single_stream(rows: Sequence[SingleStreamRow]) -> str:
    width = _engine_width(row.engine for row in rows)
    header = (
        f"{'model':<11}{'workload':<9}{'engine':<{width}}{'tok/s':>8}{'/sync':>7}{'/async':>7}{'acc len':>8}"
        f"{'acc %':>7}{'drafted':>8}{'step ms':>8}{'ideal':>7}{'meas/ideal':>11}{'ideal@d':>8}"
    )
    lines = [header]
    for row in rows:
        rate = None if row.acceptance_rate is None else 100 * row.acceptance_rate
        share = None if row.drafted_step_share is None else 100 * row.drafted_step_share
        lines.append(
            f"{row.model:<11}{row.workload:<9}{row.engine:<{width}}{row.tokens_per_s:>8.1f}{row.vs_sync:>7.3f}"
            f"{row.vs_async:>7.3f}{_fmt(row.mean_acceptance_length, '.2f'):>8}{_fmt(rate, '.1f'):>7}"
            f"{_fmt(share, '.0f'):>7}%{_fmt(row.step_ms, '.2f'):>8}{_fmt(row.ideal_speedup, '.2f'):>7}"
            f"{_fmt(row.measured_over_ideal, '.3f'):>11}{_fmt(row.ideal_at_draft_share, '.2f'):>8}"
        )
    return "\n".join(lines)


def format_breakdown(
    model: str,
    breakdown: dict[str, StepCost | None],
    linear_s: dict[int, float],
    specs: Sequence[EngineSpec],
) -> str:
    """The median step and its parts, then how much the forward pass and the linear layers alone grow from 1
    token to 1 + k (`linear_s`: `measure_linear_layers`)."""
    width = _engine_width(breakdown)
    lines = [
        f"{model}: median ms per step (sync: 1-token steps, ngram: k-draft verification); "
        "x = (1 + k tokens) / 1 token",
        f"  {'engine':<{width}}{'steps':>7}{'step':>8}{'forward':>9}{'sample':>8}{'propose':>9}{'other':>8}"
        f"{'fwd x':>7}{'linear ms':>10}{'linear x':>9}",
    ]
    plain = breakdown.get("sync")
    k_of = {spec.name: spec.k or 0 for spec in specs}
    for name, cost in breakdown.items():
        rows = 1 + k_of[name]
        linear = linear_s.get(rows)
        linear_x = None if linear is None or 1 not in linear_s else linear / linear_s[1]
        linear_text = (
            f"{_fmt(None if linear is None else 1e3 * linear, '.2f'):>10}{_fmt(linear_x, '.2f'):>9}"
        )
        if cost is None:
            lines.append(f"  {name:<{width}}{0:>7}{'-':>8}{'':>34}{'-':>7}{linear_text}")
            continue
        forward_x = None if plain is None else cost.forward_s / plain.forward_s
        lines.append(
            f"  {name:<{width}}{cost.count:>7}{1e3 * cost.step_s:>8.2f}{1e3 * cost.forward_s:>9.2f}"
            f"{1e3 * cost.sample_s:>8.2f}{1e3 * cost.propose_s:>9.3f}{1e3 * cost.other_s:>8.2f}"
            f"{_fmt(forward_x, '.2f'):>7}{linear_text}"
        )
    return "\n".join(lines)


def format_batch(rows: Sequence[BatchRow]) -> str:
    width = _engine_width(row.engine for row in rows)
    lines = [
        f"{'engine':<{width}}{'tok/s':>9}{'/sync':>7}{'/async':>7}{'acc len':>8}{'acc %':>7}{'drafts/step':>12}"
        f"{'tokens/step':>12}{'step ms':>8}{'fwd ms':>8}"
    ]
    for row in rows:
        rate = None if row.acceptance_rate is None else 100 * row.acceptance_rate
        lines.append(
            f"{row.engine:<{width}}{row.tokens_per_s:>9.1f}{row.vs_sync:>7.3f}{row.vs_async:>7.3f}"
            f"{_fmt(row.mean_acceptance_length, '.2f'):>8}{_fmt(rate, '.1f'):>7}"
            f"{_fmt(row.drafts_per_step, '.1f'):>12}{_fmt(row.tokens_per_step, '.1f'):>12}"
            f"{_fmt(row.step_ms, '.2f'):>8}{_fmt(row.forward_ms, '.2f'):>8}"
        )
    return "\n".join(lines)


def format_goals(goals: Sequence[Goal]) -> str:
    lines = [f"{'goal':<56}{'measured':>10}{'target':>9}  status"]
    for goal in goals:
        lines.append(
            f"{goal.name:<56}{_fmt(goal.measured, '.3f'):>10}{goal.comparison + ' ' + format(goal.target, 'g'):>9}"
            f"  {goal.status}"
        )
    return "\n".join(lines)
