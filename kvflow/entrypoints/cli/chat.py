"""`kvflow chat`: an interactive conversation, the reply streamed as it is generated.

Ctrl-C during a reply stops that reply (its request is aborted) and keeps the session; Ctrl-C or Ctrl-D at the
prompt leaves. When the conversation no longer fits in `max_model_len` with room for `--max-tokens`, the oldest
turns are dropped (never the system prompt) and a line on stderr says so.

Replies go to stdout, notices and logs to stderr, which a terminal shows in one stream. So that no log line lands
between the tokens of a reply, the engine's periodic stats lines (`KVFLOW_LOG_STATS_INTERVAL`) are held while a
reply streams and logged, unchanged and in order, as soon as it has ended (see `held_stats_lines`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
import threading
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TextIO

from kvflow.entrypoints.cli.args import (
    LOGGING_EPILOG,
    HelpFormatter,
    add_engine_arguments,
    add_sampling_arguments,
    sampling_params,
)
from kvflow.entrypoints.cli.engine import CommandError, make_async_llm
from kvflow.entrypoints.cli.render import format_logprobs

if TYPE_CHECKING:
    from kvflow.engine.async_llm import AsyncLLM
    from kvflow.outputs import CompletionOutput, Logprob
    from kvflow.sampling_params import SamplingParams
    from kvflow.tokenizer import Tokenizer

PROMPT = "> "
COMMANDS = {
    "/help": "list these commands",
    "/reset": "forget the conversation (the system prompt stays)",
    "/exit": "leave (so do /quit, Ctrl-D and Ctrl-C at the prompt)",
    "/quit": "leave",
}
EXIT_COMMANDS = ("/exit", "/quit")

DESCRIPTION = """\
Chat with the model: each line you type is a user message, and the reply streams to stdout
as it is generated. The checkpoint's chat template (or --chat-template) formats the
conversation; with a terminal, lines can be edited and recalled (readline).

commands: /help lists them, /reset forgets the conversation, /exit (or Ctrl-D) leaves.
Ctrl-C stops a reply in progress and keeps the conversation; at the prompt, it leaves.
When the conversation outgrows max_model_len with room for --max-tokens, the oldest turns
are dropped (never the system prompt) and a line on stderr says so. Replies go to stdout;
notices and logs to stderr. The engine's periodic stats lines wait while a reply streams and
are logged once it has ended, so they never split a reply."""


def add_parser(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "chat",
        help="interactive chat using the model's chat template",
        description=DESCRIPTION,
        epilog=LOGGING_EPILOG,
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--system", default=None, help="system prompt")
    parser.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE",
        help="Jinja chat template file (or the template itself, or the name of one of the "
        "checkpoint's templates), for checkpoints without one; default: the checkpoint's",
    )
    add_engine_arguments(parser)
    add_sampling_arguments(parser, max_tokens=256)
    parser.set_defaults(handler=run_chat)


# ---------------------------------------------------------------------------------------------------- conversation
class Conversation:
    """The messages of one chat and the prompt they make (rendered by `kvflow.tokenizer.chat.render_chat`, which
    reads `chat_template` as `LLM.chat` and the server do: a file, a template, or one of the checkpoint's).

    Invariants: `turns` alternate user, assistant, user, ... (so it ends with a user message exactly while a reply
    is pending); the system prompt is never dropped; `prompt()` keeps the newest user message.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        system: str | None,
        chat_template: str | None,
        max_model_len: int,
        max_tokens: int,
    ) -> None:
        self.tokenizer = tokenizer
        self.system = [{"role": "system", "content": system}] if system else []
        self.chat_template = chat_template
        self.max_model_len = max_model_len
        self.max_tokens = max_tokens
        self.turns: list[dict[str, str]] = []

    def check_template(self) -> None:
        """Render a one-message conversation, so a missing or broken template fails before the first prompt."""
        self._encode([*self.system, {"role": "user", "content": "Hello"}])

    def reset(self) -> None:
        self.turns = []

    def add_user(self, text: str) -> None:
        self.turns.append({"role": "user", "content": text})

    def add_reply(self, text: str) -> None:
        self.turns.append({"role": "assistant", "content": text})

    def drop_pending_user(self) -> None:
        """Forget the newest user message (it got no reply)."""
        if self.turns and self.turns[-1]["role"] == "user":
            self.turns.pop()

    def prompt(self) -> tuple[dict[str, Any], int]:
        """The prompt for the pending user message and how many older messages were dropped to make it fit:
        prompt + max_tokens <= max_model_len, or just the system prompt and the newest message if even that does
        not leave room (the reply is then cut at max_model_len). ValueError when that alone is too long."""
        dropped = 0
        text, token_ids = self._encode([*self.system, *self.turns])
        while len(token_ids) + self.max_tokens > self.max_model_len and len(self.turns) > 1:
            del self.turns[:2]  # the oldest user message and its reply
            dropped += 2
            text, token_ids = self._encode([*self.system, *self.turns])
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"this message makes a {len(token_ids)}-token prompt; max_model_len={self.max_model_len} "
                "leaves no room for a reply"
            )
        return {"prompt": text, "prompt_token_ids": token_ids}, dropped

    def _encode(self, messages: list[dict[str, str]]) -> tuple[str, list[int]]:
        from kvflow.tokenizer.chat import render_chat  # not at import: `kvflow --help` stays light

        rendered = render_chat(self.tokenizer, messages, chat_template=self.chat_template)
        return rendered.prompt_text, rendered.prompt_token_ids


@dataclass
class Reply:
    """What one reply streamed so far (from delta outputs)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cumulative_logprob: float | None = None
    finish_reason: str | None = None

    def add(self, delta: CompletionOutput) -> None:
        self.text += delta.text
        self.token_ids += delta.token_ids
        self.logprobs += delta.logprobs or []
        self.cumulative_logprob = delta.cumulative_logprob
        self.finish_reason = delta.finish_reason


async def stream_reply(
    llm: AsyncLLM, prompt: dict[str, Any], params: SamplingParams, reply: Reply, out: TextIO
) -> None:
    """Print the reply's text as it arrives. Cancelling this closes the stream, which aborts the request."""
    async with contextlib.aclosing(llm.generate(prompt, params)) as outputs:
        async for output in outputs:
            delta = output.outputs[0]
            reply.add(delta)
            out.write(delta.text)
            out.flush()


def run_interruptibly(
    loop: asyncio.AbstractEventLoop, coroutine: Coroutine[Any, Any, None]
) -> bool:
    """Run `coroutine` to its end on `loop`; SIGINT (Ctrl-C) meanwhile cancels it instead of raising
    KeyboardInterrupt. True when it was cancelled."""
    task = loop.create_task(coroutine)
    on_main_thread = threading.current_thread() is threading.main_thread()
    previous = None
    if on_main_thread:
        previous = signal.signal(signal.SIGINT, lambda *_: loop.call_soon_threadsafe(task.cancel))
    try:
        loop.run_until_complete(task)
    except asyncio.CancelledError:
        return True
    finally:
        if on_main_thread:
            signal.signal(signal.SIGINT, previous)
    return False


class _HeldRecords(logging.Filter):
    """A logger filter that keeps the records it sees instead of letting them through, until `release`.

    Invariants: while holding, no record of the logger is emitted and each is kept in arrival order; `release`
    emits the kept ones through the logger's handlers before any later record of that logger (a concurrent one
    waits on the lock), then detaches the filter. Records may come from any thread (the engine's output handler
    logs the stats).
    """

    def __init__(self) -> None:
        super().__init__()
        # Re-entered by `release`, whose `handle` runs this filter again.
        self._lock = threading.RLock()
        self._records: list[logging.LogRecord] = []
        self._holding = True

    def filter(self, record: logging.LogRecord) -> bool:
        with self._lock:
            if self._holding:
                self._records.append(record)
            return not self._holding

    def release(self, logger: logging.Logger) -> None:
        with self._lock:
            self._holding = False
            records, self._records = self._records, []
            for record in records:
                logger.handle(record)
        logger.removeFilter(self)


@contextlib.contextmanager
def held_stats_lines() -> Iterator[None]:
    """Hold the engine's periodic stats lines (`kvflow.engine.stat_logger`) for the duration of the block and log
    them when it ends, so they cannot be written between the tokens of a reply."""
    from kvflow.engine.stat_logger import logger as stats_logger

    held = _HeldRecords()
    stats_logger.addFilter(held)
    try:
        yield
    finally:
        held.release(stats_logger)


# ---------------------------------------------------------------------------------------------------- session
def run_chat(args: argparse.Namespace) -> None:
    params = sampling_params(args, output_kind="delta")  # validated before the model loads
    llm = make_async_llm(args)
    loop = asyncio.new_event_loop()
    try:
        conversation = _make_conversation(llm, args)
        interactive = sys.stdin.isatty()
        if interactive:
            _enable_line_editing()
            _notice(f"model {llm.model_info.name}; /help lists the commands, Ctrl-D leaves")
        try:
            _chat_loop(llm, loop, conversation, params, args.logprobs, interactive)
        except KeyboardInterrupt:  # Ctrl-C outside a reply (at the prompt, or between turns): leave
            print(file=sys.stderr)
    finally:
        llm.shutdown()
        loop.close()


def _make_conversation(llm: AsyncLLM, args: argparse.Namespace) -> Conversation:
    tokenizer = llm.get_tokenizer()
    if tokenizer is None:
        raise CommandError(
            f"model {llm.model_info.name!r} has no tokenizer (--skip-tokenizer-init, or the hash model): "
            "chat needs one"
        )
    conversation = Conversation(
        tokenizer,
        args.system,
        args.chat_template,
        llm.engine_config.model_config.max_model_len,
        args.max_tokens,
    )
    try:
        conversation.check_template()
    except ValueError as error:
        hint = "" if args.chat_template else " (--chat-template FILE gives one)"
        raise CommandError(f"{error}{hint}") from error
    return conversation


def _chat_loop(
    llm: AsyncLLM,
    loop: asyncio.AbstractEventLoop,
    conversation: Conversation,
    params: SamplingParams,
    num_logprobs: int | None,
    interactive: bool,
) -> None:
    while True:
        line = _read_line(interactive)
        if line is None:
            return
        text = line.strip()
        if not text:
            continue
        if _is_command(text):
            if text in EXIT_COMMANDS:
                return
            _run_command(text, conversation)
            continue
        conversation.add_user(line)
        try:
            prompt, dropped = conversation.prompt()
        except ValueError as error:
            conversation.drop_pending_user()
            _notice(f"message not sent: {error}")
            continue
        if dropped:
            _notice(
                f"the conversation outgrew max_model_len={conversation.max_model_len} with room for "
                f"--max-tokens {conversation.max_tokens}: dropped the {dropped} oldest messages"
            )
        with held_stats_lines():  # logged after the reply and its logprobs, not between its tokens
            _reply(llm, loop, conversation, prompt, params, num_logprobs)


def _reply(
    llm: AsyncLLM,
    loop: asyncio.AbstractEventLoop,
    conversation: Conversation,
    prompt: dict[str, Any],
    params: SamplingParams,
    num_logprobs: int | None,
) -> None:
    """Stream one reply and file it in the conversation (an interrupted one keeps what it said so far)."""
    reply = Reply()
    interrupted = run_interruptibly(loop, stream_reply(llm, prompt, params, reply, sys.stdout))
    if reply.text or reply.token_ids:
        conversation.add_reply(reply.text)
        if not reply.text.endswith("\n"):
            print(flush=True)
    else:
        conversation.drop_pending_user()
    if interrupted:
        _notice("reply interrupted")
    if num_logprobs is not None and reply.logprobs:
        lines = format_logprobs(
            reply.token_ids, reply.logprobs, num_logprobs, reply.cumulative_logprob
        )
        print("\n".join(lines), flush=True)


def _read_line(interactive: bool) -> str | None:
    """The next input line without its newline; None at the end of input (Ctrl-D)."""
    if not interactive:
        line = sys.stdin.readline()
        return line.rstrip("\r\n") if line else None
    try:
        return input(PROMPT)
    except EOFError:
        print(file=sys.stderr)  # end the prompt's line
        return None


def _is_command(text: str) -> bool:
    """A known command, or one word starting with '/' (a mistyped command); other text is a message."""
    return text in COMMANDS or (text.startswith("/") and len(text.split()) == 1)


def _run_command(text: str, conversation: Conversation) -> None:
    if text == "/help":
        width = max(len(name) for name in COMMANDS)
        print("\n".join(f"{name:<{width}}  {what}" for name, what in COMMANDS.items()), flush=True)
    elif text == "/reset":
        conversation.reset()
        _notice(
            "conversation reset" + (" (the system prompt stays)" if conversation.system else "")
        )
    else:
        _notice(f"unknown command {text} (/help lists the commands)")


def _enable_line_editing() -> None:
    """Arrow keys, line editing and history for `input()` where the readline module exists (not on Windows)."""
    with contextlib.suppress(ImportError):
        import readline  # noqa: F401  (importing it is what enables editing)


def _notice(message: str) -> None:
    print(f"kvflow chat: {message}", file=sys.stderr, flush=True)
