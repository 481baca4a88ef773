"""AsyncLLM: the asyncio front end. An engine-core client runs the core; coroutines stream its outputs.

    llm = AsyncLLM()
    async for output in llm.generate("Hello", SamplingParams(max_tokens=32, output_kind="delta")):
        print(output.outputs[0].text, end="")

Streaming-input sessions feed one request chunk by chunk from an async iterator of `StreamingInput`; the request
keeps its KV blocks and worker slot between chunks (see `AsyncLLM.generate` and `kvflow.engine.sessions`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterable, Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, TypeVar

from kvflow.beam_search import BeamSearchState, step_sampling_params
from kvflow.engine.arg_utils import EngineArgs
from kvflow.engine.builder import build_frontend, resolve_engine_config, start_engine_core_client
from kvflow.engine.core import PAUSE_MODES
from kvflow.engine.death import EngineDeadError, fresh_dead_error
from kvflow.engine.input_processor import check_lora_request, check_priority
from kvflow.engine.output_stream import OutputStream, Wakeups
from kvflow.engine.sessions import SessionFeeder, StreamingInput
from kvflow.engine.stat_logger import LoggingStatLogger
from kvflow.pooling.frontend import pooled_output, pooling_spec_of, supported_tasks, with_task
from kvflow.pooling_params import PoolingParams
from kvflow.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvflow.beam_search import BeamSearchOutput
    from kvflow.core.sched.output import EngineCoreOutput, SchedulerStats
    from kvflow.engine.core import EngineCore
    from kvflow.engine.input_processor import ProcessedPrompt, PromptType
    from kvflow.engine.stats import StatLogger
    from kvflow.lora.request import LoRARequest
    from kvflow.outputs import PoolingRequestOutput, RequestOutput
    from kvflow.sampling_params import BeamSearchParams
    from kvflow.tokenizer import Tokenizer

__all__ = ["AsyncLLM", "EngineDeadError", "StreamingInput"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
# Prompts with at least this many samples are added to the engine from a worker thread.
_ADD_OFF_LOOP_MIN_N = 16


class AsyncLLM:
    """The asyncio front end of one engine.

    `AsyncLLM(model=None, **kwargs)` takes the same `EngineArgs` options as `LLM`. The front end keeps the
    tokenizer, the output processor and one `OutputStream` per live request; the engine core runs behind an
    `EngineCoreClient` (in-process on its own thread, or with `engine_process=True` in its own process, as
    `kvflow serve` runs it; with `data_parallel_size > 1`, several cores in their own processes behind
    `DPEngineCoreClient`), whose output handler turns each step's core outputs into `RequestOutput`s for the
    consumers. Consumers may run on any event loop (a stream remembers the loop that started it). `num_kv_blocks`
    is the KV cache the core allocated. Stop with `shutdown()` or by using the engine as an async context manager.

    Invariants:
      * `_lock` guards the streams, the sessions and the output processor: the client's output handler and the
        consumers' loops both use them;
      * every `generate` call ends: with a finished output, with the exception that ended it, or with an
        `EngineDeadError` when the engine stops; a consumer that goes away (cancelled, closed, or broken out
        of) aborts its request, which frees its KV blocks and worker slot;
      * a request id is live from the start of its `generate` (or `beam_search`) until that call ends, and no two
        live requests share one (ValueError); `_beam_searches` holds exactly the live beam searches;
      * after an engine error or `shutdown`, every call raises `EngineDeadError`.
    """

    def __init__(
        self, model: str | None = None, *, stat_loggers: Sequence[StatLogger] = (), **kwargs: Any
    ) -> None:
        """`kwargs` are the `EngineArgs` options (unknown names are a TypeError, bad values a ValueError).
        `stat_loggers` are metrics backends fed after every step (besides the stats log line, unless
        `disable_log_stats`)."""
        engine_args = EngineArgs(model=model, **kwargs)
        model_info, engine_config = resolve_engine_config(engine_args)
        parts = build_frontend(engine_args, model_info, engine_config)
        self.engine_config = parts.engine_config
        self.model_info = parts.model_info
        self.tokenizer = parts.tokenizer
        self.input_processor = parts.input_processor
        self.output_processor = parts.output_processor
        self._lock = threading.RLock()
        self._streams: dict[str, OutputStream] = {}
        self._live_request_ids: set[str] = set()
        # Adapters the engine has loaded (and so checked) for this front end: later requests naming them are queued
        # without that round trip (the worker reloads an evicted adapter from its folder itself).
        self._checked_loras: set[LoRARequest] = set()
        self._beam_searches: dict[str, _BeamSearchRun] = {}
        self._stat_loggers: list[StatLogger] = list(stat_loggers)
        if not engine_args.disable_log_stats:
            self._stat_loggers.append(LoggingStatLogger())
        self.data_parallel_size = engine_args.data_parallel_size
        self.engine_core_client, self.num_kv_blocks = start_engine_core_client(
            parts,
            self._process_engine_outputs,
            self._fail_all,
            engine_args.engine_process,
            engine_args.data_parallel_size,
        )
        self._sessions = SessionFeeder(
            self.engine_core_client, self.input_processor, self.output_processor, self._lock
        )

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> AsyncLLM:
        return cls(**dataclasses.asdict(engine_args))

    # ------------------------------------------------------------------------------------------------ public
    def get_tokenizer(self) -> Tokenizer | None:
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The SamplingParams of a `generate` call without any: kvflow's defaults overridden by the model's
        generation_config.json unless `generation_config="kvflow"` (see `LLM.get_default_sampling_params`)."""
        return self.input_processor.get_default_sampling_params()

    @property
    def errored(self) -> bool:
        """True once the engine failed (not after a clean shutdown)."""
        error = self.engine_core_client.dead_error
        return error is not None and error.__cause__ is not None

    async def generate(
        self,
        prompt: PromptType | AsyncIterable[StreamingInput],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        trace_headers: Mapping[str, str] | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Stream `RequestOutput`s for one prompt as tokens arrive; the last has `finished=True`.

        `lora_request` (needs `enable_lora=True`): the adapter it runs with (loaded, and checked, before the
        request is queued: a bad adapter is a ValueError naming what is wrong); not with streaming input.
        `trace_headers`: W3C trace context (`traceparent`, `tracestate`) the request's span joins when the engine
        traces (`otlp_traces_endpoint`, `kvflow.tracing`); a streaming-input session's span starts a trace.

        `SamplingParams.output_kind` picks cumulative outputs (default), "delta" (only the new tokens and text) or
        "final_only" (just the finished output); `n > 1` folds the samples into one output per step. `priority`
        (lower runs first) needs `scheduling_policy="priority"`. A bad prompt or parameter, or a `request_id` that
        is live, raises ValueError before anything is queued. While the engine is paused the request waits
        (queued) until `resume_generation`.

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
        check_priority(priority, self.engine_config.scheduler_config.policy)
        lora_request = check_lora_request(lora_request, self.engine_config.lora_config is not None)
        stream = OutputStream(asyncio.get_running_loop())
        is_session = hasattr(prompt, "__aiter__")
        if is_session and lora_request is not None:
            raise ValueError(
                "lora_request is not supported with streaming input (a StreamingInput iterator)"
            )
        if lora_request is not None and lora_request not in self._checked_loras:
            await self._await(self.engine_core_client.add_lora(lora_request))
            self._checked_loras.add(lora_request)
        processed: ProcessedPrompt | None = None
        if is_session:
            if sampling_params is not None and (
                not isinstance(sampling_params, SamplingParams) or sampling_params.n != 1
            ):
                raise ValueError("a streaming-input session needs SamplingParams with n=1")
        else:
            processed = self.input_processor.process(prompt, sampling_params)  # type: ignore[arg-type]
            stream.delta = processed.sampling_params.output_kind == "delta"
        request_id = self._claim_request_id(request_id)
        input_task: asyncio.Task[None] | None = None
        ended = False
        try:
            if processed is not None:
                await self._add_prompt(
                    request_id, processed, stream, priority, lora_request, trace_headers
                )
            else:
                input_task = stream.loop.create_task(
                    self._sessions.feed(request_id, prompt, sampling_params, stream)  # type: ignore[arg-type]
                )
            while not ended:
                item = await stream.get()
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
                self._abort_if_owned(request_id, stream)
            with self._lock:
                self._live_request_ids.discard(request_id)

    @property
    def supported_tasks(self) -> tuple[str, ...]:
        """("generate",) with the generate runner, else the pooling model's tasks (see `LLM.supported_tasks`)."""
        return supported_tasks(self.engine_config)

    async def encode(
        self,
        prompt: PromptType,
        pooling_params: PoolingParams,
        request_id: str | None = None,
        priority: int = 0,
        trace_headers: Mapping[str, str] | None = None,
    ) -> AsyncGenerator[PoolingRequestOutput, None]:
        """Pool one prompt (runner "pooling"): yields its one finished `PoolingRequestOutput`.

        `pooling_params.task` says what `outputs.data` holds ("embed", "classify", "score" or "encode"; None: the
        model's first task). A prompt is a string, `{"prompt_token_ids": [...]}`, or a cross-encoder's text pair
        `{"prompt_token_ids": [...], "token_type_ids": [...]}` (`Tokenizer.encode_pair`). A bad prompt or parameter
        raises ValueError before anything is queued; a request that ends without its result (aborted) raises
        `PoolingRequestEndedError`. Leaving the generator early aborts the request. `trace_headers`: as for
        `generate`."""
        self._check_open()
        check_priority(priority, self.engine_config.scheduler_config.policy)
        if not isinstance(pooling_params, PoolingParams):
            raise ValueError(
                f"pooling_params must be PoolingParams, got {type(pooling_params).__name__}"
            )
        task = pooling_params.task or self.supported_tasks[0]
        spec = pooling_spec_of(self.engine_config, task)
        processed = self.input_processor.process_pooling(
            prompt, with_task(pooling_params, task), spec
        )
        stream = OutputStream(asyncio.get_running_loop())
        request_id = self._claim_request_id(request_id)
        ended = False
        try:
            await self._add_prompt(request_id, processed, stream, priority, None, trace_headers)
            while not ended:
                item = await stream.get()
                if isinstance(item, BaseException):
                    ended = True
                    raise item
                ended = item.finished
                if ended:
                    yield pooled_output(item)
        finally:
            stream.closed = True
            if not ended:
                self._abort_if_owned(request_id, stream)
            with self._lock:
                self._live_request_ids.discard(request_id)

    async def beam_search(
        self,
        prompt: PromptType,
        request_id: str | None,
        params: BeamSearchParams,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> BeamSearchOutput:
        """Beam search for one prompt (vLLM's algorithm, `kvflow.beam_search`, the same as `LLM.beam_search`): each
        step runs one one-token request per live beam, concurrently, asking `2 * beam_width` logprobs, so beams
        share their prefix through the prefix cache. Returns the best `beam_width` sequences, best first.

        A bad prompt or parameter (`2 * beam_width` over `max_logprobs`, a prompt with no room for `max_tokens`
        under `max_model_len`, a live `request_id`) raises ValueError before any step runs. The step requests are
        `<request_id>-<step>-<beam>`. `abort(request_id)` (or `pause_generation(mode="abort")`) ends the search at
        its current step: its live beams finish with "abort". Cancelling the coroutine aborts the step requests in
        flight. With `lora_request` every beam runs with that adapter.
        """
        self._check_open()
        check_priority(priority, self.engine_config.scheduler_config.policy)
        lora_request = check_lora_request(lora_request, self.engine_config.lora_config is not None)
        processed = self.input_processor.process(prompt, step_sampling_params(params))
        num_tokens = len(processed.prompt_token_ids) + params.max_tokens
        if num_tokens > self.input_processor.max_model_len:
            raise ValueError(
                f"BeamSearchParams.max_tokens={params.max_tokens} after a prompt of "
                f"{len(processed.prompt_token_ids)} tokens needs {num_tokens} positions; "
                f"max_model_len={self.input_processor.max_model_len}"
            )
        state = BeamSearchState(
            [processed.prompt_token_ids], params, self.input_processor.eos_token_id
        )
        request_id = self._claim_request_id(request_id)
        run = _BeamSearchRun()
        with self._lock:
            self._beam_searches[request_id] = run
        try:
            while not state.finished:
                outputs = await self._beam_search_step(
                    request_id, run, state, priority, lora_request
                )
                if outputs is None:
                    state.stop("abort")
                else:
                    state.advance(outputs)
        finally:
            with self._lock:
                del self._beam_searches[request_id]
                self._live_request_ids.discard(request_id)
        return state.results(self.tokenizer)[0]

    async def abort(self, request_id: str | Iterable[str]) -> None:
        """Abort requests (unknown or finished ids are ignored). Each one's stream ends with a final output,
        finish_reason "abort", that keeps the tokens generated so far."""
        request_ids = [request_id] if isinstance(request_id, str) else list(request_id)
        with self._lock:
            for each_id in request_ids:
                self._abort_request(each_id)
        # Messages apply in order: once this empty abort is done, the core has applied the ones above.
        await self._await(self.engine_core_client.abort_requests([]))

    async def pause_generation(self, mode: str = "abort", clear_cache: bool = True) -> None:
        """Pause (semantics: `kvflow.engine.core.Pause`). Returns once the pause has taken effect (with
        `clear_cache`, after the prefix cache was reset), or once a concurrent `resume_generation` released it."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        await self._await(self.engine_core_client.pause_generation(mode, bool(clear_cache)))

    async def resume_generation(self) -> None:
        """End the pause: held and frozen requests are scheduled again."""
        await self._await(self.engine_core_client.resume_generation())

    async def is_paused(self) -> bool:
        return await self._await(self.engine_core_client.is_paused())

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget cached prefixes; False while blocks are in use, unless `reset_running_requests` preempts every
        running request first (they recompute, outputs unchanged)."""
        return await self._await(self.engine_core_client.reset_prefix_cache(reset_running_requests))

    # ------------------------------------------------------------------------------------------------ LoRA
    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter now (ValueError naming what is wrong for a bad one); True once every core holds it."""
        check_lora_request(lora_request, self.engine_config.lora_config is not None)
        return await self._await(self.engine_core_client.add_lora(lora_request))

    async def remove_lora(self, lora_int_id: int) -> bool:
        """Drop an adapter from the engine's cache; requests still running with it load it again from its path
        and finish normally. True when it was loaded."""
        self._checked_loras = {r for r in self._checked_loras if r.lora_int_id != lora_int_id}
        return await self._await(self.engine_core_client.remove_lora(lora_int_id))

    async def pin_lora(self, lora_int_id: int) -> bool:
        return await self._await(self.engine_core_client.pin_lora(lora_int_id))

    async def list_loras(self) -> set[int]:
        return await self._await(self.engine_core_client.list_loras())

    async def update_weights(self, weights: Any) -> int:
        """Reload weights (a checkpoint folder, or in-process only a state dict) while paused; returns the new
        weight version. RuntimeError unless a pause has taken effect."""
        return await self._await(self.engine_core_client.update_weights(weights))

    async def run_in_engine(self, fn: Callable[[EngineCore], _T]) -> _T:
        """Run `fn(engine_core)` where the core runs, between steps, and return its result; its exception is
        raised here. For inspection, administration and tests. With `engine_process`, `fn` and its result travel
        with cloudpickle (the result is a copy). With `data_parallel_size > 1` this is a ValueError: use
        `run_in_each_engine`."""
        return await self._await(self.engine_core_client.run(fn))

    async def run_in_each_engine(self, fn: Callable[[EngineCore], _T]) -> list[_T]:
        """`run_in_engine` on every engine core (one, or `data_parallel_size`); their results in core order."""
        return await self._await(self.engine_core_client.run_each(fn))

    async def scheduler_stats(self) -> list[SchedulerStats]:
        """A snapshot of every core's scheduler now, in core order (each with its `engine_index`)."""
        snapshots = await self.run_in_each_engine(_make_stats)
        for index, stats in enumerate(snapshots):
            stats.engine_index = index
        return snapshots

    async def collective_rpc(
        self,
        method: str | Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """Run a worker method (by name, or a callable taking the worker as its first argument) on every rank,
        between engine steps; returns the results in rank order (with `data_parallel_size > 1`: every core's ranks,
        core after core). With `engine_process`, a callable, the arguments and the results travel with
        cloudpickle."""
        return await self._await(self.engine_core_client.collective_rpc(method, args, kwargs))

    def shutdown(self) -> None:
        """Stop the engine: live requests end with finish_reason "abort", the core stops, and every later call
        raises `EngineDeadError`. Idempotent; blocks until the core has stopped."""
        with self._lock:
            if self.engine_core_client.dead_error is None:
                for request_id in [*self._streams, *self._sessions.sessions]:
                    self._abort_request(request_id)
        self.engine_core_client.shutdown()

    async def __aenter__(self) -> AsyncLLM:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await asyncio.to_thread(self.shutdown)

    # ------------------------------------------------------------------------------------------------ callers
    def _check_open(self) -> None:
        error = self.engine_core_client.dead_error
        if error is not None:
            raise fresh_dead_error(error)

    @staticmethod
    async def _await(future: Future[_T]) -> _T:
        return await asyncio.wrap_future(future)

    def _claim_request_id(self, request_id: str | None) -> str:
        if request_id is None:
            request_id = uuid.uuid4().hex
        elif not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        with self._lock:
            if request_id in self._live_request_ids:
                raise ValueError(
                    f"request id {request_id!r} is already in use by a running request"
                )
            self._live_request_ids.add(request_id)
        return request_id

    async def _add_prompt(
        self,
        request_id: str,
        processed: ProcessedPrompt,
        stream: OutputStream,
        priority: int,
        lora_request: LoRARequest | None = None,
        trace_headers: Mapping[str, str] | None = None,
    ) -> None:
        """`_add_request`, on a worker thread when the prompt expands into many samples (their requests, output
        states and messages grow with `n`), so that a large `n` does not stall the event loop. A consumer
        cancelled meanwhile waits for the add to finish, so that its abort finds the request."""
        add = (request_id, processed, stream, priority, lora_request, trace_headers)
        if processed.sampling_params.n < _ADD_OFF_LOOP_MIN_N:
            self._add_request(*add)
            return
        added = asyncio.ensure_future(asyncio.to_thread(self._add_request, *add))
        try:
            await asyncio.shield(added)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await added
            raise

    def _add_request(
        self,
        request_id: str,
        processed: ProcessedPrompt,
        stream: OutputStream,
        priority: int,
        lora_request: LoRARequest | None = None,
        trace_headers: Mapping[str, str] | None = None,
    ) -> None:
        """Register the prompt's outputs and stream, then queue its core requests (n children for `n > 1`)."""
        requests = self.input_processor.make_requests(
            request_id, processed, time.monotonic(), priority=priority, lora_request=lora_request
        )
        with self._lock:
            self.output_processor.add_prompt(request_id, processed, requests, trace_headers)
            self._streams[request_id] = stream
            try:
                added = self.engine_core_client.add_requests(requests)
            except EngineDeadError:
                self._forget(request_id)
                self.output_processor.abort_requests([request_id])
                raise
        added.add_done_callback(lambda future: self._on_added(request_id, stream, future))

    def _on_added(self, request_id: str, stream: OutputStream, future: Future[None]) -> None:
        """The core rejected the prompt (ValueError): it never ran; end its stream with that error."""
        error = future.exception()
        if error is None or isinstance(error, EngineDeadError):
            return  # a dead engine fails every stream itself
        with self._lock:
            if self._streams.get(request_id) is stream:
                self._forget(request_id)
                self.output_processor.abort_requests([request_id])
                stream.put(error)

    def _abort_if_owned(self, request_id: str, stream: OutputStream) -> None:
        """Abort the request of a consumer that went away, unless the id has moved on to another stream."""
        with self._lock:
            owner = self._streams.get(request_id)
            session = self._sessions.sessions.get(request_id)
            if owner is stream or (session is not None and session.stream is stream):
                self._abort_request(request_id)

    def _abort_request(self, request_id: str) -> None:
        """Abort one user request (its n children, a whole session, or a beam search's step in flight) and send
        its final "abort" output. Caller holds the lock."""
        run = self._beam_searches.get(request_id)
        if run is not None:
            run.aborted = True
            for step_request_id in run.step_request_ids:
                self._abort_request(step_request_id)
        elif request_id in self._sessions:
            self._sessions.abort(request_id)
        else:
            core_request_ids = self.output_processor.core_request_ids(request_id)
            with contextlib.suppress(EngineDeadError):  # a dead engine has freed everything
                self.engine_core_client.abort_requests(core_request_ids)
            for output in self.output_processor.abort_requests([request_id]):
                self._deliver(output)
        logger.debug("aborted request %s", request_id)

    # ------------------------------------------------------------------------------------------------ beam search
    async def _beam_search_step(
        self,
        request_id: str,
        run: _BeamSearchRun,
        state: BeamSearchState,
        priority: int,
        lora_request: LoRARequest | None = None,
    ) -> list[RequestOutput] | None:
        """Run one step of `state` (its requests concurrently) and return their final outputs; None when the
        search was aborted before the step. A step that fails or is cancelled cancels its other requests, which
        aborts them."""
        beams = state.requests()
        with self._lock:
            if run.aborted:
                return None
            run.step_request_ids = [
                f"{request_id}-{state.num_steps}-{index}" for index in range(len(beams))
            ]
        tasks = [
            asyncio.ensure_future(
                self._final_output(
                    {"prompt_token_ids": tokens},
                    state.step_params,
                    step_request_id,
                    priority,
                    lora_request,
                )
            )
            for tokens, step_request_id in zip(beams, run.step_request_ids, strict=True)
        ]
        try:
            return await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def _final_output(
        self,
        prompt: PromptType,
        params: SamplingParams,
        request_id: str,
        priority: int,
        lora_request: LoRARequest | None = None,
    ) -> RequestOutput:
        final = None
        async for output in self.generate(prompt, params, request_id, priority, lora_request):
            final = output
        assert final is not None, "generate ends with a finished output"
        return final

    # ------------------------------------------------------------------------------------------------ outputs
    def _process_engine_outputs(
        self, engine_outputs: list[EngineCoreOutput], stats: SchedulerStats
    ) -> None:
        """The client's output handler: one step's core outputs, turned into RequestOutputs and delivered."""
        with self._lock:
            in_sessions = [out.request_id in self._sessions for out in engine_outputs]
            processed = [
                self.output_processor.process_outputs(
                    [
                        out
                        for out, session in zip(engine_outputs, in_sessions, strict=True)
                        if not session
                    ]
                )
            ]
            wakeups = Wakeups()  # one wake-up per consumer event loop for the whole step
            for request_output in processed[0].request_outputs:
                self._deliver(request_output, wakeups)
            if any(in_sessions):
                processed.append(
                    self._sessions.process_outputs(
                        [
                            out
                            for out, session in zip(engine_outputs, in_sessions, strict=True)
                            if session
                        ]
                    )
                )
            reqs_to_abort = [request_id for each in processed for request_id in each.reqs_to_abort]
            if reqs_to_abort:  # stop strings (this ends a session, too)
                self.engine_core_client.abort_requests(reqs_to_abort)
            for loop in wakeups.flush():
                self._abort_streams_of(loop)
            if self._stat_loggers:
                iteration_stats = processed[0].iteration_stats
                for each in processed[1:]:
                    iteration_stats.add(each.iteration_stats)
                for stat_logger in self._stat_loggers:
                    stat_logger.record(stats, iteration_stats)

    def _deliver(self, request_output: RequestOutput, wakeups: Wakeups | None = None) -> None:
        """Hand an output to its stream; with `wakeups`, its consumer is woken when the caller flushes them."""
        request_id = request_output.request_id
        stream = self._streams.get(request_id)
        if stream is None:
            return
        delivered = (
            stream.put(request_output)
            if wakeups is None
            else stream.put_deferred(request_output, wakeups)
        )
        if not delivered:
            self._abort_orphan(request_id)
            return
        if request_output.finished:
            self._forget(request_id)

    def _abort_streams_of(self, loop: asyncio.AbstractEventLoop) -> None:
        """Abort the requests whose consumers ran on `loop`, which has closed. Caller holds the lock."""
        for request_id, stream in list(self._streams.items()):
            if stream.loop is loop:
                self._abort_orphan(request_id)

    def _abort_orphan(self, request_id: str) -> None:
        """Abort a request whose consumer's event loop is closed (nobody reads its stream)."""
        logger.warning("the event loop of request %s is closed: aborting it", request_id)
        self._forget(request_id)
        self._abort_request(request_id)

    def _forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def _fail_all(self, error: EngineDeadError) -> None:
        """The client's dead handler: every live stream ends with the engine's error; an engine that died (not
        one shut down) is logged once, with the cause (an exit code or signal, or the error)."""
        if error.__cause__ is not None:
            logger.error("the engine died: %s", error)
        with self._lock:
            for stream in self._streams.values():
                stream.put(fresh_dead_error(error))
            self._streams.clear()
            self._sessions.fail_all(error)


@dataclasses.dataclass
class _BeamSearchRun:
    """A live `AsyncLLM.beam_search`: the ids of its step requests in flight (or last run), and whether it was
    aborted (it then runs no further step)."""

    step_request_ids: list[str] = dataclasses.field(default_factory=list)
    aborted: bool = False


def _make_stats(engine_core: EngineCore) -> SchedulerStats:
    return engine_core.make_stats()
