"""The prompt text of a chat request (/v1/chat/completions and /tokenize with `messages`), through the one chat
renderer (`kvflow.tokenizer.chat`) with the server's trust rules on top.

Which template renders: the request's `chat_template`, else the server's (`kvflow serve --chat-template`), else the
checkpoint's default. The checkpoint's templates (its default and its named ones) and the server's are trusted and
render in the server process; a template source sent by a client renders in the `TemplateSandbox` (time, memory
and output limits) and is refused without one, as vLLM refuses it without `--trust-request-chat-template`. Both go
through the same steps (`prepare_chat`, then `PreparedChat.finish`), so a conversation gets the same checks,
content normalisation and `continue_final_message` handling either way. A request's template is never read from a
file.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kvflow.entrypoints.openai.errors import OpenAIServingError
from kvflow.tokenizer.chat import ChatInputError, prepare_chat
from kvflow.tokenizer.template import ChatTemplateError

if TYPE_CHECKING:
    from kvflow.entrypoints.openai.template_sandbox import TemplateSandbox
    from kvflow.tokenizer import Tokenizer


class ChatPromptRenderer:
    """Renders chat requests for one server.

    Invariants: `default_chat_template` (the server's, already loaded: template text or the name of one of the
    checkpoint's templates) is None or renders in-process; a request template that is not one of the checkpoint's
    named ones renders only in `template_sandbox`. Every failure is an OpenAIServingError (400) whose `param` is
    the request field at fault.
    """

    def __init__(
        self,
        tokenizer: Tokenizer | None,
        default_chat_template: str | None = None,
        template_sandbox: TemplateSandbox | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.default_chat_template = default_chat_template
        self.template_sandbox = template_sandbox

    async def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """The prompt text of a conversation (its request fields as the arguments)."""
        tokenizer = self.tokenizer
        if tokenizer is None:
            raise OpenAIServingError(
                "this model has no tokenizer, so no chat template: use /v1/completions with token ids",
                param="messages",
            )
        in_sandbox = not tokenizer.is_named_chat_template(chat_template)
        if in_sandbox and self.template_sandbox is None:
            raise OpenAIServingError(
                "chat_template was passed with the request, but this server does not render request chat "
                "templates: start it with --trust-request-chat-template, or pass the name of one of the "
                "checkpoint's templates",
                param="chat_template",
            )
        try:
            prepared = prepare_chat(
                tokenizer,
                messages,
                chat_template=self.default_chat_template
                if chat_template is None
                else chat_template,
                chat_template_kwargs=chat_template_kwargs,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tools=tools,
            )
            if not in_sandbox:
                return prepared.render(tokenizer)
            assert self.template_sandbox is not None
            return prepared.finish(
                await self.template_sandbox.render(prepared.source, prepared.variables)
            )
        except ChatInputError as error:
            raise OpenAIServingError(str(error), param=error.field) from error
        except ChatTemplateError as error:
            param = "chat_template" if chat_template is not None else "messages"
            raise OpenAIServingError(str(error), param=param) from error
