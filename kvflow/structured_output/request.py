"""One request's structured-output state, as the engine core keeps it on `Request.structured_output_request`."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvflow.sampling_params import StructuredOutputsParams
    from kvflow.structured_output.backend import StructuredOutputGrammar

GrammarFactory = Callable[[], "StructuredOutputGrammar"]


@dataclass
class StructuredOutputRequest:
    """The constraint, its compilation and the request's matcher.

    Invariants: `grammar` is None until `compiled` is done (the request waits in WAITING_FOR_FSM meanwhile) and
    for a streaming-session chunk that asked for no constraint; otherwise it has accepted exactly the request's
    output tokens of the current chunk (never a discarded in-flight token), see `StructuredOutputManager`.
    """

    params: StructuredOutputsParams
    compiled: Future[GrammarFactory]
    grammar: StructuredOutputGrammar | None = None

    def start(self) -> None:
        """A fresh matcher from the compiled constraint (raises the compile error, if it failed)."""
        self.grammar = self.compiled.result()()

    def restart_for_chunk(self, chunk_params: StructuredOutputsParams | None) -> None:
        """A streaming session's new chunk ends the previous continuation. With the session's constraint in the
        chunk's params, the next continuation is constrained from the constraint's start (a fresh matcher); without
        one it is unconstrained. (A chunk naming a different constraint is refused when it is added.)"""
        if chunk_params is None:
            self.grammar = None
        elif self.compiled.done():
            self.start()
