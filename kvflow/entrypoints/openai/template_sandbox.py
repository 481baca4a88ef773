"""TemplateSandbox: renders chat templates that clients send (`--trust-request-chat-template`) where they cannot hurt
the server.

Jinja's sandbox stops a template from reaching Python's internals, but not from running long (`range` loops nested
a few deep run for hours) or building huge strings (`"a" * 10**9`, `"x"|center(10**9)`), and a Python thread cannot
be stopped. So a request's template renders in a child process, one render at a time:

  * a time limit (`timeout_s`): past it the child is killed (and started again for the next render) and the
    request gets a ChatTemplateError (400);
  * an address-space limit (`memory_limit_bytes` above what the child holds after start-up): a huge allocation is a
    MemoryError there, a ChatTemplateError here;
  * an output limit (`max_output_chars`): rendering stops as soon as the text grows past it;
  * compiled templates are cached in the child (`CompiledTemplates`, least recently used out).

The child is started on the first render (a spawned interpreter importing jinja2 and `kvflow.tokenizer.template`,
not torch), is a daemon of the server process, and exits on its own when the server goes away (its end of the
pipe closes). Templates the checkpoint ships are trusted and render in the server process.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import resource
import threading
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from kvflow.entrypoints.openai.server_config import REQUEST_TEMPLATE_TIMEOUT_S
from kvflow.tokenizer.template import ChatTemplateError, CompiledTemplates, render_chat_template

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess

logger = logging.getLogger(__name__)

DEFAULT_MAX_OUTPUT_CHARS = 4 * 2**20
DEFAULT_MEMORY_LIMIT_BYTES = 1 << 30
_START_TIMEOUT_S = 60.0
_STOP_TIMEOUT_S = 5.0


class TemplateSandbox:
    """Renders untrusted chat templates in a child process with time, memory and output limits.

    Invariants: at most one render runs at a time (`_lock`), waited for on a thread of the sandbox's own, so renders
    queued behind a slow one never hold threads other work needs; the child, while it exists, has answered every
    render it was sent or is killed; `close()` leaves no child behind.
    """

    def __init__(
        self,
        timeout_s: float = REQUEST_TEMPLATE_TIMEOUT_S,
        max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS,
        memory_limit_bytes: int = DEFAULT_MEMORY_LIMIT_BYTES,
    ) -> None:
        self.timeout_s = timeout_s
        self.max_output_chars = max_output_chars
        self.memory_limit_bytes = memory_limit_bytes
        self._lock = threading.Lock()
        self._waiter = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="kvflow-template-sandbox"
        )
        self._process: BaseProcess | None = None
        self._connection: Connection | None = None

    async def render(self, source: str, variables: dict[str, Any]) -> str:
        """Render `source` with `variables` (JSON values); ChatTemplateError (400) for anything that goes wrong."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._waiter, self.render_blocking, source, variables)

    def render_blocking(self, source: str, variables: dict[str, Any]) -> str:
        with self._lock:
            connection = self._ensure_started()
            try:
                connection.send((source, variables))
            except (BrokenPipeError, OSError):
                self._kill("it exited")
                raise ChatTemplateError(
                    "chat template rendering failed (the renderer exited)"
                ) from None
            if not connection.poll(self.timeout_s):
                self._kill("it ran past its time limit")
                raise ChatTemplateError(
                    f"chat template did not finish rendering within {self.timeout_s:g} s"
                )
            try:
                ok, text = connection.recv()
            except EOFError:
                self._kill("it exited while rendering")
                raise ChatTemplateError(
                    "chat template rendering failed (the renderer exited)"
                ) from None
        if not ok:
            raise ChatTemplateError(text)
        return text

    def close(self) -> None:
        self._waiter.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            self._kill(None)

    # ------------------------------------------------------------------------------------------------ the child
    def _ensure_started(self) -> Connection:
        if self._process is not None and self._process.is_alive() and self._connection is not None:
            return self._connection
        self._kill(None)
        context = multiprocessing.get_context("spawn")
        parent_end, child_end = context.Pipe()
        process = context.Process(
            target=serve_renders,
            args=(child_end, self.max_output_chars, self.memory_limit_bytes),
            name="kvflow-template-sandbox",
            daemon=True,
        )
        process.start()
        child_end.close()
        if not parent_end.poll(_START_TIMEOUT_S):
            process.kill()
            process.join(_STOP_TIMEOUT_S)
            raise ChatTemplateError("the chat template renderer did not start")
        parent_end.recv()  # its "ready"
        self._process, self._connection = process, parent_end
        return parent_end

    def _kill(self, reason: str | None) -> None:
        """Stop the child (it is started again on the next render). Caller holds `_lock`."""
        process, connection = self._process, self._connection
        self._process = self._connection = None
        if connection is not None:
            connection.close()
        if process is None:
            return
        if reason is not None:
            logger.warning("stopping the chat template renderer: %s", reason)
        process.kill()
        process.join(_STOP_TIMEOUT_S)


def serve_renders(connection: Connection, max_output_chars: int, memory_limit_bytes: int) -> None:
    """The child's loop: answer `(source, variables)` with `(True, text)` or `(False, error message)` until the
    parent closes its end of the pipe."""
    _limit_address_space(memory_limit_bytes)
    templates = CompiledTemplates()
    connection.send("ready")
    while True:
        try:
            source, variables = connection.recv()
        except (EOFError, OSError):
            return
        try:
            answer = (
                True,
                render_chat_template(templates.get(source), variables, max_output_chars),
            )
        except MemoryError:
            answer = (False, "chat template used more memory than this server allows")
        except ChatTemplateError as error:
            answer = (False, str(error))
        except Exception as error:  # anything a template can raise that the renderer does not name
            answer = (False, f"chat template error: {type(error).__name__}: {error}")
        try:
            connection.send(answer)
        except (BrokenPipeError, OSError):
            return


def _limit_address_space(extra_bytes: int) -> None:
    """Cap the process's address space at what it maps now plus `extra_bytes` (where /proc tells what it maps)."""
    try:
        with open("/proc/self/statm") as statm:
            mapped_bytes = int(statm.read().split()[0]) * resource.getpagesize()
    except OSError:
        return
    limit = mapped_bytes + extra_bytes
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
