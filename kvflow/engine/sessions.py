"""Streaming-input sessions, front-end side: the state machine that feeds one resumable core request chunk by chunk.

A session is one core request (the consumer's request id, `resumable=True`) that holds its KV blocks and worker
slot between chunks. The front end sends a chunk only while the session idles between chunks, so the core checks
each chunk's length on arrival; it streams each chunk's outputs as their own (cumulative / delta / final_only), and
ends the session when the input iterator ends, the input fails, or the request is aborted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterable, Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

import msgspec

from kvflow.engine.core_client import EngineDeadError, fresh_dead_error
from kvflow.engine.input_processor import PromptType
from kvflow.outputs import CompletionOutput, RequestOutput
from kvflow.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvflow.core.sched.output import EngineCoreOutput
    from kvflow.engine.core_client import EngineCoreClient
    from kvflow.engine.input_processor import InputProcessor, ProcessedPrompt
    from kvflow.engine.output_processor import OutputProcessor, OutputProcessorOutput
    from kvflow.engine.output_stream import OutputStream
    from kvflow.request import Request

logger = logging.getLogger(__name__)
_R = TypeVar("_R")


@dataclass
class StreamingInput:
    """One chunk of a streaming-input session: a prompt in any form `generate` accepts, and the sampling params for
    the tokens generated after it (None: those of the previous chunk; for the first chunk, `generate`'s own)."""

    prompt: PromptType
    sampling_params: SamplingParams | None = None


@dataclass
class _Chunk:
    processed: ProcessedPrompt
    request: Request


@dataclass
class Session:
    """Front-end state of one session.

    Invariants:
      * `chunk_running` is True from sending a chunk to the core until the output that ends that chunk;
      * `pending` holds chunks that arrived while another ran, then None for the end of input; a chunk leaves it
        only while no chunk runs, the end of input as soon as it reaches the head;
      * the output processor tracks one chunk at a time (registered when it is sent, dropped when it ends);
      * `last_output` is the previous chunk's last output (None before the first chunk ends).
    """

    request_id: str
    stream: OutputStream
    output_kind: str
    pending: deque[_Chunk | None] = field(default_factory=deque)
    chunk_running: bool = False
    last_output: RequestOutput | None = None


class SessionFeeder:
    """Every live session of one front end: feeds each session's chunks to the core one at a time and streams its
    outputs. (The core keeps its own table of sessions, `kvflow.core.sched.sessions`.) All methods run under the
    front end's `lock`, which also guards the output processor; Future callbacks take it themselves."""

    def __init__(
        self,
        client: EngineCoreClient,
        input_processor: InputProcessor,
        output_processor: OutputProcessor,
        lock: threading.RLock,
    ) -> None:
        self.client = client
        self.input_processor = input_processor
        self.output_processor = output_processor
        self.lock = lock
        self.sessions: dict[str, Session] = {}

    def __contains__(self, request_id: object) -> bool:
        return request_id in self.sessions

    # ------------------------------------------------------------------------------------------------ input
    async def feed(
        self,
        request_id: str,
        inputs: AsyncIterable[StreamingInput],
        sampling_params: SamplingParams | None,
        stream: OutputStream,
    ) -> None:
        """The session's input task: validate each chunk as it comes and send it on; end the input when the
        iterator does. Cancelled when the consumer goes away or the session ends."""
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
                with self.lock:
                    self._add_chunk(request_id, stream, _Chunk(processed, request), first)
                first = False
            if first:
                raise ValueError("the streaming input ended before its first chunk")
            with self.lock:
                self._end_input(request_id, stream)
        except Exception as error:  # CancelledError (the consumer left) is not caught
            with self.lock:
                self._fail_input(request_id, stream, error)

    def _add_chunk(self, request_id: str, stream: OutputStream, chunk: _Chunk, first: bool) -> None:
        if stream.closed:
            return  # the consumer has gone (its input task is being cancelled)
        if first:
            session = Session(request_id, stream, chunk.processed.sampling_params.output_kind)
            self.sessions[request_id] = session
            self._send_chunk(session, chunk)
            return
        session = self.sessions.get(request_id)
        if session is None or session.stream is not stream:
            return  # the session already ended (aborted, failed or stopped)
        session.pending.append(chunk)
        self._send_pending(session)

    def _end_input(self, request_id: str, stream: OutputStream) -> None:
        session = self.sessions.get(request_id)
        if session is not None and session.stream is stream:
            session.pending.append(None)
            self._send_pending(session)

    def _fail_input(self, request_id: str, stream: OutputStream, error: BaseException) -> None:
        session = self.sessions.get(request_id)
        if session is not None and session.stream is stream:
            self._end(session, error)
        else:
            stream.put(error)  # it never started (or already ended)

    # ------------------------------------------------------------------------------------------------ to the core
    def _send_pending(self, session: Session) -> None:
        """Send the session's waiting chunks (and end of input) to the core, one chunk per chunk boundary."""
        while session.pending and self.sessions.get(session.request_id) is session:
            chunk = session.pending[0]
            if chunk is not None and session.chunk_running:
                return  # the next chunk waits for the running one to end
            session.pending.popleft()
            if chunk is None:
                self._close(session)
                return
            self._send_chunk(session, chunk)

    def _send_chunk(self, session: Session, chunk: _Chunk) -> None:
        request, processed = chunk.request, chunk.processed
        self.output_processor.add_request(
            session.request_id,
            processed.prompt,
            processed.prompt_token_ids,
            request.sampling_params,
            request.arrival_time,
        )
        session.output_kind = request.sampling_params.output_kind
        # The previous chunk's outputs are never merged with this one's (its last has a finish reason).
        session.stream.delta = session.output_kind == "delta"
        session.chunk_running = True
        added = self._call(session, lambda: self.client.add_requests([request]))
        if added is not None:
            added.add_done_callback(lambda future: self._on_chunk_added(session, future))

    def _on_chunk_added(self, session: Session, future: Future[None]) -> None:
        """A chunk the core rejected (it would outgrow max_model_len) ends the session with that error."""
        error = future.exception()
        if error is None or isinstance(error, EngineDeadError):
            return  # a dead engine fails every session itself
        with self.lock:
            if self.sessions.get(session.request_id) is session:
                self._end(session, error)

    def _close(self, session: Session) -> None:
        closed = self._call(session, lambda: self.client.close_session(session.request_id))
        if closed is not None:
            closed.add_done_callback(lambda future: self._on_closed(session, future))

    def _on_closed(self, session: Session, future: Future[bool]) -> None:
        """The core ended an idle session at once (no output of its own): repeat its last state, finished.
        Otherwise the output that ends the running chunk ends the session."""
        if future.exception() is not None or not future.result():
            return
        with self.lock:
            if self.sessions.get(session.request_id) is session:
                self._forget(session)
                session.stream.put(_closing_output(session, None))

    def _call(self, session: Session, send: Callable[[], Future[_R]]) -> Future[_R] | None:
        """Send a message for the session; a dead engine ends the session with its error."""
        try:
            return send()
        except EngineDeadError as error:
            self._forget(session)
            session.stream.put(error)
            return None

    # ------------------------------------------------------------------------------------------------ endings
    def _end(self, session: Session, error: BaseException) -> None:
        """End a session with an error: abort it in the core, drop its outputs, raise `error` in its consumer."""
        self._forget(session)
        with contextlib.suppress(EngineDeadError):
            self.client.abort_requests([session.request_id])
        self.output_processor.abort_requests([session.request_id])
        session.stream.put(error)

    def abort(self, request_id: str) -> None:
        """Abort a session: its running chunk's final output, or (idle) a closing output, has reason "abort"."""
        session = self.sessions[request_id]
        with contextlib.suppress(EngineDeadError):
            self.client.abort_requests([request_id])
        for output in self.output_processor.abort_requests([request_id]):
            self._deliver(session, output, chunk_end=False)
        if self.sessions.get(request_id) is session:  # it idled between chunks
            self._forget(session)
            session.stream.put(_closing_output(session, "abort"))

    def fail_all(self, error: EngineDeadError) -> None:
        """The engine died: every session ends with its error."""
        for session in list(self.sessions.values()):
            self._forget(session)
            session.stream.put(fresh_dead_error(error))

    def _forget(self, session: Session) -> None:
        if self.sessions.get(session.request_id) is session:
            del self.sessions[session.request_id]

    # ------------------------------------------------------------------------------------------------ outputs
    def process_outputs(self, engine_outputs: list[EngineCoreOutput]) -> OutputProcessorOutput:
        """Turn sessions' core outputs into RequestOutputs and deliver them; send the next chunk of sessions whose
        chunk ended. Returns what the output processor made of them (the caller aborts `reqs_to_abort`, the core
        requests a stop string ended, in the core)."""
        chunk_end_ids: set[str] = set()
        ended_sessions: dict[str, str | None] = {}
        for_processor: list[EngineCoreOutput] = []
        for engine_output in engine_outputs:
            if engine_output.session_continues:
                chunk_end_ids.add(engine_output.request_id)
                # To the output processor the chunk is finished: it flushes text, builds the chunk's last output.
                engine_output = msgspec.structs.replace(engine_output, session_continues=False)
            elif engine_output.finished:
                ended_sessions[engine_output.request_id] = engine_output.finish_reason
            for_processor.append(engine_output)
        processed = self.output_processor.process_outputs(for_processor)
        for request_output in processed.request_outputs:
            session = self.sessions.get(request_output.request_id)
            if session is not None:
                self._deliver(session, request_output, request_output.request_id in chunk_end_ids)
        for request_id, finish_reason in ended_sessions.items():
            session = self.sessions.get(request_id)
            if (
                session is not None
            ):  # ended in the core while idle between chunks: no output of its own
                self._forget(session)
                session.stream.put(_closing_output(session, finish_reason))
        for request_id in chunk_end_ids:
            session = self.sessions.get(request_id)
            if session is not None:
                session.chunk_running = False
                self._send_pending(session)
        return processed

    def _deliver(self, session: Session, request_output: RequestOutput, chunk_end: bool) -> None:
        if chunk_end and request_output.finished:
            request_output.finished = False  # the chunk ended; the session goes on
            session.last_output = request_output
        if not session.stream.put(request_output):
            logger.warning(
                "the event loop of session %s is closed: aborting it", session.request_id
            )
            self._end(session, RuntimeError("the consumer's event loop is closed"))
            return
        if request_output.finished:
            self._forget(session)


def _closing_output(session: Session, finish_reason: str | None) -> RequestOutput:
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
