"""`kvflow serve` as a command: its flags, its one-line startup errors, its logs, and a clean stop on SIGINT and
SIGTERM (status 0, no traceback, streams in flight ended, no process left behind)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest

from kvflow.entrypoints.cli import build_parser
from kvflow.utils import OPENMP_WAIT_ENV
from tests.entrypoints.server import (
    HASH_SERVER,
    child_pids,
    kvflow_command,
    running_server,
    sse_payloads,
)


def run_serve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*kvflow_command(), "serve", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_serve_takes_the_server_flags_and_every_engine_option() -> None:
    server_flags = [
        "--port",
        "0",
        "--api-key",
        "k",
        "--served-model-name",
        "m",
        "--enable-admin-endpoints",
        "--chat-template",
        "served.jinja",
    ]
    engine_flags = [
        "--max-num-seqs",
        "4",
        "--no-enable-prefix-caching",
        "--scheduling-policy",
        "priority",
    ]
    args = build_parser().parse_args(["serve", "hash", *server_flags, *engine_flags])
    assert (args.model_tag, args.host, args.port, args.api_key) == ("hash", "127.0.0.1", 0, "k")
    assert (args.served_model_name, args.enable_admin_endpoints) == ("m", True)
    assert args.chat_template == "served.jinja"  # loaded once the checkpoint's tokenizer is known
    assert (args.max_num_seqs, args.enable_prefix_caching, args.scheduling_policy) == (
        4,
        False,
        "priority",
    )
    defaults = build_parser().parse_args(["serve"])
    assert (
        defaults.model_tag,
        defaults.port,
        defaults.api_key,
        defaults.enable_admin_endpoints,
        defaults.chat_template,
    ) == (
        None,
        8000,
        None,
        False,
        None,
    )


def test_help_lists_the_flags() -> None:
    result = subprocess.run(
        [*kvflow_command(), "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0
    for flag in (
        "--host",
        "--port",
        "--api-key",
        "--served-model-name",
        "--enable-admin-endpoints",
        "--chat-template",
        "--max-model-len",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "--reasoning-parser",
        "--revision",
    ):
        assert flag in result.stdout
    for name in ("hermes", "llama3_json", "mistral", "pythonic", "qwen3", "deepseek_r1"):
        assert name in result.stdout


def test_tool_flags_parse_and_auto_tool_choice_without_a_parser_is_a_one_line_error() -> None:
    args = build_parser().parse_args(
        ["serve", "--enable-auto-tool-choice", "--tool-call-parser", "pythonic"]
    )
    assert (args.enable_auto_tool_choice, args.tool_call_parser) == (True, "pythonic")
    result = run_serve("hash", "--enable-auto-tool-choice")
    assert result.returncode == 2
    [line] = result.stderr.strip().splitlines()  # refused before anything loads
    assert line.startswith(
        "kvflow serve: error: --enable-auto-tool-choice needs --tool-call-parser"
    )
    unknown = run_serve("hash", "--tool-call-parser", "xml")
    assert unknown.returncode == 2 and "invalid choice: 'xml'" in unknown.stderr


def test_model_given_twice_differently_is_a_one_line_error() -> None:
    result = run_serve("hash", "--model", "/some/folder")
    assert result.returncode == 2
    assert (
        result.stderr.strip()
        .splitlines()[-1]
        .startswith("kvflow serve: error: MODEL 'hash' and --model")
    )


def test_a_port_in_use_fails_before_the_model_loads() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_serve("hash", "--port", str(port))
    assert result.returncode == 2
    [line] = result.stderr.strip().splitlines()  # nothing loaded, nothing logged
    assert line.startswith(f"kvflow serve: error: cannot listen on 127.0.0.1:{port}")


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_stops_the_server_cleanly(sig: signal.Signals) -> None:
    with running_server(*HASH_SERVER, "--enable-admin-endpoints") as server:
        first_chunk = threading.Event()
        payloads: list[Any] = []

        def read_stream() -> None:
            body = {
                "prompt": [1, 2, 3],
                "max_tokens": 900,
                "stream": True,
                "return_token_ids": True,
            }
            with (
                server.http() as http,
                http.stream("POST", "/v1/completions", json=body) as response,
            ):
                for line in response.iter_lines():
                    payloads.extend(sse_payloads([line]))
                    first_chunk.set()

        completion = server.post("/v1/completions", json={"prompt": [4, 5], "max_tokens": 2})
        assert completion.status_code == 200
        reader = threading.Thread(target=read_stream)
        reader.start()
        assert first_chunk.wait(60)
        server.post("/pause", params={"mode": "keep"})  # the stream stays in flight
        assert server.stop(sig) == 0
        reader.join(30)
        assert not reader.is_alive()
        assert payloads[-1] == "[DONE]"
        assert payloads[-2]["choices"][0]["finish_reason"] == "abort"  # ended, not cut off
        assert not server.leftover_processes()
        log = server.log
        assert "Traceback" not in log
        assert (
            "kvflow serve: model 'hash' at http://127.0.0.1:" in log
        )  # kvflow's INFO lines are on
        assert "POST /v1/completions" not in log  # uvicorn's access log is off
        assert "kvflow serve stopped" in log


def _environment_of(pid: int) -> dict[str, str]:
    entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(entry.decode().split("=", 1) for entry in entries if b"=" in entry)


@pytest.mark.parametrize(
    ("given", "engine_sees"),
    [
        ({}, "PASSIVE"),
        ({"OMP_WAIT_POLICY": "ACTIVE"}, "ACTIVE"),
        ({"GOMP_SPINCOUNT": "1000"}, None),
    ],
    ids=["default", "user-policy", "user-spincount"],
)
def test_the_engine_cores_openmp_threads_sleep_while_waiting_unless_the_user_chose(
    given: dict[str, str], engine_sees: str | None
) -> None:
    """The engine core shares the cores with the API server: its OpenMP threads wait passively (a spinning team
    stalls whenever the API process takes one of its cores), unless the environment already says how they wait."""
    environ = {k: v for k, v in os.environ.items() if k not in OPENMP_WAIT_ENV}
    with running_server(*HASH_SERVER, env=environ | given, replace_env=True) as server:
        engines = [
            pid
            for pid in child_pids(server.process.pid)
            if "resource_tracker" not in Path(f"/proc/{pid}/cmdline").read_text()
        ]
        assert engines, "the engine core process is not among the server's children"
        for pid in engines:
            environment = _environment_of(pid)
            assert environment.get("OMP_WAIT_POLICY") == engine_sees
            assert {k: environment.get(k) for k in given} == given
        assert ("OMP_WAIT_POLICY=PASSIVE" in server.log) == (not given)
