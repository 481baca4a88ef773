"""Scheduler overhead in steady decoding, with no model: CPU time per step and bytes sent to the worker per step.

Reproduce with `python benchmarks/scheduler_overhead.py` (`--quick` for a seconds-long smoke run).

What is measured
----------------
1. **CPU time per step.** A scheduler from `kvflow.testing.make_scheduler(max_num_seqs=N,
   max_num_batched_tokens=max(8192, N), block_size=16)` with enough KV blocks for every request holds N requests
   (`ignore_eos=True`, `max_tokens` larger than the run). It is stepped until every request is decoding (prefill
   done, one output token or more), then `--steps` steps are timed. Each step is `scheduler.schedule()` followed by
   `scheduler.update_from_output(output, ModelRunnerOutput(...))`, where the runner output gives token 7 to every
   scheduled request. Building the `ModelRunnerOutput` (the runner's job) is not timed. Each call is timed with
   `time.process_time_ns` (CPU time of this process, so other processes on a busy machine do not inflate it);
   the table reports the median and the mean per step, the median per request, and the ratio of the median step
   to the smallest size's next to the ratio of N.
   *Aim*: the cost of a step grows no faster than the number of scheduled requests, i.e. the per-request cost
   stays roughly flat from 64 to 1024 requests (step ratio <= N ratio).
   *Goal*: at most 4.3 us per running request (median step / N) at N = 256 and N = 1024; the `goal`
   column and the line under the table say whether each of those sizes meets it ("not measured" when a run
   leaves the size out). CPU time still grows when another process shares the core (caches, a busy sibling
   hyperthread), so check the goal on an otherwise idle machine.

2. **Serialized bytes per step.** For each runner protocol (slot runner, `use_v2_model_runner=True`, and
   persistent batch, `False`) and each history length (prompt length = history length; 100 and 4000 by default),
   `--bytes-requests` requests decode in steady state and each step's `SchedulerOutput` is encoded with
   `msgspec.msgpack.encode` (dataclasses encode natively, sets as arrays). The window is a whole number of KV
   blocks (a multiple of `block_size` steps), so every request crosses the same number of block boundaries at
   any history and the mean is comparable. Baseline in the same run: the bytes of `{req_id: full token list}`
   for the same scheduled requests at the same steps, i.e. what a protocol that resends every history would carry
   for the token lists alone (a lower bound for such a protocol).
   *Aim*: bytes per step and per request do not depend on history length (ratio ~1.0), while the full-list
   baseline grows with it.

Token ids in prompts are spread over a 32000-token vocabulary and differ per request, so there is no prefix
sharing and ids encode like real ones. Garbage is collected before each timed loop; the collector stays enabled.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from kvflow.core.sched.output import ModelRunnerOutput, SchedulerOutput
from kvflow.core.sched.scheduler import Scheduler
from kvflow.testing import make_request, make_scheduler
from kvflow.utils import cdiv

COMMAND = "python benchmarks/scheduler_overhead.py"
BLOCK_SIZE = 16
SAMPLED_TOKEN_ID = 7
VOCAB_SIZE = 32000
TIMING_PROMPT_LEN = 32
NUM_EXTRA_STEADY_STEPS = 2  # steps after the last prefill finishes, before measuring
MAX_WARMUP_STEPS = 100_000
GOAL_US_PER_REQUEST = 4.3  # goal: scheduler CPU per running request per decode step
GOAL_SIZES = (256, 1024)  # the numbers of running requests the goal is checked at


@dataclass(frozen=True)
class BenchmarkConfig:
    """What one run measures. `bytes_steps` is rounded up to a multiple of the block size when used."""

    sizes: tuple[int, ...] = (64, 256, 1024)
    steps: int = 300
    histories: tuple[int, ...] = (100, 4000)
    bytes_requests: int = 64
    bytes_steps: int = 64


QUICK_CONFIG = BenchmarkConfig(
    sizes=(16, 64), steps=20, histories=(100, 4000), bytes_requests=16, bytes_steps=32
)


@dataclass(frozen=True)
class StepTiming:
    """CPU time of `schedule()` + `update_from_output()` over `num_steps` steady decoding steps of N requests."""

    num_requests: int
    num_steps: int
    schedule_us_median: float
    update_us_median: float
    step_us_median: float
    step_us_mean: float

    @property
    def us_per_request(self) -> float:
        return self.step_us_median / self.num_requests

    @property
    def meets_goal(self) -> bool:
        return self.us_per_request <= GOAL_US_PER_REQUEST


@dataclass(frozen=True)
class MessageBytes:
    """Mean msgpack bytes per steady decoding step: the delta `SchedulerOutput` and the full-token-list baseline."""

    use_v2_model_runner: bool
    history_len: int
    num_requests: int
    num_steps: int
    delta_bytes_per_step: float
    delta_bytes_max: int
    full_list_bytes_per_step: float

    @property
    def protocol(self) -> str:
        return "slot" if self.use_v2_model_runner else "persistent"

    @property
    def delta_bytes_per_request(self) -> float:
        return self.delta_bytes_per_step / self.num_requests

    @property
    def full_list_bytes_per_request(self) -> float:
        return self.full_list_bytes_per_step / self.num_requests


@dataclass(frozen=True)
class BenchmarkReport:
    config: BenchmarkConfig
    timings: list[StepTiming]
    message_bytes: list[MessageBytes]


# ---------------------------------------------------------------------------------------------------- setup
def prompt_for(request_index: int, prompt_len: int) -> list[int]:
    """A prompt unique to the request (no prefix sharing), with ids spread over the vocabulary."""
    return [
        (request_index * 7919 + position * 104729 + 1) % VOCAB_SIZE
        for position in range(prompt_len)
    ]


def runner_output_for(scheduler: Scheduler, output: SchedulerOutput) -> ModelRunnerOutput:
    """One sampled token per scheduled request whose prefill is done (empty for a partial prefill)."""
    req_ids = list(output.num_scheduled_tokens)
    requests = scheduler.requests
    sampled = [
        [SAMPLED_TOKEN_ID]
        if requests[req_id].num_computed_tokens >= requests[req_id].num_tokens
        else []
        for req_id in req_ids
    ]
    return ModelRunnerOutput(
        req_ids, {req_id: index for index, req_id in enumerate(req_ids)}, sampled
    )


def step_once(scheduler: Scheduler) -> SchedulerOutput:
    output = scheduler.schedule()
    scheduler.update_from_output(output, runner_output_for(scheduler, output))
    return output


def is_steady(scheduler: Scheduler, num_requests: int) -> bool:
    """Every request runs and has sampled a token, so each step schedules exactly one token per request."""
    running = scheduler.running
    return (
        len(running) == num_requests
        and not scheduler.waiting
        and all(request.num_output_tokens > 0 for request in running)
    )


def decoding_scheduler(
    num_requests: int, prompt_len: int, num_decode_steps: int, use_v2_model_runner: bool = True
) -> Scheduler:
    """A scheduler with `num_requests` requests past prefill, able to decode `num_decode_steps` more steps."""
    max_tokens = num_decode_steps + NUM_EXTRA_STEADY_STEPS + 2 * BLOCK_SIZE
    max_model_len = prompt_len + max_tokens + BLOCK_SIZE
    blocks_per_request = cdiv(max_model_len, BLOCK_SIZE) + 1
    scheduler = make_scheduler(
        max_num_seqs=num_requests,
        max_num_batched_tokens=max(8192, num_requests),
        block_size=BLOCK_SIZE,
        num_blocks=num_requests * blocks_per_request + 16,
        max_model_len=max_model_len,
        use_v2_model_runner=use_v2_model_runner,
    )
    for request_index in range(num_requests):
        scheduler.add_request(
            make_request(
                str(request_index),
                prompt_for(request_index, prompt_len),
                max_tokens=max_tokens,
                ignore_eos=True,
            )
        )
    for _ in range(MAX_WARMUP_STEPS):
        if is_steady(scheduler, num_requests):
            break
        step_once(scheduler)
    else:
        raise RuntimeError(f"{num_requests} requests did not reach steady decoding")
    for _ in range(NUM_EXTRA_STEADY_STEPS):
        step_once(scheduler)
    return scheduler


def check_steady_output(output: SchedulerOutput, num_requests: int) -> None:
    """Fail loudly if a measured step is not pure steady decoding (the numbers would mean something else)."""
    if (
        len(output.num_scheduled_tokens) != num_requests
        or output.total_num_scheduled_tokens != num_requests
        or output.scheduled_new_reqs
        or output.finished_req_ids
        or output.preempted_req_ids
    ):
        raise RuntimeError(
            f"step is not steady decoding of {num_requests} requests: "
            f"{len(output.num_scheduled_tokens)} scheduled, {output.total_num_scheduled_tokens} "
            f"tokens, {len(output.scheduled_new_reqs)} new, {len(output.finished_req_ids)} finished, "
            f"{len(output.preempted_req_ids)} preempted"
        )


# ---------------------------------------------------------------------------------------------------- measure
def measure_step_time(num_requests: int, num_steps: int) -> StepTiming:
    """Median / mean CPU time of schedule() and update_from_output() over `num_steps` steady decoding steps."""
    scheduler = decoding_scheduler(num_requests, TIMING_PROMPT_LEN, num_steps)
    schedule_ns: list[int] = []
    update_ns: list[int] = []
    gc.collect()
    for _ in range(num_steps):
        start = time.process_time_ns()
        output = scheduler.schedule()
        scheduled = time.process_time_ns()
        runner_output = runner_output_for(scheduler, output)
        update_start = time.process_time_ns()
        scheduler.update_from_output(output, runner_output)
        end = time.process_time_ns()
        check_steady_output(output, num_requests)
        schedule_ns.append(scheduled - start)
        update_ns.append(end - update_start)
    step_ns = [schedule + update for schedule, update in zip(schedule_ns, update_ns, strict=True)]
    return StepTiming(
        num_requests=num_requests,
        num_steps=num_steps,
        schedule_us_median=statistics.median(schedule_ns) / 1e3,
        update_us_median=statistics.median(update_ns) / 1e3,
        step_us_median=statistics.median(step_ns) / 1e3,
        step_us_mean=statistics.fmean(step_ns) / 1e3,
    )


def whole_blocks(num_steps: int) -> int:
    return max(1, cdiv(num_steps, BLOCK_SIZE)) * BLOCK_SIZE


def measure_message_bytes(
    num_requests: int, history_len: int, num_steps: int, use_v2_model_runner: bool
) -> MessageBytes:
    """Mean encoded size of the steady-decoding SchedulerOutput vs. encoding every request's full token list."""
    num_steps = whole_blocks(num_steps)
    scheduler = decoding_scheduler(num_requests, history_len, num_steps, use_v2_model_runner)
    encoder = msgspec.msgpack.Encoder()
    delta_sizes: list[int] = []
    full_list_sizes: list[int] = []
    for _ in range(num_steps):
        output = scheduler.schedule()
        check_steady_output(output, num_requests)
        delta_sizes.append(len(encoder.encode(output)))
        full_lists = {
            req_id: scheduler.requests[req_id].all_token_ids.copy()
            for req_id in output.num_scheduled_tokens
        }
        full_list_sizes.append(len(encoder.encode(full_lists)))
        scheduler.update_from_output(output, runner_output_for(scheduler, output))
    return MessageBytes(
        use_v2_model_runner=use_v2_model_runner,
        history_len=history_len,
        num_requests=num_requests,
        num_steps=num_steps,
        delta_bytes_per_step=statistics.fmean(delta_sizes),
        delta_bytes_max=max(delta_sizes),
        full_list_bytes_per_step=statistics.fmean(full_list_sizes),
    )


def run_benchmark(config: BenchmarkConfig) -> BenchmarkReport:
    timings = [measure_step_time(num_requests, config.steps) for num_requests in config.sizes]
    message_bytes = [
        measure_message_bytes(config.bytes_requests, history_len, config.bytes_steps, use_v2)
        for use_v2 in (True, False)
        for history_len in config.histories
    ]
    return BenchmarkReport(config=config, timings=timings, message_bytes=message_bytes)


# ---------------------------------------------------------------------------------------------------- report
def format_timing_table(timings: Sequence[StepTiming]) -> list[str]:
    baseline = min(timings, key=lambda timing: timing.num_requests)
    lines = [
        f"1. CPU time per steady decoding step: schedule() + update_from_output() "
        f"(median and mean over the timed steps; ratios vs N={baseline.num_requests})",
        f"{'N reqs':>7} {'steps':>6} {'sched us':>10} {'update us':>10} {'step us':>10} {'mean us':>10} "
        f"{'us/req':>8} {'step ratio':>11} {'N ratio':>8} {'goal':>6}",
    ]
    for timing in timings:
        goal = _goal_word(timing) if timing.num_requests in GOAL_SIZES else "-"
        lines.append(
            f"{timing.num_requests:>7} {timing.num_steps:>6} {timing.schedule_us_median:>10.1f} "
            f"{timing.update_us_median:>10.1f} {timing.step_us_median:>10.1f} {timing.step_us_mean:>10.1f} "
            f"{timing.us_per_request:>8.2f} {timing.step_us_median / baseline.step_us_median:>11.2f} "
            f"{timing.num_requests / baseline.num_requests:>8.2f} {goal:>6}"
        )
    lines.append("   aim: step ratio <= N ratio (per-request cost roughly flat)")
    lines.append(format_goal_line(timings))
    return lines


def _goal_word(timing: StepTiming) -> str:
    return "met" if timing.meets_goal else "MISSED"


def format_goal_line(timings: Sequence[StepTiming]) -> str:
    """Whether each goal size meets GOAL_US_PER_REQUEST, with its us/req ("not measured" if absent)."""
    by_size = {timing.num_requests: timing for timing in timings}
    verdicts = []
    for size in GOAL_SIZES:
        timing = by_size.get(size)
        if timing is None:
            verdicts.append(f"N={size}: not measured")
        else:
            verdicts.append(f"N={size}: {timing.us_per_request:.2f} us/req, {_goal_word(timing)}")
    sizes = " and ".join(f"N={size}" for size in GOAL_SIZES)
    return f"   goal: <= {GOAL_US_PER_REQUEST} us/req at {sizes} -- {'; '.join(verdicts)}"


def format_bytes_table(message_bytes: Sequence[MessageBytes]) -> list[str]:
    lines = [
        "2. msgpack bytes per steady decoding step: delta SchedulerOutput vs. full token lists of the same requests "
        "(mean over whole blocks of steps)",
        f"{'protocol':<11} {'history':>7} {'reqs':>5} {'steps':>5} {'delta B/step':>12} {'max B':>7} "
        f"{'delta B/req':>11} {'vs first':>8} {'full B/step':>12} {'full B/req':>10} {'full/delta':>10}",
    ]
    for use_v2 in (True, False):
        rows = [row for row in message_bytes if row.use_v2_model_runner == use_v2]
        if not rows:
            continue
        first = rows[0]
        for row in rows:
            lines.append(
                f"{row.protocol:<11} {row.history_len:>7} {row.num_requests:>5} {row.num_steps:>5} "
                f"{row.delta_bytes_per_step:>12.1f} {row.delta_bytes_max:>7} {row.delta_bytes_per_request:>11.2f} "
                f"{row.delta_bytes_per_step / first.delta_bytes_per_step:>8.3f} "
                f"{row.full_list_bytes_per_step:>12.1f} {row.full_list_bytes_per_request:>10.1f} "
                f"{row.full_list_bytes_per_step / row.delta_bytes_per_step:>10.1f}"
            )
    lines.append(
        "   aim: delta bytes flat across histories ('vs first' ~1.0); "
        "the full-list baseline grows with history"
    )
    lines.append(
        "   protocols: slot = use_v2_model_runner=True, persistent = use_v2_model_runner=False"
    )
    return lines


def format_report(report: BenchmarkReport, argv: Sequence[str] = ()) -> str:
    command = " ".join([COMMAND, *(shlex.quote(arg) for arg in argv)])
    lines = [
        f"kvflow scheduler overhead (no model) -- reproduce with: {command}",
        f"python {platform.python_version()}, {platform.machine()}, {os.cpu_count()} CPUs, "
        f"block_size={BLOCK_SIZE}",
        "",
        *format_timing_table(report.timings),
        "",
        *format_bytes_table(report.message_bytes),
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------- cli
def parse_sizes(text: str) -> tuple[int, ...]:
    values = tuple(int(part) for part in text.split(",") if part.strip())
    if not values or any(value < 1 for value in values):
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated list of positive ints, got {text!r}"
        )
    return values


def build_config(args: argparse.Namespace) -> BenchmarkConfig:
    base = QUICK_CONFIG if args.quick else BenchmarkConfig()
    return BenchmarkConfig(
        sizes=args.sizes if args.sizes is not None else base.sizes,
        steps=args.steps if args.steps is not None else base.steps,
        histories=args.histories if args.histories is not None else base.histories,
        bytes_requests=args.bytes_requests
        if args.bytes_requests is not None
        else base.bytes_requests,
        bytes_steps=args.bytes_steps if args.bytes_steps is not None else base.bytes_steps,
    )


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help=f"timed decoding steps per size (default {BenchmarkConfig.steps})",
    )
    parser.add_argument(
        "--sizes",
        type=parse_sizes,
        default=None,
        help="comma-separated numbers of running decode requests (default 64,256,1024)",
    )
    parser.add_argument(
        "--histories",
        type=parse_sizes,
        default=None,
        help="comma-separated history (prompt) lengths for the bytes table (default 100,4000)",
    )
    parser.add_argument(
        "--bytes-requests",
        type=int,
        default=None,
        help=f"requests in the bytes measurement (default {BenchmarkConfig.bytes_requests})",
    )
    parser.add_argument(
        "--bytes-steps",
        type=int,
        default=None,
        help=f"steps in the bytes measurement, rounded up to a multiple of {BLOCK_SIZE} "
        f"(default {BenchmarkConfig.bytes_steps})",
    )
    parser.add_argument(
        "--quick", action="store_true", help="few steps and small sizes (a few seconds)"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    args = make_parser().parse_args(args_list)
    config = build_config(args)
    if config.steps < 1 or config.bytes_steps < 1 or config.bytes_requests < 1:
        raise SystemExit("--steps, --bytes-steps and --bytes-requests must be >= 1")
    report = run_benchmark(config)
    print(format_report(report, args_list))
    return 0


if __name__ == "__main__":
    sys.exit(main())
