"""`kvflow chat` as a real subprocess with stdin piped (no terminal): replies, commands, a context that overflows,
Ctrl-C during a reply and at the prompt, and --chat-template for a checkpoint without a template.

Replies are one line each because every run passes a newline as a stop string.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import shutil
import signal
import subprocess
import threading
from collections.abc import Iterable
from pathlib import Path

import pytest

from kvflow.entrypoints.cli.chat import (
    Conversation,
    Reply,
    held_stats_lines,
    run_interruptibly,
    stream_reply,
)
from kvflow.tokenizer import Tokenizer, load_tokenizer, render_chat
from tests.test_cli import (
    HASH_MODEL,
    LOG_LINE,
    SMALL_CACHE,
    kvflow_command,
    kvflow_env,
    non_log_lines,
    run_kvflow,
)
from tests.test_cli_errors import assert_one_line_error

ONE_LINE_REPLIES = ["--stop", "\n", *SMALL_CACHE]


def run_chat(stdin: str, *args: str) -> subprocess.CompletedProcess[str]:
    return run_kvflow("chat", *ONE_LINE_REPLIES, *args, stdin=stdin)


def test_chat_answers_each_line_and_keeps_the_conversation() -> None:
    result = run_chat(
        "Hi there\n\nHow are you?\n/exit\nnot read\n", "--max-tokens", "6", "--system", "Be brief."
    )
    assert result.returncode == 0, result.stderr
    assert (
        len(result.stdout.splitlines()) == 2
    )  # one reply per user turn; blank lines and /exit are not turns
    assert "Traceback" not in result.stderr


def test_help_lists_the_commands_and_reset_forgets_the_conversation() -> None:
    stdin = "Hi\nTell me more about that\n/help\n/reset\nHi\n/bogus\n"
    result = run_chat(stdin, "--max-tokens", "8", "--system", "Be brief.")
    assert result.returncode == 0, result.stderr
    first, _second, *help_lines, after_reset = result.stdout.splitlines()
    assert [line.split()[0] for line in help_lines] == ["/help", "/reset", "/exit", "/quit"]
    # Greedy decoding on the same prompt: after /reset, "Hi" is answered as in a fresh conversation.
    assert after_reset == first
    notices = non_log_lines(result.stderr)
    assert notices == [
        "kvflow chat: conversation reset (the system prompt stays)",
        "kvflow chat: unknown command /bogus (/help lists the commands)",
    ]


def test_a_conversation_longer_than_max_model_len_drops_its_oldest_turns() -> None:
    turns = [
        "Hello there, how are you?",
        "Tell me a story about a cat.",
        "And one about a dog.",
        "Thanks!",
    ]
    too_long = "word " * 80
    stdin = "\n".join([*turns, too_long, "Still there?"]) + "\n"
    result = run_chat(stdin, "--max-tokens", "8", "--max-model-len", "64", "--system", "Be brief.")
    assert result.returncode == 0, result.stderr
    assert (
        len(result.stdout.splitlines()) == len(turns) + 1
    )  # every message but the too-long one got a reply
    notices = non_log_lines(result.stderr)
    dropped = [
        n for n in notices if "outgrew max_model_len=64 with room for --max-tokens 8: dropped" in n
    ]
    assert dropped and len(dropped) <= len(turns)
    assert any(
        n.startswith("kvflow chat: message not sent: ") and "max_model_len=64" in n for n in notices
    )
    assert "Traceback" not in result.stderr


def test_ctrl_c_stops_a_reply_and_keeps_the_session_and_at_the_prompt_it_leaves() -> None:
    process = subprocess.Popen(
        [*kvflow_command(), "chat", *SMALL_CACHE, "--max-tokens", "100000", "--ignore-eos"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=kvflow_env(KVFLOW_LOGGING_LEVEL="WARNING"),
    )
    assert process.stdin is not None and process.stdout is not None
    try:
        process.stdin.write("Tell me everything.\n")
        process.stdin.flush()
        assert process.stdout.read(1)  # the reply streams (~2000 tokens: it is far from done)
        process.send_signal(signal.SIGINT)
        process.stdin.write("/help\n")
        process.stdin.flush()
        for line in process.stdout:  # the session goes on after the interrupted reply
            if line.startswith("/quit"):  # the last line of /help: now at the prompt
                break
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 0, stderr
    assert "Traceback" not in stderr
    assert non_log_lines(stderr) == ["kvflow chat: reply interrupted"]


def test_stats_lines_wait_until_the_reply_has_ended() -> None:
    """On a terminal stdout and stderr are one stream: the engine's periodic stats lines (here every 5 ms, so
    dozens fall within each reply) are held while a reply streams and logged after it, never inside it."""
    stats_marker = "Avg prompt throughput"
    result = subprocess.run(
        [*kvflow_command(), "chat", *SMALL_CACHE, "--max-tokens", "120", "--ignore-eos"],
        input="Tell me a long story.\nAnd another one.\n",
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,  # interleaved in the order they were written, as a terminal shows them
        text=True,
        timeout=300,
        check=False,
        env=kvflow_env(KVFLOW_LOG_STATS_INTERVAL="0.005"),
    )
    assert result.returncode == 0, result.stdout
    lines = result.stdout.splitlines()
    is_log = [bool(LOG_LINE.match(line)) for line in lines]
    stats = [index for index, line in enumerate(lines) if stats_marker in line]
    assert all(is_log[index] for index in stats), "a stats line was written inside a reply line"
    reply_blocks = _runs(index for index, log in enumerate(is_log) if not log)
    assert len(reply_blocks) == 2, f"the two replies are not two unbroken blocks: {reply_blocks}"
    first_reply, second_reply = reply_blocks
    # The stats lines held while each reply streamed follow it: still logged, just not inside it.
    assert any(first_reply[1] < index < second_reply[0] for index in stats)
    assert any(second_reply[1] < index for index in stats)


def _runs(indices: Iterable[int]) -> list[tuple[int, int]]:
    """The maximal runs of consecutive integers in increasing `indices`, as (first, last) pairs."""
    runs: list[list[int]] = []
    for index in indices:
        if runs and runs[-1][1] == index - 1:
            runs[-1][1] = index
        else:
            runs.append([index, index])
    return [(first, last) for first, last in runs]


@pytest.mark.slow  # copies the model and runs two chats; --chat-template files: tests/entrypoints (serve)
def test_chat_template_file_for_a_checkpoint_without_one(tmp_path: Path) -> None:
    from kvflow.default_model import ensure_default_model

    checkpoint = tmp_path / "no-template"
    shutil.copytree(ensure_default_model(), checkpoint)
    config_file = checkpoint / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    del config["chat_template"]
    config_file.write_text(json.dumps(config))
    template = tmp_path / "template.jinja"
    template.write_text(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    args = ("--model", str(checkpoint), "--max-tokens", "4")
    missing = run_chat("Hi\n", *args)
    assert_one_line_error(missing, "--chat-template FILE", command="chat")
    given = run_chat("Hi\n", *args, "--chat-template", str(template))
    assert given.returncode == 0, given.stderr
    assert len(given.stdout.splitlines()) == 1
    no_file = run_chat("Hi\n", *args, "--chat-template", str(tmp_path / "absent.jinja"))
    assert_one_line_error(no_file, "absent.jinja' looks like a file path", command="chat")


def test_chat_needs_a_tokenizer() -> None:
    result = run_kvflow("chat", *HASH_MODEL, stdin="Hi\n", timeout=120)
    assert_one_line_error(result, "has no tokenizer", command="chat")


# ------------------------------------------------------------------------------------------------ in process
@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    from kvflow.default_model import ensure_default_model

    return load_tokenizer(ensure_default_model())


def test_conversation_drops_the_oldest_turns_but_never_the_system_prompt_or_the_new_message(
    tokenizer: Tokenizer,
) -> None:
    conversation = Conversation(tokenizer, "Be brief.", None, max_model_len=80, max_tokens=10)
    for index in range(4):
        conversation.add_user(f"question number {index} about cats")
        prompt, dropped = conversation.prompt()
        assert len(prompt["prompt_token_ids"]) + 10 <= 80
        assert prompt["prompt_token_ids"] == tokenizer.encode(
            prompt["prompt"], add_special_tokens=False
        )
        assert "Be brief." in prompt["prompt"] and f"question number {index}" in prompt["prompt"]
        conversation.add_reply(f"answer number {index}")
    assert dropped > 0 and dropped % 2 == 0  # whole turns: a question and its answer
    assert "question number 0" not in prompt["prompt"]
    assert [turn["role"] for turn in conversation.turns] == ["user", "assistant"] * (
        len(conversation.turns) // 2
    )
    conversation.add_user("word " * 100)
    with pytest.raises(ValueError, match="max_model_len=80 leaves no room for a reply"):
        conversation.prompt()
    conversation.drop_pending_user()
    assert conversation.turns == [] or conversation.turns[-1]["role"] == "assistant"


def test_conversation_prompts_come_from_the_one_chat_renderer(
    tokenizer: Tokenizer, tmp_path: Path
) -> None:
    """`kvflow chat` renders with `render_chat`: the same prompt as LLM.chat and the server, for a template file, a
    template's text, or the checkpoint's own."""
    template = "{% for m in messages %}[{{ m['role'] }}: {{ m['content'] }}]{% endfor %}"
    template_file = tmp_path / "template.jinja"
    template_file.write_text(template)
    for chat_template in (None, template, str(template_file)):
        conversation = Conversation(tokenizer, "Be brief.", chat_template, 1024, 16)
        conversation.check_template()
        conversation.add_user("Hi there")
        prompt, dropped = conversation.prompt()
        expected = render_chat(
            tokenizer,
            [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}],
            chat_template=chat_template,
        )
        assert (prompt, dropped) == (expected.as_prompt(), 0)
        if chat_template is not None:
            assert prompt["prompt"] == "[system: Be brief.][user: Hi there]"


def test_held_stats_lines_are_logged_in_order_when_the_block_ends(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """What keeps stats lines out of a reply: records the stats logger writes (from another thread, as the
    engine's output handler does) inside the block are held, then logged in order when it ends; then it is gone."""
    from kvflow.engine.stat_logger import logger as stats_logger

    caplog.set_level(logging.INFO, logger="kvflow")
    with held_stats_lines():
        writer = threading.Thread(
            target=lambda: [stats_logger.info("line %d", i) for i in range(3)]
        )
        writer.start()
        writer.join()
        assert caplog.messages == []
    assert caplog.messages == ["line 0", "line 1", "line 2"]
    stats_logger.info("after the block")
    assert caplog.messages[-1] == "after the block" and stats_logger.filters == []


def test_interrupting_a_reply_cancels_it_and_aborts_its_request() -> None:
    """What Ctrl-C does during a reply: SIGINT cancels the streaming task (no KeyboardInterrupt), and closing
    the stream aborts the request, so the engine holds nothing afterwards."""
    from kvflow.engine.async_llm import AsyncLLM
    from kvflow.sampling_params import SamplingParams

    llm = AsyncLLM("hash", max_model_len=256, num_kv_blocks=64)
    loop = asyncio.new_event_loop()
    try:
        params = SamplingParams(max_tokens=200, ignore_eos=True, output_kind="delta")
        reply = Reply()

        class InterruptAfterFirstToken(io.StringIO):
            def write(self, text: str) -> int:
                if not self.getvalue() and reply.token_ids:
                    os.kill(
                        os.getpid(), signal.SIGINT
                    )  # the handler cancels the task at its next await
                return super().write(text or " ")

        out = InterruptAfterFirstToken()
        prompt = {"prompt_token_ids": [1, 2, 3]}
        assert run_interruptibly(loop, stream_reply(llm, prompt, params, reply, out)) is True
        assert 1 <= len(reply.token_ids) < 200 and reply.finish_reason is None
        unfinished = loop.run_until_complete(
            llm.run_in_engine(lambda core: core.scheduler.get_num_unfinished_requests())
        )
        assert unfinished == 0
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored
        # Not interrupted: runs to the end.
        full = Reply()
        assert (
            run_interruptibly(loop, stream_reply(llm, prompt, params, full, io.StringIO())) is False
        )
        assert len(full.token_ids) == 200 and full.finish_reason == "length"
        assert full.token_ids[: len(reply.token_ids)] == reply.token_ids
    finally:
        llm.shutdown()
        loop.close()
