"""A real `kvflow serve` for tests: a subprocess on a free 127.0.0.1 port, in a process group of its own.

`running_server(...)` starts one and always stops it: SIGINT first, then SIGKILL to the whole group if it has not
exited within its deadline, so no test leaves a process behind, also when it fails. Helpers read server-sent events
and Prometheus samples.
"""

from __future__ import annotations

import contextlib
import json
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
from typing import Any

import httpx
import openai

STARTUP_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0
HTTP_TIMEOUT_S = 60.0
_ADDRESS = re.compile(r"kvflow serve: model '.*' at (http://[\d.]+:\d+)")
_SAMPLE = re.compile(r"^([A-Za-z_:][\w:]*)(?:\{(.*)\})? (\S+)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')

# The hash model on a small engine: its own max_model_len would ask for far more KV cache than tests want.
HASH_SERVER = ["hash", "--max-model-len", "1024", "--num-kv-blocks", "256", "--max-num-seqs", "16"]
# The default model with a small KV cache that holds its slots at full length.
DEFAULT_SERVER = ["--max-model-len", "1024", "--num-kv-blocks", "256", "--max-num-seqs", "4"]


def kvflow_command() -> list[str]:
    script = shutil.which("kvflow", path=str(Path(sys.executable).parent))
    return [script] if script else [sys.executable, "-m", "kvflow.entrypoints.cli"]


class RemoteServer:
    """One `kvflow serve` process (`--port 0`: the port it picked is read from its log line).

    Invariants: the process leads its own process group (`pgid == pid`), so every process it starts can be
    found and killed with it; `log` holds its combined stdout and stderr.
    """

    def __init__(
        self,
        *args: str,
        api_key: str | None = None,
        env: dict[str, str] | None = None,
        replace_env: bool = False,
    ) -> None:
        self.api_key = api_key
        descriptor, log_path = tempfile.mkstemp(prefix="kvflow-serve-", suffix=".log")
        self.log_path = Path(log_path)
        command = [*kvflow_command(), "serve", *args, "--port", "0"]
        if api_key is not None:
            command += ["--api-key", api_key]
        inherited = {} if replace_env else os.environ
        environ = {k: v for k, v in inherited.items() if k != "KVFLOW_LOGGING_LEVEL"}
        self.process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=descriptor,
            stderr=subprocess.STDOUT,
            env={**environ, **(env or {})},
            start_new_session=True,
        )
        os.close(descriptor)
        self.pgid = self.process.pid
        try:
            self.url = self._wait_until_ready()
        except BaseException:
            self.stop()
            self.log_path.unlink(missing_ok=True)
            raise

    # ------------------------------------------------------------------------------------------------ lifecycle
    def _wait_until_ready(self) -> str:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        url = None
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"kvflow serve exited with {self.process.returncode}:\n{self.log}"
                )
            if url is None:
                match = _ADDRESS.search(self.log)
                url = match.group(1) if match else None
            if url is not None:
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                        return url
            time.sleep(0.1)
        raise TimeoutError(f"kvflow serve was not ready within {STARTUP_TIMEOUT_S} s:\n{self.log}")

    def stop(self, sig: int = signal.SIGINT) -> int:
        """Send `sig` and wait for the exit status; SIGKILL the whole group past the deadline."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.kill_group()
                self.process.wait(STOP_TIMEOUT_S)
        self.kill_group()  # anything the server started and left behind
        return self.process.returncode

    def kill_group(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pgid, signal.SIGKILL)

    def leftover_processes(self, grace_s: float = 10.0) -> list[str]:
        """Live processes of the server's group (pid and command line), waiting up to `grace_s` for them to end:
        helpers such as multiprocessing's resource tracker exit only once they notice the server is gone. Zombies
        do not count: a child that outlived the server is reparented to PID 1, which in some sandboxes never
        reaps it, but it runs nothing."""
        deadline = time.monotonic() + grace_s
        while True:
            alive = []
            for stat_file in Path("/proc").glob("[0-9]*/stat"):
                try:
                    fields = stat_file.read_text().rsplit(")", 1)[1].split()
                    command = (stat_file.parent / "cmdline").read_bytes().replace(b"\0", b" ")
                except OSError:
                    continue  # it ended while we looked
                state, process_group = fields[0], int(fields[2])
                if process_group == self.pgid and state != "Z":
                    alive.append(f"{stat_file.parent.name}: {command.decode(errors='replace')}")
            if not alive or time.monotonic() > deadline:
                return alive
            time.sleep(0.05)

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def engine_pid(self) -> int:
        """The engine-core process the server started: its spawned child that loaded torch (spawn may add a
        resource tracker, and request chat templates a template sandbox, which do not)."""
        for pid in child_pids(self.process.pid):
            try:
                command_line = Path(f"/proc/{pid}/cmdline").read_bytes()
                maps = Path(f"/proc/{pid}/maps").read_text()
            except OSError:
                continue
            if b"multiprocessing.spawn" in command_line and "libtorch" in maps:
                return pid
        raise AssertionError(f"no engine process among the children of {self.process.pid}")

    def rss_bytes(self, pid: int | None = None) -> int:
        """The resident memory of the server process (or of `pid`)."""
        status = Path(f"/proc/{pid or self.process.pid}/status").read_text()
        [line] = [line for line in status.splitlines() if line.startswith("VmRSS:")]
        return int(line.split()[1]) * 1024

    # ------------------------------------------------------------------------------------------------ clients
    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kwargs: Any) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.url}/v1",
            api_key=self.api_key or "EMPTY",
            max_retries=0,
            timeout=HTTP_TIMEOUT_S,
            **kwargs,
        )

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=f"{self.url}/v1",
            api_key=self.api_key or "EMPTY",
            max_retries=0,
            timeout=HTTP_TIMEOUT_S,
        )

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=HTTP_TIMEOUT_S)

    def async_http(self, **kwargs: Any) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            base_url=self.url, headers=self.headers, timeout=HTTP_TIMEOUT_S, **kwargs
        )

    def get(self, path: str, **kwargs: Any) -> httpx.Response:
        with self.http() as http:
            return http.get(path, **kwargs)

    def post(self, path: str, **kwargs: Any) -> httpx.Response:
        with self.http() as http:
            return http.post(path, **kwargs)

    def metrics(self) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
        return parse_metrics(self.get("/metrics").text)

    def metric(self, name: str, **labels: str) -> float:
        """One sample's value (0 when absent), e.g. `metric("kvflow:num_requests_running")`."""
        samples = self.metrics()
        wanted = set(labels.items())
        return sum(
            value
            for (sample, sample_labels), value in samples.items()
            if sample == name and wanted <= sample_labels
        )

    def wait_for_metric(
        self, name: str, expected: float, timeout: float = 30.0, **labels: str
    ) -> None:
        """Poll /metrics until the sample equals `expected` (AssertionError with the last value otherwise)."""
        deadline = time.monotonic() + timeout
        value = self.metric(name, **labels)
        while value != expected and time.monotonic() < deadline:
            time.sleep(0.05)
            value = self.metric(name, **labels)
        assert value == expected, f"{name}{labels} is {value}, expected {expected}"


@contextlib.contextmanager
def running_server(
    *args: str,
    api_key: str | None = None,
    env: dict[str, str] | None = None,
    replace_env: bool = False,
) -> Iterator[RemoteServer]:
    """A started `RemoteServer`, stopped on exit. Its environment: this process's plus `env`, or with
    `replace_env` only `env`."""
    server = RemoteServer(*args, api_key=api_key, env=env, replace_env=replace_env)
    try:
        yield server
    finally:
        server.stop()
        server.log_path.unlink(missing_ok=True)


def child_pids(parent_pid: int) -> list[int]:
    """The processes whose parent is `parent_pid` (from /proc)."""
    children = []
    for stat_file in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat_file.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # it ended while we looked
        if int(fields[1]) == parent_pid:
            children.append(int(stat_file.parent.name))
    return children


# ---------------------------------------------------------------------------------------------------- parsing
def parse_metrics(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Prometheus text format -> {(name, labels): value}."""
    samples = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        assert match, f"unparsable metrics line {line!r}"
        name, labels, value = match.groups()
        samples[(name, frozenset(_LABEL.findall(labels or "")))] = float(value)
    return samples


def sse_payloads(lines: list[str]) -> list[dict[str, Any] | str]:
    """The `data:` payloads of server-sent event lines, JSON-decoded (`[DONE]` stays a string)."""
    payloads: list[dict[str, Any] | str] = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: ") :]
            payloads.append(data if data == "[DONE]" else json.loads(data))
    return payloads
