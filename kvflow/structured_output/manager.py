"""StructuredOutputManager: compiles constraints off the engine loop and builds each step's token bitmask."""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, TypeVar

from kvflow.core.sched.output import DRAFT_PLACEHOLDER, GrammarOutput
from kvflow.reasoning import REASONING_PARSERS
from kvflow.request import RequestStatus
from kvflow.structured_output import STRUCTURED_OUTPUT_BACKENDS
from kvflow.structured_output.backend import allocate_bitmask
from kvflow.structured_output.reasoning_end import ReasoningGate, TokenTexts
from kvflow.structured_output.request import GrammarFactory, StructuredOutputRequest
from kvflow.structured_output.validation import backends_to_try, first_backend_that_takes

if TYPE_CHECKING:
    from kvflow.config import StructuredOutputsConfig
    from kvflow.core.sched.output import SchedulerOutput
    from kvflow.request import Request
    from kvflow.sampling_params import StructuredOutputsParams
    from kvflow.structured_output.backend import GrammarVocab, StructuredOutputBackend

logger = logging.getLogger(__name__)
_T = TypeVar("_T")

# Compiled constraints kept (least recently used dropped first); each is a few KB to a few MB.
_COMPILE_CACHE_SIZE = 256
# Compile threads: one per core (at least 2, so one long compile never holds up every other; at most 4).
COMPILE_WORKERS = min(4, max(2, os.cpu_count() or 1))


class StructuredOutputManager:
    """Beside the scheduler in the engine core (vLLM V1's design).

    * `grammar_init(request)` queues the request's constraint for compilation on a pool of `COMPILE_WORKERS`
      threads (never on the engine loop); a cache keyed by (backend, constraint) makes a repeated constraint compile
      once. The request waits in WAITING_FOR_FSM, for its own compile only; `poll()` (each engine step) moves it to
      WAITING once compiled, or reports the compile error, or that `compile_timeout_s` passed first, which
      finishes that request with finish_reason "error" (the request's fault) and never the engine. A request that
      leaves while waiting (abort, client gone) cancels its compile when nobody else waits on it and it has not
      started; a started compile runs to its end (a thread cannot be stopped) and its result stays cached.
    * `grammar_bitmask(requests, scheduler_output)` builds one bitmask for the step's scheduled structured requests,
      from their matchers' current state. The engine calls it only once every earlier step's output has been
      applied, so each matcher stands exactly after the tokens its request keeps.
    * Matchers advance in `Scheduler.update_from_output`, one accepted token at a time, only with tokens that are
      appended to the request.
    * With a reasoning parser (`StructuredOutputsConfig.constrains_after_reasoning`), a constraint starts where
      the output's reasoning ends (`kvflow.structured_output.reasoning_end`): until then the request's kept tokens
      go to its reasoning detector instead of its matcher, and its rows are left out of the bitmask (unmasked).

    Invariant (async scheduling, preemption, pause, forced reset, abort): a request's reasoning detector and
    matcher have consumed exactly its kept output tokens (of its current streaming chunk), each token once, the
    detector's first. In-flight tokens that the scheduler discards (`async_tokens_to_discard`) and tokens cut by
    a stop never reach either, so nothing is ever rolled back; a preempted request keeps its outputs, detector and
    matcher, and resumes where they stand. The switch from reasoning to constrained is exact also with async
    scheduling: a step that schedules a request with a matcher waits for its bitmask, which is built only after
    every earlier step's output was applied (`InFlightBatch.awaiting_grammar`), so the detector has seen every
    token before the one being sampled: the first token after the end marker is masked, the marker's are not.
    """

    def __init__(
        self,
        config: StructuredOutputsConfig,
        vocab_factory: Callable[[], GrammarVocab],
        vocab_size: int,
    ) -> None:
        self.backend_names = backends_to_try(config.backend)
        self.vocab_size = vocab_size
        self._vocab_factory = vocab_factory
        self._vocab: GrammarVocab | None = None
        self._reasoning_parser = (
            REASONING_PARSERS.get(config.reasoning_parser)()
            if config.reasoning_parser is not None and config.constrains_after_reasoning
            else None
        )
        self._reasoning_gate: ReasoningGate | None = None  # built with the vocabulary, on the pool
        self._backends: dict[str, StructuredOutputBackend] = {}
        self._backend_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._compiled: OrderedDict[tuple[object, ...], Future[GrammarFactory]] = OrderedDict()
        self._compiling: dict[str, Request] = {}
        self.compile_timeout_s = config.compile_timeout_s
        self.num_compiles = 0
        # Seconds spent setting up backends (vocabulary, compilers), and when the setup running now began: one-time
        # work that no request's compile deadline pays for (`_compile_clock`).
        self._setup_s = 0.0
        self._setup_began: float | None = None
        self._setup_clock_lock = threading.Lock()  # the two fields change together

    # ------------------------------------------------------------------------------------------------ compile
    def grammar_init(self, request: Request) -> None:
        """Start compiling `request`'s constraint (or reuse a compiled one); the request waits in WAITING_FOR_FSM."""
        params = request.sampling_params.structured_outputs
        assert params is not None
        request.structured_output_request = StructuredOutputRequest(
            params,
            self._compile(params),
            owner=weakref.ref(request),
            compile_deadline=self._compile_clock() + self.compile_timeout_s,
        )
        request.status = RequestStatus.WAITING_FOR_FSM
        self._compiling[request.request_id] = request

    def _compile(self, params: StructuredOutputsParams) -> Future[GrammarFactory]:
        key = params.cache_key()
        future = self._compiled.get(key)
        if future is not None:
            self._compiled.move_to_end(key)
            return future
        future = self._pool_submit(self._compile_now, params)
        self._compiled[key] = future
        if len(self._compiled) > _COMPILE_CACHE_SIZE:
            self._compiled.popitem(last=False)
        return future

    def _pool_submit(self, fn: Callable[..., _T], *args: object) -> Future[_T]:
        """Run `fn(*args)` on the compile pool (started on first use)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(
                max_workers=COMPILE_WORKERS, thread_name_prefix="kvflow-grammar"
            )
        return self._pool.submit(fn, *args)

    def _compile_now(self, params: StructuredOutputsParams) -> GrammarFactory:
        """On the pool: compile with each backend in turn ("auto": xgrammar, then guidance)."""
        self.num_compiles += 1
        return first_backend_that_takes(
            self.backend_names, lambda name: self._backend(name).compile(params)
        )

    def _backend(self, name: str) -> StructuredOutputBackend:
        with self._backend_lock:
            backend = self._backends.get(name)
            if backend is None:
                with self._setup_clock_lock:
                    self._setup_began = time.monotonic()
                try:
                    if self._vocab is None:
                        self._vocab = self._load_vocab()
                    backend = STRUCTURED_OUTPUT_BACKENDS.get(name)(self._vocab)
                finally:
                    with self._setup_clock_lock:
                        self._setup_s += time.monotonic() - self._setup_began
                        self._setup_began = None
                self._backends[name] = backend
            return backend

    def _compile_clock(self) -> float:
        """time.monotonic() less the time spent setting up backends (it stands still during a setup): compile
        deadlines run on it, so the first constrained request does not pay for loading the vocabulary (seconds
        for a large one) within its own `compile_timeout_s`."""
        with self._setup_clock_lock:
            began = self._setup_began
            return (time.monotonic() if began is None else began) - self._setup_s

    def _load_vocab(self) -> GrammarVocab:
        """The vocabulary (and, with a reasoning parser, its token texts): on the pool, before any compile ends."""
        vocab = self._vocab_factory()
        if self._reasoning_parser is not None:
            self._reasoning_gate = ReasoningGate(self._reasoning_parser, TokenTexts.of_vocab(vocab))
        return vocab

    def poll(self) -> list[tuple[Request, str]]:
        """Start the matcher of every request whose constraint has compiled (WAITING_FOR_FSM -> WAITING).
        Returns the requests whose compilation failed or outlived `compile_timeout_s`, with the error text (naming
        the field), for the caller to finish; forgets requests that finished while waiting."""
        if not self._compiling:
            return []
        failed: list[tuple[Request, str]] = []
        now = self._compile_clock()
        for request_id, request in list(self._compiling.items()):
            so_request = request.structured_output_request
            if request.is_finished() or so_request is None:
                self._stop_waiting(request_id)
                continue
            if not so_request.compiled.done():
                if now >= so_request.compile_deadline:
                    self._stop_waiting(request_id)
                    message = (
                        f"structured_outputs.{so_request.params.kind} did not compile within "
                        f"{self.compile_timeout_s:g} s (structured_outputs_config compile_timeout_s): "
                        "send a smaller constraint"
                    )
                    logger.warning("request %s: %s", request_id, message)
                    failed.append((request, message))
                continue
            self._stop_waiting(request_id)
            try:
                so_request.start(self._reasoning_gate)
            except Exception as error:  # the request's constraint alone is at fault
                logger.warning(
                    "request %s: structured output failed to compile: %s", request_id, error
                )
                failed.append((request, str(error) or type(error).__name__))
                continue
            if request.status == RequestStatus.WAITING_FOR_FSM:
                request.status = RequestStatus.WAITING
        return failed

    def _stop_waiting(self, request_id: str) -> None:
        """`request_id` no longer waits for its compile: cancel the compile when it has not started and no other
        waiting request shares it (then it leaves the cache too)."""
        request = self._compiling.pop(request_id)
        so_request = request.structured_output_request
        if so_request is None or so_request.compiled.done():
            return
        future = so_request.compiled
        shared = any(
            other.structured_output_request is not None
            and other.structured_output_request.compiled is future
            for other in self._compiling.values()
        )
        if not shared and future.cancel():
            key = so_request.params.cache_key()
            if self._compiled.get(key) is future:
                del self._compiled[key]

    def has_compiling(self) -> bool:
        return bool(self._compiling)

    def wait_for_compile(self, timeout_s: float) -> None:
        """Block until some pending compilation finishes, `timeout_s` passes or the first compile deadline comes:
        the engine has nothing else to do."""
        waiting = [
            request.structured_output_request
            for request in self._compiling.values()
            if request.structured_output_request is not None
        ]
        if waiting:
            first_deadline = min(so_request.compile_deadline for so_request in waiting)
            concurrent.futures.wait(
                [so_request.compiled for so_request in waiting],
                min(timeout_s, max(0.0, first_deadline - self._compile_clock())),
                concurrent.futures.FIRST_COMPLETED,
            )

    # ------------------------------------------------------------------------------------------------ bitmask
    def grammar_bitmask(
        self, requests: Mapping[str, Request], scheduler_output: SchedulerOutput
    ) -> GrammarOutput:
        """The bitmask of the step's scheduled requests that have a matcher and are past their reasoning, in
        schedule order (the runner masks only these rows; a request still in reasoning samples unmasked). A
        request verifying d speculative drafts has d + 1 consecutive rows (`fill_draft_bitmask`), its id repeated
        for each.

        A request that finished or whose matcher terminated since the step was planned gets all-allowed rows:
        its tokens are discarded on arrival, so no constraint applies to it.
        """
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        request_ids: list[str] = []
        filled: list[tuple[StructuredOutputRequest | None, int, list[int]]] = []
        for request_id in scheduler_output.num_scheduled_tokens:
            request = requests.get(request_id)
            so_request = None if request is None else request.structured_output_request
            if (
                so_request is None
                or so_request.grammar is None
                or so_request.reasoning_end is not None
            ):
                continue
            drafts = spec_tokens.get(request_id, []) if spec_tokens else []
            assert DRAFT_PLACEHOLDER not in drafts, "constrained requests verify only known drafts"
            live = not (request.is_finished() or so_request.grammar.is_terminated())
            filled.append((so_request if live else None, len(request_ids), drafts))
            request_ids.extend([request_id] * (1 + len(drafts)))
        bitmask = allocate_bitmask(len(request_ids), self.vocab_size)
        for so_request, first_row, drafts in filled:
            if so_request is not None:
                so_request.fill_draft_bitmask(bitmask, first_row, drafts)
        return GrammarOutput(request_ids, bitmask)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
