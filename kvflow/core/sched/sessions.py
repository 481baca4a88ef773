"""Streaming-input sessions: resumable requests that take prompt chunks one after another under one id."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvflow.request import RequestStatus

if TYPE_CHECKING:
    from kvflow.core.kv_cache_manager import KVCacheManager
    from kvflow.core.sched.request_queue import RequestQueue
    from kvflow.request import Request, StreamingUpdate


class StreamingSessions:
    """The scheduler's table of streaming-input sessions: which idle, which keep a slot, whose chunk is unsent.

    A session is a resumable request that stays in the scheduler's `requests` from its first chunk until it is
    closed. When a chunk stops, the session takes the next update queued in its `streaming_queue` (a chunk, or
    None: close), or parks in WAITING_FOR_STREAMING_REQ outside `running` and `waiting`, keeping its KV blocks and
    worker slot so that the next chunk continues where the last one left off. The scheduler keeps admission,
    preemption and output building, and asks this table about sessions; the table puts a session with a new chunk
    in `waiting` and frees the blocks of the sessions it releases.

    Invariants (between scheduler calls):
      * `_idle_ids` is exactly the sessions in WAITING_FOR_STREAMING_REQ, and their `streaming_queue` is empty.
      * `_slot_holders` are the sessions outside `running` that kept their worker slot and KV blocks since their
        last chunk stopped: idle ones, and ones whose next chunk waits in `waiting` (status WAITING). Admission
        takes a session out (it continues in its own slot); a forced reset releases them all.
      * `_unsent_chunk_ids` is exactly the slot holders queued in `waiting`: the worker holds their earlier tokens
        but not the new chunk, which it receives once, in the step that admits the session.
      * every id here belongs to a live request: the scheduler calls `forget` whenever it frees one.
    """

    def __init__(
        self, max_model_len: int, waiting: RequestQueue, kv_cache_manager: KVCacheManager
    ) -> None:
        self.max_model_len = max_model_len
        # The scheduler's waiting queue: a session with a new chunk is queued there.
        self._waiting = waiting
        self._kv_cache_manager = kv_cache_manager
        self._idle_ids: set[str] = set()
        self._slot_holders: dict[str, Request] = {}
        self._unsent_chunk_ids: set[str] = set()

    # ------------------------------------------------------------------------------------------------ queries
    @property
    def num_waiting_for_input(self) -> int:
        """Sessions parked in WAITING_FOR_STREAMING_REQ."""
        return len(self._idle_ids)

    @property
    def num_slot_holders(self) -> int:
        """Sessions outside `running` that hold a worker slot."""
        return len(self._slot_holders)

    def holds_slot(self, request_id: str) -> bool:
        return request_id in self._slot_holders

    @property
    def has_unsent_chunks(self) -> bool:
        """True while some slot-holding session waits in `waiting` with a chunk the worker has not seen."""
        return bool(self._unsent_chunk_ids)

    # ------------------------------------------------------------------------------------------------ updates
    def add_update(
        self, session: Request, chunk: StreamingUpdate | None, close_after: bool
    ) -> bool:
        """Give `session` its next `chunk` (if any) and then, with `close_after`, close it.

        An idle session takes the chunk at once; a session whose chunk runs or is queued gets the update queued
        behind it, applied when that chunk stops. Returns True only when the session should end now: it is idle
        and there is no chunk to run before closing (the caller finishes it). Raises ValueError for an empty
        chunk, or one that would grow an idle session past `max_model_len` (the session is left as it was).
        """
        assert chunk is not None or close_after, "an update without a chunk closes the session"
        if chunk is not None and not chunk.prompt_token_ids:
            raise ValueError(
                f"request {session.request_id!r}: a streaming chunk must carry prompt_token_ids "
                "(an empty non-resumable request closes the session)"
            )
        queue = session.streaming_queue
        assert queue is not None, f"{session} is not a streaming session"
        if session.status != RequestStatus.WAITING_FOR_STREAMING_REQ:
            if chunk is not None:
                queue.append(chunk)
            if close_after:
                queue.append(None)
            return False
        if chunk is None:
            return True
        if not self._chunk_fits(session, chunk):
            raise ValueError(
                f"request {session.request_id!r}: the streaming session would grow past "
                f"max_model_len={self.max_model_len}"
            )
        self._idle_ids.discard(session.request_id)
        self._apply_chunk(session, chunk)
        if close_after:
            queue.append(None)
        return False

    def park_stopped(self, session: Request, kept_slot: bool) -> bool:
        """A session's chunk stopped: apply the next queued update, or park the session until one arrives.

        `kept_slot`: the session was running, so the worker still holds its slot and it keeps its KV blocks.
        Returns True when the session ends instead (its queue says close, or the queued chunk would grow it past
        `max_model_len`: then its status becomes FINISHED_LENGTH_CAPPED); the caller frees it.
        """
        if kept_slot:
            self._slot_holders[session.request_id] = session
        queue = session.streaming_queue
        assert queue is not None, f"{session} is not a streaming session"
        if not queue:
            session.status = RequestStatus.WAITING_FOR_STREAMING_REQ
            self._idle_ids.add(session.request_id)
            return False
        chunk = queue.popleft()
        if chunk is None:
            return True
        if not self._chunk_fits(session, chunk):
            session.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        self._apply_chunk(session, chunk)
        return False

    def _chunk_fits(self, session: Request, chunk: StreamingUpdate) -> bool:
        # Applying a chunk drops the last sampled token (its KV was never computed), so it does not count.
        # E.g., max_model_len=20, 10 prompt tokens + 3 outputs: 12 tokens are kept, and a chunk of 8 fits.
        num_kept = session.num_tokens - 1 if session.num_output_tokens else session.num_tokens
        return num_kept + len(chunk.prompt_token_ids) <= self.max_model_len

    def _apply_chunk(self, session: Request, chunk: StreamingUpdate) -> None:
        """Fold the session's outputs into its prompt, append the chunk, and queue the session in `waiting`."""
        session.extend_prompt(chunk.prompt_token_ids)
        # With async scheduling a step past the stop may have computed the dropped token: forget it.
        # E.g., 10 prompt tokens + outputs [a, b, c], chunk [x, y]: all_token_ids becomes 10 + [a, b, x, y]
        # (14 tokens), num_kept = 14 - 2 = 12, and a computed count of 13 (c's KV) is cut back to 12.
        num_kept = session.num_tokens - len(chunk.prompt_token_ids)
        session.num_computed_tokens = min(session.num_computed_tokens, num_kept)
        session.spec_token_ids = []  # drafted after the old continuation: they do not follow the chunk
        session.sampling_params = chunk.sampling_params
        if session.structured_output_request is not None:
            session.structured_output_request.restart_for_chunk(
                chunk.sampling_params.structured_outputs
            )
        session.arrival_time = chunk.arrival_time
        session.stop_reason = None
        # A session that kept its slot continues on the worker; one that lost it resumes like a preempted one.
        if session.request_id in self._slot_holders:
            session.status = RequestStatus.WAITING
            self._unsent_chunk_ids.add(session.request_id)
        else:
            session.status = RequestStatus.PREEMPTED
        self._waiting.add_request(session)

    # ------------------------------------------------------------------------------------------------ scheduling
    def resume_in_own_slot(self, request_id: str) -> bool:
        """The scheduler admitted `request_id` to `running`. True if it is a session that kept its worker slot:
        it continues there (the worker still holds it, so it is sent as cached) and stops counting here."""
        return self._slot_holders.pop(request_id, None) is not None

    def take_unsent_chunk(self, request_id: str) -> bool:
        """True once per applied chunk of a slot-holding session: the step being built must send the chunk."""
        if request_id not in self._unsent_chunk_ids:
            return False
        self._unsent_chunk_ids.remove(request_id)
        return True

    # ------------------------------------------------------------------------------------------------ release
    def release_slot_holders(self) -> list[str]:
        """Forced reset: every slot holder gives back its KV blocks and worker slot and will resume by recompute.

        Returns their ids, which the scheduler reports as preempted so the worker frees the slots.
        """
        released = list(self._slot_holders.values())
        for session in released:
            self._release_session(session)
        return [session.request_id for session in released]

    def _release_session(self, session: Request) -> None:
        self._kv_cache_manager.free(session)
        session.num_computed_tokens = 0
        session.num_preemptions += 1
        del self._slot_holders[session.request_id]
        self._unsent_chunk_ids.discard(session.request_id)
        # A session whose chunk waits in `waiting` now resumes like a preempted one; an idle one stays idle.
        if session.status == RequestStatus.WAITING:
            session.status = RequestStatus.PREEMPTED

    def forget(self, request_id: str) -> None:
        """The scheduler freed `request_id` (finished, aborted or closed): drop every trace of it."""
        self._idle_ids.discard(request_id)
        self._slot_holders.pop(request_id, None)
        self._unsent_chunk_ids.discard(request_id)
