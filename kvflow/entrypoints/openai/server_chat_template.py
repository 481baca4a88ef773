"""The server's `--chat-template` option, loaded once the engine's tokenizer is known: shared by the single API
server (`kvflow.entrypoints.cli.serve`) and each API server process of `--api-server-count N`
(`kvflow.entrypoints.openai.api_servers`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvflow.entrypoints.cli.engine import CommandError

if TYPE_CHECKING:
    from kvflow.engine.async_llm import AsyncLLM


def load_server_chat_template(value: str | None, engine: AsyncLLM) -> str | None:
    """`--chat-template`, loaded by vLLM's rule (`load_chat_template`: a file is read, a template kept) once the
    checkpoint's tokenizer is known (its named templates count too) and compiled; CommandError for a value that is
    none of these, or a template that is not valid Jinja."""
    if value is None:
        return None
    tokenizer = engine.get_tokenizer()
    if tokenizer is None:
        raise CommandError(
            f"--chat-template: model {engine.model_info.name!r} has no tokenizer (--skip-tokenizer-init, or "
            "the hash model), so no chat endpoint to template"
        )
    from kvflow.tokenizer import compile_chat_template, load_chat_template

    try:
        template = load_chat_template(value, named_templates=tokenizer.named_chat_templates)
        compile_chat_template(tokenizer.chat_template_source(template))  # a syntax error fails now
    except ValueError as error:
        raise CommandError(f"--chat-template: {error}") from error
    return template
