"""kvflow's logging setup: the `kvflow` logger prints INFO and above to stderr, like vLLM's.

    INFO 11-30 12:00:00 [worker.py:106] KV cache: 4096 blocks x 16 tokens = 65536 tokens (...)

`configure_logging()` runs once, when `kvflow` is imported. It touches only the `kvflow` logger, never the root
logger, so an application's own logging setup keeps working:

* the level comes from `KVFLOW_LOGGING_LEVEL` (`DEBUG`, `INFO` (default), `WARNING`, `ERROR`, `CRITICAL`, or a
  number). An invalid value falls back to INFO and is reported, naming the variable, by a warning before kvflow's
  first log line; the command line refuses it outright (see `logging_level_error`);
* kvflow's handler writes to the current `sys.stderr`, but only while the root logger has no handlers. Records
  always propagate, so once an application configures logging (`logging.basicConfig`, `dictConfig`, pytest's log
  capture) kvflow's records reach its handlers instead, exactly once. (vLLM sets `propagate = False` instead,
  which hides its records from the application's handlers.) To tune kvflow's verbosity from code, set the level of
  `logging.getLogger("kvflow")`;
* `KVFLOW_CONFIGURE_LOGGING=0` leaves the `kvflow` logger untouched (no handler, no level), like
  `VLLM_CONFIGURE_LOGGING=0`.
"""

from __future__ import annotations

import logging
import os
import sys

__all__ = [
    "CONFIGURE_LOGGING_ENV",
    "LOGGING_LEVEL_ENV",
    "configure_logging",
    "logging_level_error",
    "parse_logging_level",
]

LOGGING_LEVEL_ENV = "KVFLOW_LOGGING_LEVEL"
CONFIGURE_LOGGING_ENV = "KVFLOW_CONFIGURE_LOGGING"
ROOT_LOGGER_NAME = "kvflow"
DEFAULT_LEVEL = logging.INFO
LEVEL_NAMES = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
LOG_FORMAT = "%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s"
DATE_FORMAT = "%m-%d %H:%M:%S"

logger = logging.getLogger(__name__)

# The message about an invalid KVFLOW_LOGGING_LEVEL, not yet shown; the handler logs it before its first record.
_pending_level_warning: str | None = None


def parse_logging_level(value: str) -> int:
    """The level a `KVFLOW_LOGGING_LEVEL` value names: a level name in any case, or a number.

    ValueError naming the variable and the valid names otherwise.
    """
    text = value.strip()
    if text.upper() in LEVEL_NAMES:
        return logging.getLevelName(text.upper())
    if text.isdigit():
        return int(text)
    raise ValueError(
        f"{LOGGING_LEVEL_ENV}={value!r} is not a logging level: use one of {', '.join(LEVEL_NAMES)}"
    )


def logging_level_error() -> str | None:
    """Why `KVFLOW_LOGGING_LEVEL` is invalid, or None when it is unset or valid."""
    value = os.environ.get(LOGGING_LEVEL_ENV)
    if value is None:
        return None
    try:
        parse_logging_level(value)
    except ValueError as error:
        return str(error)
    return None


class _NewLineFormatter(logging.Formatter):
    """Repeats the header (`INFO 11-30 12:00:00 [file.py:12] `) before every line of a multi-line message, so each
    printed line stays attributable (vLLM's NewLineFormatter)."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        message = record.getMessage()
        if "\n" not in message:
            return text
        header = text[: text.find(message)] if message in text else ""
        return text.replace("\n", "\n" + header)


class KvflowHandler(logging.StreamHandler):
    """Writes to whatever `sys.stderr` is at the time (so redirections and captures see it) and stays silent
    while the root logger has handlers: the record propagates to those, and printing it here too would show it
    twice."""

    def __init__(self) -> None:
        logging.Handler.__init__(self)  # StreamHandler.__init__ would pin today's sys.stderr

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(
        self, value: object
    ) -> None:  # StreamHandler.setStream; the stream is always sys.stderr
        pass

    def emit(self, record: logging.LogRecord) -> None:
        global _pending_level_warning
        if (
            _pending_level_warning is not None
        ):  # through the logger, so the root's handlers see it too
            warning, _pending_level_warning = _pending_level_warning, None
            logger.warning("%s; logging at INFO", warning)
        if not logging.getLogger().handlers:
            super().emit(record)


def configure_logging() -> None:
    """Give the `kvflow` logger its handler and level (idempotent; see the module docstring).

    Invariant: after the first call the `kvflow` logger has exactly one `KvflowHandler`, unless
    `KVFLOW_CONFIGURE_LOGGING=0`, in which case this does nothing at all.
    """
    global _pending_level_warning
    if os.environ.get(CONFIGURE_LOGGING_ENV, "1").strip() == "0":
        return
    kvflow_logger = logging.getLogger(ROOT_LOGGER_NAME)
    if any(isinstance(handler, KvflowHandler) for handler in kvflow_logger.handlers):
        return
    level = DEFAULT_LEVEL
    value = os.environ.get(LOGGING_LEVEL_ENV)
    if value is not None:
        try:
            level = parse_logging_level(value)
        except ValueError as error:
            _pending_level_warning = str(error)
    handler = KvflowHandler()
    handler.setFormatter(_NewLineFormatter(LOG_FORMAT, datefmt=DATE_FORMAT))
    kvflow_logger.addHandler(handler)
    kvflow_logger.setLevel(level)
