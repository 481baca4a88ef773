"""The `mp` executor's worker process: `python -m kvflow.executor.mp_worker`, one per tensor-parallel rank.

It reads its `MultiprocWorkerArgs` (pickled) from stdin, connects a SUB socket to the executor's broadcast and a
PUSH socket to its reply socket, builds its rank (`build_rank_worker`), answers `WorkerReady` (or its startup
failure), then applies broadcast messages in order until `StopWorker`.

It exits, without waiting for anything, when its parent (the engine-core process) dies: a thread watches the parent's
pid, so no worker outlives its engine even when it is blocked in a collective. SIGINT is ignored (a Ctrl-C reaches
the whole process group; the engine decides how its workers stop).
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
import threading
import time
from dataclasses import dataclass

import zmq

from kvflow.executor.messages import (
    STARTUP_CALL_ID,
    RankStartup,
    RemoteFailure,
    StopWorker,
    WorkerReply,
    encode_reply,
)
from kvflow.executor.rank_worker import build_rank_worker, handle_message, ready_message

logger = logging.getLogger(__name__)

_PARENT_POLL_S = 0.5


@dataclass(frozen=True)
class MultiprocWorkerArgs:
    """A worker process's start-up arguments: its rank's `RankStartup`, the executor's two ipc addresses, and the
    pid of the process that must stay alive (the engine core)."""

    startup: RankStartup
    broadcast_address: str
    reply_address: str
    parent_pid: int


def _watch_parent(parent_pid: int) -> None:
    """Exit this process at once when the parent is gone (re-parented: `getppid` changes)."""

    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(1)
            time.sleep(_PARENT_POLL_S)

    threading.Thread(target=watch, name="kvflow-parent-watch", daemon=True).start()


def run_worker(args: MultiprocWorkerArgs) -> int:
    """Serve one rank until told to stop; the exit code (1 when start-up failed)."""
    rank = args.startup.rank
    context = zmq.Context()
    broadcast = context.socket(zmq.SUB)
    broadcast.setsockopt(zmq.RCVHWM, 0)
    broadcast.setsockopt(zmq.SUBSCRIBE, b"")
    broadcast.connect(args.broadcast_address)
    replies = context.socket(zmq.PUSH)
    replies.setsockopt(zmq.SNDHWM, 0)
    replies.setsockopt(zmq.LINGER, 2000)
    replies.connect(args.reply_address)
    try:
        worker = build_rank_worker(args.startup)
    except BaseException as error:
        logger.exception("tensor-parallel rank %d failed to start", rank)
        failure = RemoteFailure.from_exception(error)
        replies.send(encode_reply(WorkerReply(rank, STARTUP_CALL_ID, failure=failure)))
        replies.close()
        context.term()
        return 1
    replies.send(encode_reply(ready_message(worker)))
    while True:
        call_id, message = pickle.loads(broadcast.recv())
        if isinstance(message, StopWorker):
            break
        reply = handle_message(worker, call_id, message)
        if reply is not None:
            replies.send(encode_reply(reply))
    broadcast.close()
    replies.close()
    context.term()
    if worker.tp.size > 1:
        import torch.distributed as dist

        dist.destroy_process_group()
    return 0


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    args: MultiprocWorkerArgs = pickle.load(sys.stdin.buffer)
    _watch_parent(args.parent_pid)
    exit_code = run_worker(args)
    # Everything is closed: skip the interpreter's teardown (slow with torch loaded, and nothing left to release).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)


if __name__ == "__main__":
    main()
