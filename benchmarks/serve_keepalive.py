"""Client errors from kept-alive connections closed under new requests, with uvicorn's 5 s keep-alive (the baseline)
against kvflow's default, measured in the same run.

Each run starts a fresh `kvflow serve hash` (the engine costs ~nothing, so the HTTP layer is all there is) and sends
`--num-requests` streamed requests of two tokens at `--concurrency` through one httpx pool with keep-alive, as the
`openai` client does. httpx reuses a connection idle for up to 5 s; a server that closes idle connections after
exactly 5 s closes some just as a request is sent on them, and that request fails at the client (a ReadError, nothing
in the server log). Connections go idle together when the load dips, which a fresh server's first wave makes likely.

    python benchmarks/serve_keepalive.py --runs 6 --num-requests 1000 --concurrency 256

Prints one line per run and the totals per setting. Figures: benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

COMMAND = "python benchmarks/serve_keepalive.py"
SERVER_ARGS = [
    "hash",
    "--max-model-len",
    "1024",
    "--num-kv-blocks",
    "4096",
    "--max-num-seqs",
    "256",
]
_ADDRESS = re.compile(r"kvflow serve: model '.*' at (http://[\d.]+:\d+)")
STARTUP_TIMEOUT_S = 120.0


@contextlib.contextmanager
def served(timeout_keep_alive: float | None) -> Iterator[str]:
    """A fresh `kvflow serve hash` on a free port; yields its URL and stops it (SIGINT, then SIGKILL)."""
    script = shutil.which("kvflow", path=str(Path(sys.executable).parent))
    command = [script] if script else [sys.executable, "-m", "kvflow.entrypoints.cli"]
    command += ["serve", *SERVER_ARGS, "--port", "0"]
    if timeout_keep_alive is not None:
        command += ["--timeout-keep-alive", str(timeout_keep_alive)]
    with tempfile.NamedTemporaryFile(prefix="kvflow-keepalive-", suffix=".log") as log:
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            yield _wait_until_ready(process, Path(log.name))
        finally:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(30)


def _wait_until_ready(process: subprocess.Popen[bytes], log: Path) -> str:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"kvflow serve exited:\n{log.read_text()}")
        match = _ADDRESS.search(log.read_text())
        if match:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{match.group(1)}/health", timeout=5).status_code == 200:
                    return match.group(1)
        time.sleep(0.1)
    raise TimeoutError("kvflow serve was not ready")


async def load(url: str, num_requests: int, concurrency: int) -> tuple[list[str], float]:
    """(each client error, seconds) for `num_requests` streamed requests through one keep-alive pool."""
    errors: list[str] = []
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async def one(http: httpx.AsyncClient, index: int) -> None:
        body = {"prompt": [index % 500 + 1, 2], "max_tokens": 2, "ignore_eos": True, "stream": True}
        async with gate:
            try:
                async with http.stream("POST", "/v1/completions", json=body) as response:
                    lines = [line async for line in response.aiter_lines()]
                if response.status_code != 200 or "data: [DONE]" not in lines:
                    errors.append(f"request {index}: {response.status_code} {lines[-2:]}")
            except httpx.HTTPError as error:
                errors.append(f"request {index}: {error!r}")

    start = time.monotonic()
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
        await asyncio.gather(*(one(http, index) for index in range(num_requests)))
    return errors, time.monotonic() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=6, help="fresh servers per setting")
    parser.add_argument("--num-requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=256)
    args = parser.parse_args(argv)
    settings = {"uvicorn default (5 s)": 5.0, "kvflow default": None}
    totals = {name: [0, 0] for name in settings}
    print(f"# {COMMAND} --runs {args.runs} --num-requests {args.num_requests} "
          f"--concurrency {args.concurrency}")  # fmt: skip
    for run in range(args.runs):
        for (
            name,
            timeout_keep_alive,
        ) in settings.items():  # interleaved: same machine state for both
            with served(timeout_keep_alive) as url:
                errors, seconds = asyncio.run(load(url, args.num_requests, args.concurrency))
            totals[name][0] += len(errors)
            totals[name][1] += args.num_requests
            print(
                f"run {run}: {name:<22} {len(errors)} client errors in {args.num_requests} requests "
                f"({args.num_requests / seconds:.0f} req/s)",
                flush=True,
            )
    for name, (errors, requests) in totals.items():
        print(f"{name:<22} {errors} client errors in {requests} requests")


if __name__ == "__main__":
    main()
