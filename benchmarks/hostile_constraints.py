"""Constraint compiles beside a hostile client (`python benchmarks/structured_outputs.py --hostile`).

One `kvflow serve` on the built-in default model. The measured load: `--num-requests` plain completions and as many
with a small constraint (a regex), `--concurrency` at a time, each `--max-tokens` tokens. It runs twice, alternating
for `--rounds`: alone (baseline) and beside a hostile client that keeps sending the worst constraints it can, each
on its own connection:
  * 100,000 choices, and a regex and an EBNF grammar of 20,000 alternatives (past the default compile limits:
    refused before anything is queued);
  * constraints just inside the limits (4,096 distinct choices, a 4,096-alternative regex) sent with a client timeout
    of 0.2 s, so the client is gone while they compile (aborted compiles).
Reported per mode: p50 / p99 latency of the small-constraint and plain requests, the ratio hostile / alone of the
small-constraint p99 (the issue's bound: 1.5), how the hostile requests were answered, and the engine core's RSS
growth over the whole run (bound: 100 MB).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import statistics
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.serving import running_server, server_processes

SMALL_REGEX = r"(yes|no), because [a-z]{2,6}\."


def _hostile_bodies() -> list[tuple[str, dict[str, Any], float | None]]:
    """(what, completion body fields, client timeout or None) of each hostile request, in the order sent."""
    many = [f"choice number {i}" for i in range(100_000)]
    alternatives = "|".join(f"alt{i}x" for i in range(20_000))
    grammar = "root ::= " + " | ".join(f'"g{i}z"' for i in range(20_000))
    near_choices = [f"c{i}y" for i in range(4_096)]
    near_regex = "(" + "|".join(f"r{i}q" for i in range(4_095)) + ")"
    return [
        ("100k choices", {"structured_outputs": {"choice": many}}, None),
        ("20k-alternative regex", {"structured_outputs": {"regex": alternatives}}, None),
        ("20k-alternative grammar", {"structured_outputs": {"grammar": grammar}}, None),
        (
            "4096 choices, client gone at 0.2 s",
            {"structured_outputs": {"choice": near_choices}},
            0.2,
        ),
        (
            "4095-alternative regex, client gone at 0.2 s",
            {"structured_outputs": {"regex": near_regex}},
            0.2,
        ),
    ]


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def _timed(http: httpx.AsyncClient, body: dict[str, Any]) -> float:
    started = time.perf_counter()
    response = await http.post("/v1/completions", json=body)
    response.raise_for_status()
    return time.perf_counter() - started


async def _measured_load(base_url: str, args: argparse.Namespace) -> dict[str, list[float]]:
    """Latencies (s) of the plain and small-constraint requests, interleaved, `concurrency` in flight."""
    base = {"model": args.model, "max_tokens": args.max_tokens, "temperature": 0}
    bodies = []
    for i in range(args.num_requests):
        bodies.append(
            ("plain", {**base, "prompt": f"Request {i}: the weather is", "ignore_eos": True})
        )
        constraint = {"structured_outputs": {"regex": SMALL_REGEX}}
        bodies.append(("small", {**base, "prompt": f"Request {i}: is it raining?", **constraint}))
    latencies: dict[str, list[float]] = {"plain": [], "small": []}
    gate = asyncio.Semaphore(args.concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as http:

        async def one(kind: str, body: dict[str, Any]) -> None:
            async with gate:
                latencies[kind].append(await _timed(http, body))

        await asyncio.gather(*(one(kind, body) for kind, body in bodies))
    return latencies


def _hostile_client(
    base_url: str, model: str, kinds: list[int] | None, stop: Any, outcomes: Any
) -> None:
    """Send the hostile bodies in a loop until `stop` is set; per body, how it was answered (status code or
    "gone"), into the shared dict `outcomes`. Runs in a process of its own, as a client on another machine would
    (here it still shares the 2 cores), with one connection, re-opened after each client timeout. Each body is
    encoded once, with a marker that a counter replaces per request (a new constraint each time: no compile cache
    hit), so this client spends little CPU."""
    encoded = []
    for index, (what, fields, timeout) in enumerate(_hostile_bodies()):
        if kinds is not None and index not in kinds:
            continue
        constraint = fields["structured_outputs"]
        if "choice" in constraint:
            constraint["choice"][0] += " SALT"
        else:
            key = next(iter(constraint))
            constraint[key] = (
                "SALT" + constraint[key] if key == "regex" else constraint[key] + ' | "SALT"'
            )
        body = {"model": model, "prompt": "Pick one:", "max_tokens": 8, **fields}
        encoded.append((what, json.dumps(body).encode(), timeout))
    counts: dict[str, dict[str, int]] = {}
    salt = 0
    headers = {"Content-Type": "application/json"}
    with httpx.Client(base_url=base_url) as http:
        while not stop.is_set():
            for what, template, timeout in encoded:
                if stop.is_set():
                    break
                salt += 1
                content = template.replace(b"SALT", f"s{salt}".encode(), 1)
                try:
                    response = http.post(
                        "/v1/completions", content=content, headers=headers, timeout=timeout or 600
                    )
                    status = str(response.status_code)
                except httpx.TimeoutException:
                    status = "gone"
                per_body = counts.setdefault(what, {})
                per_body[status] = per_body.get(status, 0) + 1
    outcomes.update(counts)


async def _round(base_url: str, args: argparse.Namespace, hostile: bool) -> dict[str, Any]:
    context = multiprocessing.get_context("spawn")
    with context.Manager() as manager:
        stop, outcomes = manager.Event(), manager.dict()
        attacker = None
        if hostile:
            attacker = context.Process(
                target=_hostile_client,
                args=(base_url, args.model, args.hostile_kinds, stop, outcomes),
                daemon=True,
            )
            attacker.start()
        try:
            latencies = await _measured_load(base_url, args)
        finally:
            stop.set()
            if attacker is not None:
                attacker.join(timeout=600)
        return {"latencies": latencies, "hostile_outcomes": dict(outcomes)}


def _percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def run(args: argparse.Namespace) -> dict[str, Any]:
    with running_server([], ["--host", "127.0.0.1"]) as (base_url, pid):
        args.model = httpx.get(base_url + "/v1/models").json()["data"][0]["id"]
        [engine_pid] = server_processes(pid)[1]
        rss_start = _rss_mb(engine_pid)
        asyncio.run(
            _measured_load(base_url, argparse.Namespace(**{**vars(args), "num_requests": 4}))
        )
        results: dict[str, list[dict[str, Any]]] = {"alone": [], "hostile": []}
        for _ in range(args.rounds):
            for mode in ("alone", "hostile"):
                results[mode].append(asyncio.run(_round(base_url, args, mode == "hostile")))
        rss_end = _rss_mb(engine_pid)
    summary: dict[str, Any] = {"engine_rss_mb": [round(rss_start), round(rss_end)]}
    for mode, rounds in results.items():
        for kind in ("small", "plain"):
            p99s = [_percentile(r["latencies"][kind], 0.99) for r in rounds]
            p50s = [statistics.median(r["latencies"][kind]) for r in rounds]
            summary[f"{mode}_{kind}_p99_s"] = [round(value, 3) for value in p99s]
            summary[f"{mode}_{kind}_p50_s"] = [round(value, 3) for value in p50s]
    summary["hostile_outcomes"] = [r["hostile_outcomes"] for r in results["hostile"]]
    summary["small_p99_ratio"] = statistics.median(
        hostile / alone
        for hostile, alone in zip(
            summary["hostile_small_p99_s"], summary["alone_small_p99_s"], strict=True
        )
    )
    summary["engine_rss_growth_mb"] = round(rss_end - rss_start, 1)
    return summary


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-requests", type=int, default=100)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument(
        "--hostile-kinds",
        type=lambda text: [int(index) for index in text.split(",")],
        default=None,
        help="send only these hostile bodies (0-based indices into the list above, comma-separated)",
    )
    args = parser.parse_args(argv)
    summary = run(args)
    print(json.dumps(summary, indent=1))
    print(
        f"small-constraint p99 hostile / alone: {summary['small_p99_ratio']:.2f} (bound 1.5); engine RSS "
        f"growth {summary['engine_rss_growth_mb']} MB (bound 100)",
        flush=True,
    )
    return summary
