"""Tokenizers of Hugging Face checkpoint folders, in three modules with one job each:

  * `loading`: `load_tokenizer(folder)` reads tokenizer.json and the configuration files around it;
  * `tokenizer`: the `Tokenizer` (ids, special tokens, encode/decode, the checkpoint's chat templates);
  * `chat`: the one chat renderer, `render_chat(tokenizer, messages, ...)` -> `RenderedChat(prompt_text,
    prompt_token_ids)`, which every chat path (`LLM.chat`, `kvflow chat`, the server) calls;

plus `template`, the Jinja environment chat templates render in (transformers' sandbox, globals and filters).
"""

from kvflow.tokenizer.chat import (
    ChatInputError,
    PreparedChat,
    RenderedChat,
    load_chat_template,
    normalize_messages,
    prepare_chat,
    render_chat,
    render_chat_text,
)
from kvflow.tokenizer.loading import load_tokenizer
from kvflow.tokenizer.template import (
    COMPILED_TEMPLATE_CACHE_SIZE,
    ChatTemplateError,
    CompiledTemplates,
    compile_chat_template,
    render_chat_template,
)
from kvflow.tokenizer.tokenizer import Tokenizer

__all__ = [
    "COMPILED_TEMPLATE_CACHE_SIZE",
    "ChatInputError",
    "ChatTemplateError",
    "CompiledTemplates",
    "PreparedChat",
    "RenderedChat",
    "Tokenizer",
    "compile_chat_template",
    "load_chat_template",
    "load_tokenizer",
    "normalize_messages",
    "prepare_chat",
    "render_chat",
    "render_chat_template",
    "render_chat_text",
]
