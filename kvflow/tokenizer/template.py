"""Chat templates as Jinja: compiled and rendered the way `transformers` does it (immutable sandbox, same globals and
filters), so prompts match the reference exactly.

Imports nothing from kvflow, so the server's template sandbox process (`entrypoints/openai/template_sandbox.py`)
can load it without torch.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

COMPILED_TEMPLATE_CACHE_SIZE = 64


class ChatTemplateError(ValueError):
    """A chat template failed to compile or render (including `raise_exception` calls and sandbox violations)."""


class CompiledTemplates:
    """Compiled templates by source, least recently used first.

    Invariant: holds at most `max_size` templates (request templates come and go, so the cache is bounded).
    """

    def __init__(self, max_size: int = COMPILED_TEMPLATE_CACHE_SIZE) -> None:
        self.max_size = max_size
        self._templates: OrderedDict[str, jinja2.Template] = OrderedDict()

    def get(self, source: str) -> jinja2.Template:
        """The compiled template of `source` (ChatTemplateError if it is not valid Jinja)."""
        template = self._templates.get(source)
        if template is None:
            template = compile_chat_template(source)
            self._templates[source] = template
            if len(self._templates) > self.max_size:
                self._templates.popitem(last=False)
        else:
            self._templates.move_to_end(source)
        return template

    def __len__(self) -> int:
        return len(self._templates)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Like transformers: no HTML escaping (Jinja's own tojson escapes <, >, & and '), unicode kept as is.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(date_format: str) -> str:
    return datetime.now().strftime(date_format)


class _GenerationTagExtension(jinja2.ext.Extension):
    """Accepts transformers' `{% generation %}...{% endgeneration %}` (assistant-mask markers) and renders the body
    unchanged, so templates that use it work here too."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(
            lineno
        )

    @staticmethod
    def _render_body(caller: Callable[[], str]) -> str:
        return caller()


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in the sandboxed environment `transformers` uses (immutable sandbox,
    trim_blocks/lstrip_blocks, loop controls, `raise_exception`, `strftime_now`, unescaped `tojson`)."""
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _GenerationTagExtension],
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    try:
        return environment.from_string(source)
    except jinja2.TemplateSyntaxError as error:
        raise ChatTemplateError(
            f"chat template is not valid Jinja (line {error.lineno}): {error.message}"
        ) from error


def render_chat_template(
    template: jinja2.Template, variables: Mapping[str, Any], max_chars: int | None = None
) -> str:
    """Render a compiled chat template; every failure is a ChatTemplateError saying why. With `max_chars`, the
    rendering stops (ChatTemplateError) as soon as its output grows past that many characters."""
    try:
        if max_chars is None:
            return template.render(**variables)
        pieces: list[str] = []
        num_chars = 0
        for piece in template.generate(**variables):
            num_chars += len(piece)
            if num_chars > max_chars:
                raise ChatTemplateError(
                    f"chat template output is longer than {max_chars} characters"
                )
            pieces.append(piece)
        return "".join(pieces)
    except jinja2.exceptions.SecurityError as error:
        raise ChatTemplateError(f"chat template attempted an unsafe operation: {error}") from error
    except jinja2.TemplateError as error:
        raise ChatTemplateError(f"chat template error: {error}") from error
    except (
        TypeError,
        AttributeError,
    ) as error:  # e.g. iterating a value the template did not expect
        raise ChatTemplateError(
            f"chat template error: {error} (the template cannot render these messages)"
        ) from error
