"""The `Tokenizer`: a fast `tokenizers.Tokenizer` (tokenizer.json) plus what tokenizer_config.json and friends add:
BOS/EOS handling, special tokens, and the checkpoint's chat templates (rendered by `kvflow.tokenizer.chat`).

Loading from a checkpoint folder is `kvflow.tokenizer.loading.load_tokenizer`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from functools import cached_property
from typing import Any

import tokenizers

from kvflow.tokenizer.chat import render_chat, render_chat_text
from kvflow.tokenizer.template import CompiledTemplates, render_chat_template

logger = logging.getLogger(__name__)

# Texts at least this long are encoded through `encode_batch`, which releases the GIL while it works.
_LONG_TEXT_CHARS = 4096


class Tokenizer:
    """A fast tokenizer plus the configuration that `transformers` layers on top of it.

    Invariants: every id this class reports (`bos_token_id`, `eos_token_id`, `eos_token_ids`, `all_special_ids`)
    is below `vocab_size`; `eos_token_id == eos_token_ids[0]` whenever either is set; `encode(text)` adds BOS
    exactly once when the configuration asks for it (`add_bos_token`, or the post-processor), never twice;
    `decode` is the plain `tokenizers` decode (no `clean_up_tokenization_spaces`), so incremental decoding can
    reproduce it exactly.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        name_or_path: str = "",
        special_tokens: Mapping[str, str | None] | None = None,
        bos_token_id: int | None = None,
        eos_token_ids: Sequence[int] = (),
        add_bos_token: bool | None = None,
        add_eos_token: bool | None = None,
        extra_special_tokens: Iterable[str] = (),
        chat_template: str | None = None,
        named_chat_templates: Mapping[str, str] | None = None,
    ) -> None:
        """`special_tokens` maps "bos_token"/"eos_token"/"unk_token"/"pad_token" to token strings;
        `bos_token_id` and `eos_token_ids` are fallbacks and extra EOS ids (generation_config.json);
        `add_bos_token`/`add_eos_token` None means "as the post-processor does"."""
        self._backend = backend
        self.name_or_path = name_or_path
        self._vocab_size = max(
            backend.get_vocab_size(with_added_tokens=True),
            max(backend.get_added_tokens_decoder(), default=-1) + 1,
        )
        self._special_tokens: dict[str, str] = {}
        for name, token in (special_tokens or {}).items():
            if token is None:
                continue
            if backend.token_to_id(token) is None:
                logger.warning(
                    "%s: %s %r is not in the vocabulary; ignoring it",
                    name_or_path or "tokenizer",
                    name,
                    token,
                )
                continue
            self._special_tokens[name] = token
        self._bos_token_id = self._named_token_id("bos_token")
        if self._bos_token_id is None and bos_token_id is not None and self._valid_id(bos_token_id):
            self._bos_token_id = bos_token_id
            self._special_tokens["bos_token"] = backend.id_to_token(bos_token_id)
        self._eos_token_ids = self._resolve_eos_ids(eos_token_ids)
        if "eos_token" not in self._special_tokens and self._eos_token_ids:
            self._special_tokens["eos_token"] = backend.id_to_token(self._eos_token_ids[0])
        self._extra_special_ids = {backend.token_to_id(token) for token in extra_special_tokens} - {
            None
        }
        self._add_bos_token = add_bos_token
        self._add_eos_token = add_eos_token
        self._post_processor_adds_bos, self._post_processor_adds_eos = self._probe_post_processor()
        self._chat_template = chat_template
        self._named_chat_templates = dict(named_chat_templates or {})
        self._compiled_templates = CompiledTemplates()

    # ------------------------------------------------------------------------------------------------ ids
    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The wrapped `tokenizers.Tokenizer` (for callers that need its fast paths)."""
        return self._backend

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (the model's vocabulary may be padded beyond it)."""
        return self._vocab_size

    def __len__(self) -> int:
        return self._vocab_size

    @property
    def bos_token(self) -> str | None:
        return self._special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self._special_tokens.get("eos_token")

    @property
    def pad_token(self) -> str | None:
        return self._special_tokens.get("pad_token")

    @property
    def unk_token(self) -> str | None:
        return self._special_tokens.get("unk_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def eos_token_id(self) -> int | None:
        """The primary EOS id (tokenizer_config.json's eos_token, else generation_config.json's first)."""
        return self._eos_token_ids[0] if self._eos_token_ids else None

    @property
    def eos_token_ids(self) -> list[int]:
        """Every id that ends generation: the primary EOS first, then generation_config.json's (or config.json's)."""
        return list(self._eos_token_ids)

    @property
    def pad_token_id(self) -> int | None:
        return self._named_token_id("pad_token")

    @property
    def all_special_ids(self) -> set[int]:
        """Ids of the named special tokens (bos/eos/unk/pad) and of every added token marked special (a copy)."""
        return set(self._all_special_ids)

    @cached_property
    def _all_special_ids(self) -> frozenset[int]:
        ids = {
            token_id
            for token_id, added in self._backend.get_added_tokens_decoder().items()
            if added.special
        }
        ids |= {self._backend.token_to_id(token) for token in self._special_tokens.values()}
        return frozenset(ids | self._extra_special_ids)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str]:
        """Token strings as stored in the vocabulary (byte-level BPE shows bytes as e.g. 'Ġ'); "" for unknown ids."""
        return [self._backend.id_to_token(int(token_id)) or "" for token_id in ids]

    # ------------------------------------------------------------------------------------------------ text
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with `add_special_tokens`, BOS (and EOS) as the configuration says. A long text
        goes through `encode_batch`, which lets other threads run (an event loop, say) while it tokenizes."""
        if len(text) >= _LONG_TEXT_CHARS:
            encoding = self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0]
        else:
            encoding = self._backend.encode(text, add_special_tokens=add_special_tokens)
        ids = encoding.ids
        if add_special_tokens:
            ids = self._apply_add_bos_eos(ids)
        return ids

    def encode_pair(self, text: str, text_pair: str) -> tuple[list[int], list[int]]:
        """`(token ids, token type ids)` of a text pair as the tokenizer's post-processor joins them (BERT:
        `[CLS] a [SEP] b [SEP]`, types 0 then 1; XLM-RoBERTa: `<s> a </s></s> b </s>`, all 0): the input of a
        cross-encoder. A tokenizer without a pair template joins the two encodings as they are."""
        encoding = self._backend.encode(text, text_pair, add_special_tokens=True)
        return list(encoding.ids), list(encoding.type_ids)

    def decode(self, token_ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(
            [int(token_id) for token_id in token_ids], skip_special_tokens=skip_special_tokens
        )

    # ------------------------------------------------------------------------------------------------ chat
    @property
    def chat_template(self) -> str | None:
        """The default chat template source, or None (a checkpoint may still have named templates)."""
        return self._chat_template

    @property
    def named_chat_templates(self) -> dict[str, str]:
        return dict(self._named_chat_templates)

    @property
    def template_special_tokens(self) -> dict[str, str]:
        """The special tokens a chat template sees as variables (`bos_token`, `eos_token`, ...), a copy."""
        return dict(self._special_tokens)

    def is_named_chat_template(self, chat_template: str | None) -> bool:
        """Whether `chat_template` names one of the checkpoint's own templates (None: its default)."""
        return chat_template is None or chat_template in self._named_chat_templates

    def chat_template_source(self, chat_template: str | None = None) -> str:
        """The Jinja source `chat_template` stands for: one of the checkpoint's named templates, a template's own
        text, or (None) the checkpoint's default; ValueError when the checkpoint has no default to fall back on."""
        if chat_template is not None:
            return self._named_chat_templates.get(chat_template, chat_template)
        if self._chat_template is not None:
            return self._chat_template
        name = self.name_or_path or "this tokenizer"
        if self._named_chat_templates:
            raise ValueError(
                f"{name} has several chat templates and no default: pass chat_template= one of "
                f"{sorted(self._named_chat_templates)}"
            )
        raise ValueError(
            f"{name} has no chat template (the checkpoint ships none): pass chat_template= a Jinja "
            "template or a template file"
        )

    def render_template(self, source: str, variables: Mapping[str, Any]) -> str:
        """Render the template `source` with `variables`, compiled once (an LRU cache); ChatTemplateError when it
        fails. The conversation-level entry point is `kvflow.tokenizer.chat.render_chat`."""
        return render_chat_template(self._compiled_templates.get(source), variables)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """The prompt text of a conversation: `render_chat(...).prompt_text` (see `kvflow.tokenizer.chat`), with
        extra keyword arguments passed to the template as `chat_template_kwargs`."""
        return render_chat_text(
            self,
            messages,
            chat_template=chat_template,
            chat_template_kwargs=kwargs,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
        )

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> list[int]:
        """The prompt token ids of a conversation: `render_chat(...).prompt_token_ids`."""
        return render_chat(
            self,
            messages,
            chat_template=chat_template,
            chat_template_kwargs=kwargs,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
        ).prompt_token_ids

    # ------------------------------------------------------------------------------------------------ internals
    def _valid_id(self, token_id: int) -> bool:
        return 0 <= token_id < self._vocab_size

    def _named_token_id(self, name: str) -> int | None:
        token = self._special_tokens.get(name)
        return self._backend.token_to_id(token) if token is not None else None

    def _resolve_eos_ids(self, extra_eos_ids: Sequence[int]) -> list[int]:
        eos_ids: list[int] = []
        named_eos = self._named_token_id("eos_token")
        for token_id in ([named_eos] if named_eos is not None else []) + [
            int(i) for i in extra_eos_ids
        ]:
            if not self._valid_id(token_id):
                logger.warning(
                    "%s: EOS id %d is outside the vocabulary (%d); ignoring it",
                    self.name_or_path or "tokenizer",
                    token_id,
                    self._vocab_size,
                )
            elif token_id not in eos_ids:
                eos_ids.append(token_id)
        return eos_ids

    def _probe_post_processor(self) -> tuple[bool, bool]:
        """Whether the post-processor itself adds BOS before / EOS after a sequence."""
        plain = self._backend.encode("a", add_special_tokens=False).ids
        full = self._backend.encode("a", add_special_tokens=True).ids
        start = next(
            (k for k in range(len(full) - len(plain) + 1) if full[k : k + len(plain)] == plain),
            None,
        )
        if start is None:
            return False, False
        prefix, suffix = full[:start], full[start + len(plain) :]
        adds_bos = bool(prefix) and prefix[0] == self._bos_token_id
        adds_eos = bool(suffix) and suffix[-1] == self.eos_token_id
        return adds_bos, adds_eos

    def _apply_add_bos_eos(self, ids: list[int]) -> list[int]:
        if self._bos_token_id is not None:
            if self._add_bos_token and not self._post_processor_adds_bos:
                ids = [self._bos_token_id, *ids]
            elif self._add_bos_token is False and self._post_processor_adds_bos:
                ids = ids[1:]
        eos_token_id = self.eos_token_id
        if eos_token_id is not None:
            if self._add_eos_token and not self._post_processor_adds_eos:
                ids = [*ids, eos_token_id]
            elif self._add_eos_token is False and self._post_processor_adds_eos:
                ids = ids[:-1]
        return ids

    def __repr__(self) -> str:
        return (
            f"Tokenizer(name_or_path={self.name_or_path!r}, vocab_size={self._vocab_size}, "
            f"bos_token_id={self._bos_token_id}, eos_token_ids={self._eos_token_ids})"
        )
