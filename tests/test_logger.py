"""kvflow's logging setup (kvflow/logger.py): INFO to stderr by default, KVFLOW_LOGGING_LEVEL, and coexistence with an
application's own logging. Behaviour is checked in fresh interpreters, where `import kvflow` configures it."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys

import pytest

from kvflow.logger import (
    CONFIGURE_LOGGING_ENV,
    LOGGING_LEVEL_ENV,
    KvflowHandler,
    configure_logging,
    logging_level_error,
    parse_logging_level,
)

LOG_LINE = re.compile(
    r"^(DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d \[[\w.]+\.py:\d+\] "
)
HASH_ENGINE = (
    "from kvflow import LLM; LLM('hash', num_kv_blocks=64, max_model_len=256, max_num_seqs=4)"
)


def run_python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    """`code` in a fresh interpreter, with `env` on top of this environment (logging variables cleared first)."""
    base = {
        key: value
        for key, value in os.environ.items()
        if key not in (LOGGING_LEVEL_ENV, CONFIGURE_LOGGING_ENV)
    }
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**base, **env},
    )


def test_a_plain_script_shows_the_startup_lines_on_stderr() -> None:
    result = run_python(
        "from kvflow import LLM; LLM(num_kv_blocks=256, max_num_seqs=4, max_model_len=1024)"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    loaded = [line for line in lines if "[loader.py:" in line]
    kv_cache = [line for line in lines if "[worker.py:" in line and "KV cache" in line]
    assert len(loaded) == 1 and LOG_LINE.match(loaded[0]) and loaded[0].startswith("INFO ")
    assert "default-model" in loaded[0] and "torch.float32" in loaded[0]  # the model and its dtype
    assert len(kv_cache) == 1 and LOG_LINE.match(kv_cache[0])
    assert "256 blocks x 16 tokens = 4096 tokens" in kv_cache[0] and "MiB" in kv_cache[0]


def test_the_level_variable_silences_info_and_accepts_any_case() -> None:
    result = run_python(
        HASH_ENGINE, KVFLOW_LOGGING_LEVEL="warning"
    )  # other spellings: parse tests below
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    debug = run_python(
        "import logging; import kvflow; logging.getLogger('kvflow.x').debug('a debug line')",
        KVFLOW_LOGGING_LEVEL="DEBUG",
    )
    assert debug.stderr.startswith("DEBUG ") and debug.stderr.rstrip().endswith("a debug line")


def test_an_invalid_level_is_reported_naming_the_variable_and_info_goes_on() -> None:
    quiet = run_python("import kvflow", KVFLOW_LOGGING_LEVEL="LOUD")
    assert (
        quiet.returncode == 0 and quiet.stderr == ""
    )  # said before kvflow's first line, not on import
    result = run_python(HASH_ENGINE, KVFLOW_LOGGING_LEVEL="LOUD")
    assert result.returncode == 0, result.stderr
    first, *rest = result.stderr.splitlines()
    assert (
        first.startswith("WARNING ")
        and "KVFLOW_LOGGING_LEVEL='LOUD' is not a logging level" in first
    )
    assert any(line.startswith("INFO ") and "KV cache" in line for line in rest)
    assert "KVFLOW_LOGGING_LEVEL" not in "\n".join(rest)  # said once


def test_an_application_that_configures_logging_gets_kvflows_records_once_through_its_handlers() -> (
    None
):
    code = (
        "import logging, sys\n"
        "logging.basicConfig(stream=sys.stdout, level=logging.WARNING, format='APP %(name)s %(message)s')\n"
        f"{HASH_ENGINE}\n"
        "logging.getLogger('app').info('not shown: the root level is WARNING')\n"
    )
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""  # kvflow's own handler stays silent
    kv_lines = [line for line in result.stdout.splitlines() if "KV cache" in line]
    assert kv_lines == [kv_lines[0]] and kv_lines[0].startswith("APP kvflow.worker.worker KV cache")
    assert "not shown" not in result.stdout


def test_configure_logging_zero_leaves_the_kvflow_logger_alone() -> None:
    code = (
        "import logging, kvflow\n"
        "log = logging.getLogger('kvflow')\n"
        "print(len(log.handlers), log.level)\n"
        f"{HASH_ENGINE}\n"
    )
    result = run_python(code, KVFLOW_CONFIGURE_LOGGING="0")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["0", "0"]
    assert "KV cache" not in result.stderr  # INFO: below Python's last-resort handler's WARNING


def test_the_root_logger_is_never_configured_by_kvflow() -> None:
    result = run_python(
        f"import logging; {HASH_ENGINE}; root = logging.getLogger(); print(len(root.handlers), root.level)"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["0", str(logging.WARNING)]


# ------------------------------------------------------------------------------------------------ in process
@pytest.mark.parametrize(
    ("value", "level"),
    [("DEBUG", 10), ("info", 20), (" Warning ", 30), ("error", 40), ("CRITICAL", 50), ("25", 25)],
)
def test_parse_logging_level_accepts_names_in_any_case_and_numbers(value: str, level: int) -> None:
    assert parse_logging_level(value) == level


@pytest.mark.parametrize("value", ["LOUD", "", "-1", "warn ing", "NOTSET"])
def test_parse_logging_level_rejects_other_values_naming_the_variable(value: str) -> None:
    with pytest.raises(
        ValueError, match=r"KVFLOW_LOGGING_LEVEL=.* is not a logging level: use one of DEBUG"
    ):
        parse_logging_level(value)


def test_logging_level_error_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(LOGGING_LEVEL_ENV, raising=False)
    assert logging_level_error() is None
    monkeypatch.setenv(LOGGING_LEVEL_ENV, "debug")
    assert logging_level_error() is None
    monkeypatch.setenv(LOGGING_LEVEL_ENV, "chatty")
    assert "KVFLOW_LOGGING_LEVEL='chatty'" in (logging_level_error() or "")


def test_configure_logging_is_idempotent() -> None:
    configure_logging()
    configure_logging()
    handlers = logging.getLogger("kvflow").handlers
    assert sum(isinstance(handler, KvflowHandler) for handler in handlers) == 1


def test_a_multi_line_message_repeats_the_header_on_every_line() -> None:
    [handler] = [h for h in logging.getLogger("kvflow").handlers if isinstance(h, KvflowHandler)]
    record = logging.LogRecord("kvflow.x", logging.INFO, "/a/b/mod.py", 7, "one\ntwo", None, None)
    first, second = handler.format(record).split("\n")
    assert LOG_LINE.match(first) and first.endswith("] one")
    assert second == first[: -len("one")] + "two"
