"""The engine-core process dies under a running `kvflow serve`: streams in flight end with an error event, new
requests and `/health` get 503, nothing hangs, and stopping the server leaves no process behind."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.entrypoints.server import HASH_SERVER, running_server

TIMEOUT_S = 60.0


@pytest.mark.slow
def test_a_dead_engine_fails_streams_and_health_and_the_server_still_stops_cleanly() -> None:
    with running_server(*HASH_SERVER) as server:
        engine_pid = server.engine_pid()
        body = {
            "model": "hash",
            "prompt": [5, 6, 7, 8],
            "max_tokens": 900,
            "ignore_eos": True,
            "stream": True,
        }
        events: list[str] = []
        with httpx.Client(timeout=TIMEOUT_S) as client:
            with client.stream("POST", f"{server.url}/v1/completions", json=body) as response:
                assert response.status_code == 200
                for line in response.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    events.append(line.removeprefix("data:").strip())
                    if len(events) == 3:  # tokens are flowing: kill the engine under the stream
                        os.kill(engine_pid, signal.SIGKILL)
            payloads = [json.loads(event) for event in events if event != "[DONE]"]
            assert "error" in payloads[-1], events[-3:]
            assert "exited unexpectedly" in payloads[-1]["error"]["message"]
            assert client.get(f"{server.url}/health").status_code == 503
            rejected = client.post(
                f"{server.url}/v1/completions",
                json={"model": "hash", "prompt": [1, 2, 3], "max_tokens": 2},
            )
            assert rejected.status_code == 503
            assert rejected.json()["error"]["code"] == 503
        deadline = time.monotonic() + TIMEOUT_S
        while Path(f"/proc/{engine_pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.05)  # reaped by the server
        status = server.stop(signal.SIGTERM)
        assert status == 0, server.log[-2000:]
        assert "Traceback" not in server.log
        assert not server.leftover_processes()
