"""Fixtures of the AsyncLLM end-to-end tests (tests/engine/test_async_llm*.py): `make_llm` makes engines on either
client, the multiprocess ones kept per test module in `process_engines` while healthy and idle."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvflow.engine.arg_utils import EngineArgs
from kvflow.engine.async_llm import AsyncLLM
from tests.engine.async_llm_helpers import ENGINE_OPTIONS, is_idle, run


@pytest.fixture(scope="module")
def process_engines() -> Iterator[dict[tuple[Any, ...], AsyncLLM]]:
    """Engines with their core in its own process, shared by the tests of this module: one per set of options
    (a process takes a second or two to start). A test leaves its engine here only if it is still healthy and idle
    (see `make_llm`)."""
    engines: dict[tuple[Any, ...], AsyncLLM] = {}
    yield engines
    for engine in engines.values():
        engine.shutdown()


@pytest.fixture(params=[False, True], ids=["inproc", "proc"])
def make_llm(
    request: pytest.FixtureRequest, process_engines: dict[tuple[Any, ...], AsyncLLM]
) -> Iterator[Callable[..., AsyncLLM]]:
    """Engines on either client: the in-process one (a fresh engine per call) or the multiprocess one (an idle
    shared engine with the same options, else a new one)."""
    engine_process: bool = request.param
    engines: list[tuple[tuple[Any, ...], AsyncLLM]] = []

    def make(model: str | None = "hash", **overrides: Any) -> AsyncLLM:
        options = {**ENGINE_OPTIONS, **overrides}
        key = tuple(sorted(dataclasses.asdict(EngineArgs(model, **options)).items()))
        engine = process_engines.pop(key, None) if engine_process else None
        if engine is None or engine.engine_core_client.dead_error is not None:
            engine = AsyncLLM(model, engine_process=engine_process, **options)
        engines.append((key, engine))
        return engine

    yield make
    for key, engine in engines:
        if engine_process and key not in process_engines and run(is_idle(engine)):
            process_engines[key] = engine
        else:
            engine.shutdown()
