"""Structured outputs: decoding constrained to a JSON schema, regex, choice or grammar (vLLM V1's design).

    backend.py           the backend / grammar interface, the token bitmask format, the vocabulary a backend reads
    backend_xgrammar.py  the `xgrammar` backend (the default)
    backend_guidance.py  the `llguidance` backend
    manager.py           `StructuredOutputManager`: compiles off the engine loop, builds each step's bitmask
    request.py           one request's state: its matcher and, under a reasoning parser, its reasoning detector
    reasoning_end.py     where a constraint starts under `--reasoning-parser`: after the output's reasoning
    validation.py        the syntax check the API server runs before anything is queued

Backends are registered in `STRUCTURED_OUTPUT_BACKENDS` (the one registry shape) and imported only when used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvflow.registry import LazyRegistry

if TYPE_CHECKING:
    from kvflow.structured_output.backend import StructuredOutputBackend

STRUCTURED_OUTPUT_BACKENDS: LazyRegistry[type[StructuredOutputBackend]] = LazyRegistry(
    "structured outputs backend",
    {
        "xgrammar": "kvflow.structured_output.backend_xgrammar:XgrammarBackend",
        "guidance": "kvflow.structured_output.backend_guidance:GuidanceBackend",
    },
)

__all__ = ["STRUCTURED_OUTPUT_BACKENDS"]
