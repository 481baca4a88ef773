"""AsyncLLM: the asyncio front end. One background thread runs the engine; coroutines stream its outputs.

    llm = AsyncLLM()
    async for output in llm.generate("Hello", SamplingParams(max_tokens=32, output_kind="delta")):
        print(output.outputs[0].text, end="")

Streaming-input sessions feed one request chunk by chunk from an async iterator of `StreamingInput`; the request
keeps its KV blocks and worker slot between chunks (see `AsyncLLM.generate`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import queue
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterable, Callable, Iterable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from kvflow.engine.builder import build_engine
from kvflow.engine.core import PAUSE_MODES
from kvflow.engine.input_processor import PromptType
from kvflow.outputs import CompletionOutput, RequestOutput
from kvflow.request import Request
from kvflow.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvflow.core.sched.output import EngineCoreOutput
    from kvflow.engine.core import EngineCore
    from kvflow.engine.input_processor import ProcessedPrompt
    from kvflow.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
_IDLE_WAIT_S = (
    0.05  # how long the idle or paused engine loop waits on its command queue before looking again
)
_SHUTDOWN_JOIN_S = 60.0


class EngineDeadError(RuntimeError):
    """The engine loop has stopped (shut down, or failed: then `__cause__` is the error); nothing more is served."""


@dataclass
class StreamingInput:
    """One chunk of a streaming-input session: a prompt in any form `generate` accepts, and the sampling params for
    the tokens generated after it (None: those of the previous chunk; for the first chunk, `generate`'s own)."""

    prompt: PromptType
    sampling_params: SamplingParams | None = None


# ---------------------------------------------------------------------------------------------------- plumbing
class _OutputStream:
    """The channel from the engine thread to one `generate` call: `RequestOutput`s, or an exception that ends it.

    Invariants: only the engine thread calls `put` (or, once the engine is dead, the consumer's own loop); only the
    consumer's event loop reads `queue`; `closed` turns True (once, never back) when the consumer has gone.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.closed = False

    def put(self, item: RequestOutput | BaseException) -> bool:
        """Hand `item` to the consumer's loop; False when that loop is closed (the consumer is gone)."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:
            return False
        return True


def _resolve(
    future: Future[Any] | None, result: Any = None, error: BaseException | None = None
) -> None:
    """Complete a caller's future unless the caller gave up on it (cancelled)."""
    if future is None:
        return
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass


@dataclass
class _AddRequest:
    request_id: str
    processed: ProcessedPrompt
    requests: list[Request]
    stream: _OutputStream


@dataclass
class _SessionInput:
    """The next chunk of a session (`request` None: the input ended, close the session)."""

    request_id: str
    stream: _OutputStream
    processed: ProcessedPrompt | None
    request: Request | None
    first: bool = False


@dataclass
class _EndSession:
    """The session's input failed (the iterator raised, or a chunk was invalid): end it with `error`."""

    request_id: str
    stream: _OutputStream
    error: BaseException


@dataclass
class _Abort:
    """Abort requests; with `stream`, only if the id still belongs to that stream (a consumer that went away)."""

    request_ids: list[str]
    stream: _OutputStream | None = None
    done: Future[None] | None = None


@dataclass
class _Pause:
    mode: str
    clear_cache: bool
    done: Future[None]


@dataclass
class _Call:
    """Run `fn(engine_core)` on the engine thread and return its result to the caller."""

    fn: Callable[[EngineCore], Any]
    done: Future[Any]


@dataclass
class _Shutdown:
    pass


_Command = _AddRequest | _SessionInput | _EndSession | _Abort | _Pause | _Call | _Shutdown


@dataclass
class _Session:
    """Engine-thread state of one streaming-input session (one resumable core request).

    Invariants:
      * `chunk_running` is True from handing a chunk to the core until the output that ends that chunk;
      * a chunk waits in `pending` only while another chunk runs, so the core receives each chunk while the session
        idles in WAITING_FOR_STREAMING_REQ and its length check (ValueError) applies at submission; the close
        (a `_SessionInput` without request) goes to the core as soon as no chunk waits before it;
      * the output processor tracks one chunk at a time (registered at submission, dropped when the chunk ends),
        so each chunk streams its own cumulative / delta / final_only outputs;
      * `in_core`: the core holds the session request (its first chunk was accepted);
      * `last_output` is the previous chunk's last output (None before the first chunk ends).
    """

    request_id: str
    stream: _OutputStream
    output_kind: str
    pending: deque[_SessionInput] = field(default_factory=deque)
    in_core: bool = False
    chunk_running: bool = False
    last_output: RequestOutput | None = None


# ---------------------------------------------------------------------------------------------------- AsyncLLM
class AsyncLLM:
    """The asyncio front end of one engine.

    `AsyncLLM(model=None, **kwargs)` takes the same arguments as `LLM`. The `EngineCore` and the `OutputProcessor`
    live on one dedicated thread (the engine loop), which is the only thread that touches them. Coroutines talk to
    it through a thread-safe command queue (add, abort, pause, resume, reset_prefix_cache, update_weights,
    shutdown); it steps the core whenever `can_make_progress()`, waits on the queue (briefly) when idle or paused,
    and hands each `RequestOutput` to its consumer's asyncio queue with `loop.call_soon_threadsafe`. Consumers may
    run on any event loop (a stream remembers the loop that started it). Stop the thread with `shutdown()` or by
    using the engine as an async context manager (`async with AsyncLLM(...) as llm:`).

    Invariants:
      * every `generate` call ends: with a finished output, with the exception that ended it, or with an
        `EngineDeadError` when the engine loop stops; a consumer that goes away (cancelled, closed, or broken out
        of) aborts its request, which frees its KV blocks and worker slot;
      * a request id is live from the start of its `generate` until that call ends, and no two live requests share
        one (ValueError);
      * `pause_generation` returns once the pause has taken effect or a later `resume_generation` released it;
      * after an engine error or `shutdown`, every call raises `EngineDeadError`.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        tokenizer: str | None = None,
        skip_tokenizer_init: bool = False,
        dtype: str = "auto",
        max_model_len: int | None = None,
        max_num_seqs: int = 128,
        max_num_batched_tokens: int | None = None,
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        kv_cache_memory_bytes: int | None = None,
        enable_prefix_caching: bool = True,
        enable_chunked_prefill: bool = True,
        async_scheduling: bool = True,
        scheduling_policy: str = "fcfs",
        seed: int = 0,
        tensor_parallel_size: int = 1,
        distributed_executor_backend: str | None = None,
        long_prefill_token_threshold: int = 0,
        use_v2_model_runner: bool = True,
        device: str = "auto",
    ) -> None:
        parts = build_engine(
            model,
            tokenizer=tokenizer,
            skip_tokenizer_init=skip_tokenizer_init,
            dtype=dtype,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            block_size=block_size,
            num_kv_blocks=num_kv_blocks,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            enable_prefix_caching=enable_prefix_caching,
            enable_chunked_prefill=enable_chunked_prefill,
            async_scheduling=async_scheduling,
            scheduling_policy=scheduling_policy,
            seed=seed,
            tensor_parallel_size=tensor_parallel_size,
            distributed_executor_backend=distributed_executor_backend,
            long_prefill_token_threshold=long_prefill_token_threshold,
            use_v2_model_runner=use_v2_model_runner,
            device=device,
        )
        self.engine_config = parts.engine_config
        self.model_info = parts.model_info
        self.tokenizer = parts.tokenizer
        self.input_processor = parts.input_processor
        # Engine-thread state: nothing below is touched by any other thread once the loop runs.
        self.engine_core = parts.engine_core
        self.output_processor = parts.output_processor
        self._streams: dict[str, _OutputStream] = {}
        self._sessions: dict[str, _Session] = {}
        self._pause_waiters: list[Future[None]] = []
        self._current_command: _Command | None = None
        self._running = True
        # Shared state, guarded by `_lock`.
        self._lock = threading.Lock()
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._closed_error: EngineDeadError | None = None
        self._live_request_ids: set[str] = set()
        self._thread = threading.Thread(
            target=self._run_engine_loop, name="kvflow-async-engine", daemon=True
        )
        self._thread.start()

    # ------------------------------------------------------------------------------------------------ public
    def get_tokenizer(self) -> Tokenizer | None:
        return self.tokenizer

    @property
    def errored(self) -> bool:
        """True once the engine loop failed (not after a clean shutdown)."""
        error = self._closed_error
        return error is not None and error.__cause__ is not None

    async def generate(
        self,
        prompt: PromptType | AsyncIterable[StreamingInput],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Stream `RequestOutput`s for one prompt as tokens arrive; the last has `finished=True`.

        `SamplingParams.output_kind` picks cumulative outputs (default), "delta" (only the new tokens and text) or
        "final_only" (just the finished output); `n > 1` folds the samples into one output per step. A bad prompt
        or parameter, or a `request_id` that is live, raises ValueError before anything is queued. While the
        engine is paused the request waits (queued) until `resume_generation`.

        Streaming input: with an async iterable of `StreamingInput` as `prompt`, one session request (this id,
        resumable) runs each chunk in turn on the session's history (earlier prompts and outputs, except each
        chunk's last sampled token, which never went through the model) and keeps its KV blocks and worker slot
        between chunks. The chunk convention: every chunk streams its own outputs (cumulative over that chunk),
        and its last output carries `outputs[0].finish_reason` ("length" for its `max_tokens`, or "stop") while
        `finished` stays False. When the iterator ends the session closes: the output that ends the running
        chunk has `finished=True`, or, if no chunk was running, one more output repeats the last chunk's final
        state (no tokens for "delta") with `finished=True`. An abort or pause(mode="abort") ends the session with
        finish_reason "abort"; an exception from the iterator, an invalid chunk, or a chunk that would grow the
        session past `max_model_len` (ValueError) is raised here and the session is aborted. A stop string that
        matches inside a chunk ends the whole session (the core cannot cut a chunk short without ending it).
        """
        self._check_open()
        loop = asyncio.get_running_loop()
        stream = _OutputStream(loop)
        is_session = hasattr(prompt, "__aiter__")
        command: _AddRequest | None = None
        if is_session:
            if sampling_params is not None and (
                not isinstance(sampling_params, SamplingParams) or sampling_params.n != 1
            ):
                raise ValueError("a streaming-input session needs SamplingParams with n=1")
            request_id = self._request_id_or_new(request_id)
        else:
            processed = self.input_processor.process(prompt, sampling_params)  # type: ignore[arg-type]
            request_id = self._request_id_or_new(request_id)
            requests = self.input_processor.make_requests(request_id, processed, time.monotonic())
            command = _AddRequest(request_id, processed, requests, stream)
        self._claim_request_id(request_id)
        input_task: asyncio.Task[None] | None = None
        ended = False
        try:
            if command is not None:
                self._submit(command)
            else:
                input_task = loop.create_task(
                    self._feed_session(request_id, prompt, sampling_params, stream)
                )  # type: ignore[arg-type]
            while not ended:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    ended = True
                    raise item
                ended = item.finished
                yield item
        finally:
            stream.closed = True
            if input_task is not None and not input_task.done():
                input_task.cancel()
            if not ended:
                self._abort_quietly(request_id, stream)
            with self._lock:
                self._live_request_ids.discard(request_id)

    async def abort(self, request_id: str | Iterable[str]) -> None:
        """Abort requests (unknown or finished ids are ignored). Each one's stream ends with a final output,
        finish_reason "abort", that keeps the tokens generated so far."""
        request_ids = [request_id] if isinstance(request_id, str) else list(request_id)
        done: Future[None] = Future()
        self._submit(_Abort(request_ids, done=done))
        await asyncio.wrap_future(done)

    async def pause_generation(self, mode: str = "abort", clear_cache: bool = True) -> None:
        """Pause: "abort" ends every request now (finish_reason "abort", partial output kept); "wait" lets running
        requests finish and holds new ones; "keep" freezes everything until `resume_generation`. Returns once the
        pause has taken effect (with `clear_cache`, after the prefix cache was reset and running requests were
        preempted to recompute after resume), or once a concurrent `resume_generation` released it."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        done: Future[None] = Future()
        self._submit(_Pause(mode, bool(clear_cache), done))
        await asyncio.wrap_future(done)

    async def resume_generation(self) -> None:
        """End the pause: held and frozen requests are scheduled again."""
        await self.run_in_engine(lambda core: core.resume_generation())

    async def is_paused(self) -> bool:
        return await self.run_in_engine(lambda core: core.is_paused())

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget cached prefixes; False while blocks are in use, unless `reset_running_requests` preempts every
        running request first (they recompute, outputs unchanged)."""
        return await self.run_in_engine(
            lambda core: core.reset_prefix_cache(reset_running_requests)
        )

    async def update_weights(self, weights: Any) -> int:
        """Reload weights (a checkpoint folder or a state dict) while paused; returns the new weight version.
        RuntimeError unless a pause has taken effect."""

        def update(core: EngineCore) -> int:
            if core.pause_effective():
                # A token-less report batch launched after the pause took effect may still be in flight (an
                # EngineCore without the fix for that); apply it so the core's "nothing in flight" check holds.
                self._process_engine_outputs(core.drain())
            return core.update_weights(weights)

        return await self.run_in_engine(update)

    async def run_in_engine(self, fn: Callable[[EngineCore], _T]) -> _T:
        """Run `fn(engine_core)` on the engine thread (the only thread that may touch the core) between steps and
        return its result; its exception is raised here. For inspection, administration and tests."""
        done: Future[_T] = Future()
        self._submit(_Call(fn, done))
        return await asyncio.wrap_future(done)

    def shutdown(self) -> None:
        """Stop the engine loop: live requests end with finish_reason "abort", the thread exits, and every later
        call raises `EngineDeadError`. Idempotent; blocks until the loop has stopped."""
        with self._lock:
            if self._closed_error is None:
                self._closed_error = EngineDeadError("AsyncLLM is shut down")
                self._commands.put(_Shutdown())
        if threading.current_thread() is not self._thread:
            self._thread.join(_SHUTDOWN_JOIN_S)
            if self._thread.is_alive():
                logger.warning(
                    "the AsyncLLM engine loop did not stop within %.0f s", _SHUTDOWN_JOIN_S
                )

    async def __aenter__(self) -> AsyncLLM:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await asyncio.to_thread(self.shutdown)

    # ------------------------------------------------------------------------------------------------ callers
    def _check_open(self) -> None:
        error = self._closed_error
        if error is not None:
            raise _dead_error(error)

    def _submit(self, command: _Command) -> None:
        with self._lock:
            if self._closed_error is not None:
                raise _dead_error(self._closed_error)
            self._commands.put(command)

    @staticmethod
    def _request_id_or_new(request_id: str | None) -> str:
        if request_id is None:
            return uuid.uuid4().hex
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        return request_id

    def _claim_request_id(self, request_id: str) -> None:
        with self._lock:
            if request_id in self._live_request_ids:
                raise ValueError(
                    f"request id {request_id!r} is already in use by a running request"
                )
            self._live_request_ids.add(request_id)

    def _abort_quietly(self, request_id: str, stream: _OutputStream) -> None:
        """Abort the request of a consumer that went away (a no-op if the engine already finished it)."""
        with contextlib.suppress(EngineDeadError):
            self._submit(_Abort([request_id], stream=stream))

    async def _feed_session(
        self,
        request_id: str,
        inputs: AsyncIterable[StreamingInput],
        sampling_params: SamplingParams | None,
        stream: _OutputStream,
    ) -> None:
        """The session's input task: validate each chunk as it comes and send it to the engine; close the session
        when the iterator ends. Cancelled when the consumer goes away or the session ends."""
        params = sampling_params
        first = True
        try:
            async for item in inputs:
                if not isinstance(item, StreamingInput):
                    raise ValueError(
                        f"a streaming input yields StreamingInput items, got {type(item).__name__}"
                    )
                if item.sampling_params is not None:
                    params = item.sampling_params
                processed = self.input_processor.process(item.prompt, params)
                [request] = self.input_processor.make_requests(
                    request_id, processed, time.monotonic(), resumable=True
                )
                self._submit(_SessionInput(request_id, stream, processed, request, first=first))
                first = False
            if first:
                raise ValueError("the streaming input ended before its first chunk")
            self._submit(_SessionInput(request_id, stream, None, None))
        except Exception as error:  # CancelledError (the consumer left) is not caught
            try:
                self._submit(_EndSession(request_id, stream, error))
            except EngineDeadError as dead:
                stream.queue.put_nowait(dead)  # we are on the consumer's loop

    # ------------------------------------------------------------------------------------------------ engine loop
    def _run_engine_loop(self) -> None:
        core = self.engine_core
        error: BaseException | None = None
        try:
            while self._running:
                self._handle_commands(block=not core.can_make_progress())
                if not self._running:
                    break
                if core.can_make_progress() or (core.is_paused() and not core.pause_effective()):
                    self._process_engine_outputs(core.step())
                self._release_pause_waiters()
        except BaseException as exc:  # the loop must never leave a consumer waiting
            logger.exception("the AsyncLLM engine loop failed")
            error = exc
        self._stop(error)

    def _handle_commands(self, block: bool) -> None:
        try:
            command = (
                self._commands.get(timeout=_IDLE_WAIT_S) if block else self._commands.get_nowait()
            )
        except queue.Empty:
            return
        while True:
            self._current_command = command  # failed with the others if handling it kills the loop
            self._handle(command)
            self._current_command = None
            if not self._running:
                return
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _handle(self, command: _Command) -> None:
        """Run one command. A failing command with a caller future fails that caller only; other failures are
        engine errors."""
        if isinstance(command, _AddRequest | _SessionInput) and command.stream.closed:
            return  # its consumer has gone already: nobody would read (or abort) it
        if isinstance(command, _AddRequest):
            self._add_request(command)
        elif isinstance(command, _SessionInput):
            self._session_input(command)
        elif isinstance(command, _EndSession):
            session = self._sessions.get(command.request_id)
            if session is not None and session.stream is command.stream:
                self._end_session(session, command.error)
            else:
                command.stream.put(command.error)  # it never started (or already ended)
        elif isinstance(command, _Abort):
            for request_id in command.request_ids:
                if command.stream is None or self._streams.get(request_id) is command.stream:
                    self._abort_request(request_id)
            _resolve(command.done)
        elif isinstance(command, _Pause):
            try:
                self._process_engine_outputs(
                    self.engine_core.pause_generation(command.mode, command.clear_cache)
                )
            except Exception as exc:
                _resolve(command.done, error=exc)
                return
            self._pause_waiters.append(command.done)
        elif isinstance(command, _Call):
            try:
                result = command.fn(self.engine_core)
            except Exception as exc:
                _resolve(command.done, error=exc)
                return
            _resolve(command.done, result)
        elif isinstance(command, _Shutdown):
            self._running = False

    def _release_pause_waiters(self) -> None:
        core = self.engine_core
        if self._pause_waiters and (not core.is_paused() or core.pause_effective()):
            waiters, self._pause_waiters = self._pause_waiters, []
            for waiter in waiters:
                _resolve(waiter)

    # ------------------------------------------------------------------------------------------------ requests
    def _add_request(self, command: _AddRequest) -> None:
        """Queue a prompt's core requests (n children for `n > 1`) and register its stream; all or nothing."""
        processed, request_id = command.processed, command.request_id
        parent = None
        added: list[str] = []
        try:
            if len(command.requests) > 1:
                parent = self.output_processor.add_parent_request(
                    request_id,
                    len(command.requests),
                    processed.prompt,
                    processed.prompt_token_ids,
                    processed.sampling_params.output_kind,
                    command.requests[0].arrival_time,
                )
            for index, request in enumerate(command.requests):
                self.engine_core.add_request(request)
                added.append(request.request_id)
                self.output_processor.add_request(
                    request.request_id,
                    processed.prompt,
                    processed.prompt_token_ids,
                    request.sampling_params,
                    request.arrival_time,
                    parent=parent,
                    index=index,
                )
        except ValueError as exc:
            self.engine_core.abort_requests(added)
            self.output_processor.abort_requests(added)
            self.output_processor.parent_requests.pop(request_id, None)
            command.stream.put(exc)
            return
        self._streams[request_id] = command.stream

    def _abort_request(self, request_id: str) -> None:
        """Abort one user request (its n children, or a whole session) and send its final "abort" output."""
        session = self._sessions.get(request_id)
        self.engine_core.abort_requests(self.output_processor.core_request_ids(request_id))
        for output in self.output_processor.abort_requests([request_id]):
            self._deliver(output, chunk_end=False)
        if (
            session is not None and self._sessions.get(request_id) is session
        ):  # it idled between chunks
            self._forget(request_id)
            session.stream.put(_closing_output(session, "abort"))
        logger.debug("aborted request %s", request_id)

    def _process_engine_outputs(self, engine_outputs: list[EngineCoreOutput]) -> None:
        """Turn one step's core outputs into RequestOutputs and deliver them; feed sessions whose chunk ended."""
        if not engine_outputs:
            return
        chunk_ends: list[str] = []
        ended_sessions: dict[str, str | None] = {}
        for_processor: list[EngineCoreOutput] = []
        for engine_output in engine_outputs:
            if engine_output.session_continues:
                chunk_ends.append(engine_output.request_id)
                # To the output processor the chunk is finished: it flushes text and builds the chunk's last output.
                engine_output = dataclasses.replace(engine_output, session_continues=False)
            elif engine_output.finished and engine_output.request_id in self._sessions:
                ended_sessions[engine_output.request_id] = engine_output.finish_reason
            for_processor.append(engine_output)
        processed = self.output_processor.process_outputs(for_processor)
        if processed.reqs_to_abort:
            self.engine_core.abort_requests(
                processed.reqs_to_abort
            )  # stop strings (this ends a session, too)
        chunk_end_ids = set(chunk_ends)
        for request_output in processed.request_outputs:
            self._deliver(request_output, request_output.request_id in chunk_end_ids)
        for request_id, finish_reason in ended_sessions.items():
            session = self._sessions.get(request_id)
            if (
                session is not None
            ):  # ended in the core while idle between chunks: no output of its own
                self._forget(request_id)
                session.stream.put(_closing_output(session, finish_reason))
        for request_id in chunk_ends:
            session = self._sessions.get(request_id)
            if session is not None:
                session.chunk_running = False
                self._feed_session_chunks(session)

    def _deliver(self, request_output: RequestOutput, chunk_end: bool) -> None:
        request_id = request_output.request_id
        stream = self._streams.get(request_id)
        if stream is None:
            return
        session = self._sessions.get(request_id)
        if session is not None and chunk_end and request_output.finished:
            request_output.finished = False  # the chunk ended; the session goes on
            session.last_output = request_output
        if not stream.put(request_output):
            logger.warning("the event loop of request %s is closed: aborting it", request_id)
            self._abort_request(request_id)
            return
        if request_output.finished:
            self._forget(request_id)

    def _forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self._sessions.pop(request_id, None)

    # ------------------------------------------------------------------------------------------------ sessions
    def _session_input(self, command: _SessionInput) -> None:
        if command.first:
            assert command.request is not None and command.processed is not None
            session = _Session(
                command.request_id, command.stream, command.processed.sampling_params.output_kind
            )
            self._streams[command.request_id] = command.stream
            self._sessions[command.request_id] = session
            self._submit_chunk(session, command)
            return
        session = self._sessions.get(command.request_id)
        if session is None or session.stream is not command.stream:
            return  # the session already ended (aborted, failed or stopped)
        session.pending.append(command)
        self._feed_session_chunks(session)

    def _feed_session_chunks(self, session: _Session) -> None:
        """Hand the session's waiting chunks (and close) to the core, one chunk per chunk boundary."""
        while session.pending and self._sessions.get(session.request_id) is session:
            command = session.pending[0]
            if command.request is not None and session.chunk_running:
                return  # the next chunk waits for the running one to end
            session.pending.popleft()
            if command.request is None:
                self._close_session(session)
                return
            self._submit_chunk(session, command)

    def _submit_chunk(self, session: _Session, command: _SessionInput) -> None:
        request, processed = command.request, command.processed
        assert request is not None and processed is not None
        try:
            self.engine_core.add_request(
                request
            )  # ValueError when the session would outgrow max_model_len
        except ValueError as exc:
            self._end_session(session, exc)
            return
        session.in_core = True
        self.output_processor.add_request(
            session.request_id,
            processed.prompt,
            processed.prompt_token_ids,
            request.sampling_params,
            request.arrival_time,
        )
        session.output_kind = request.sampling_params.output_kind
        session.chunk_running = True

    def _close_session(self, session: _Session) -> None:
        request_id = session.request_id
        scheduler_requests = self.engine_core.scheduler.requests
        if request_id in scheduler_requests:
            self.engine_core.add_request(Request(request_id, [], SamplingParams(), resumable=False))
            if request_id in scheduler_requests:
                return  # a chunk runs: the output that ends it ends the session
        self._forget(request_id)  # it idled: the core ended it at once, without an output
        session.stream.put(_closing_output(session, None))

    def _end_session(self, session: _Session, error: BaseException) -> None:
        """End a session with an error: abort it in the core, drop its outputs, raise `error` in its consumer."""
        self._forget(session.request_id)
        if session.in_core:
            self.engine_core.abort_requests([session.request_id])
            self.output_processor.abort_requests([session.request_id])
        session.stream.put(error)

    # ------------------------------------------------------------------------------------------------ stop
    def _stop(self, error: BaseException | None) -> None:
        """Leave nobody waiting: on shutdown abort live requests; on error fail them; then fail queued commands."""
        with self._lock:
            if error is not None:
                dead = EngineDeadError(f"the AsyncLLM engine loop failed: {error!r}")
                dead.__cause__ = error
                self._closed_error = dead
            elif self._closed_error is None:
                self._closed_error = EngineDeadError("AsyncLLM is shut down")
            closed_error = self._closed_error
        if error is None:
            try:
                for request_id in list(self._streams):
                    self._abort_request(request_id)
            except Exception:  # a broken core: the consumers left get the error below
                logger.exception("aborting live requests at shutdown failed")
        for stream in self._streams.values():
            stream.put(_dead_error(closed_error))
        self._streams.clear()
        self._sessions.clear()
        for waiter in self._pause_waiters:
            _resolve(waiter, error=_dead_error(closed_error))
        self._pause_waiters.clear()
        unhandled = [self._current_command] if self._current_command is not None else []
        while True:  # commands queued before the close was published; nothing can be added after it
            try:
                unhandled.append(self._commands.get_nowait())
            except queue.Empty:
                break
        for command in unhandled:
            if isinstance(command, _AddRequest | _SessionInput | _EndSession):
                command.stream.put(_dead_error(closed_error))
            elif isinstance(command, _Abort | _Pause | _Call):
                _resolve(command.done, error=_dead_error(closed_error))
        try:
            self.engine_core.shutdown()
        except Exception:
            logger.exception("engine core shutdown failed")
        logger.info("AsyncLLM engine loop stopped")


def _dead_error(error: EngineDeadError) -> EngineDeadError:
    """A fresh copy of the engine's closing error for one caller (tracebacks are per raise)."""
    copy = EngineDeadError(*error.args)
    copy.__cause__ = error.__cause__
    return copy


def _closing_output(session: _Session, finish_reason: str | None) -> RequestOutput:
    """The final output of a session that ended while idle between chunks: the last chunk's final state (no tokens
    for "delta"), `finished=True`, with `finish_reason` if given."""
    last = session.last_output
    if last is None:
        return RequestOutput(
            session.request_id, None, [], [CompletionOutput(0, "", [], finish_reason)], True
        )
    completions = []
    for completion in last.outputs:
        if session.output_kind == "delta":
            completion = dataclasses.replace(
                completion,
                text="",
                token_ids=[],
                logprobs=[] if completion.logprobs is not None else None,
            )
        if finish_reason is not None:
            completion = dataclasses.replace(
                completion, finish_reason=finish_reason, stop_reason=None
            )
        completions.append(completion)
    return dataclasses.replace(last, outputs=completions, finished=True)
