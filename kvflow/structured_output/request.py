"""One request's structured-output state, as the engine core keeps it on `Request.structured_output_request`."""

from __future__ import annotations

import math
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

    from kvflow.request import Request
    from kvflow.sampling_params import StructuredOutputsParams
    from kvflow.structured_output.backend import StructuredOutputGrammar
    from kvflow.structured_output.reasoning_end import ReasoningEndDetector, ReasoningGate

GrammarFactory = Callable[[], "StructuredOutputGrammar"]


def _no_owner() -> Request | None:
    return None


@dataclass
class StructuredOutputRequest:
    """The constraint, its compilation, the request's matcher and, under a reasoning parser, its reasoning detector.

    `owner` returns the request this state belongs to (a weak reference: the request holds this object), whose
    prompt decides whether its output starts in reasoning. `reasoning_gate` is the engine's reasoning parser when
    constraints start after reasoning (`StructuredOutputsConfig.constrains_after_reasoning`), else None.

    Invariants: `grammar` is None until `compiled` is done (the request waits in WAITING_FOR_FSM meanwhile) and
    for a streaming-session chunk that asked for no constraint. Otherwise `reasoning_end` is not None exactly while
    the output is still in reasoning (then the matcher has accepted nothing and the request's bitmask rows are left
    unmasked), and the detector and the matcher together have consumed exactly the request's kept output tokens of
    the current chunk, in order: `num_reasoning_tokens` (the one that ended the reasoning included) +
    `grammar.num_processed_tokens` = the chunk's kept output tokens. A discarded in-flight token reaches neither,
    see `StructuredOutputManager`.
    """

    params: StructuredOutputsParams
    compiled: Future[GrammarFactory]
    owner: Callable[[], Request | None] = _no_owner
    # When `compiled` must be done by, on the manager's compile clock (time.monotonic() less the time spent setting
    # up backends): the manager ends the request past it.
    compile_deadline: float = math.inf
    grammar: StructuredOutputGrammar | None = None
    reasoning_gate: ReasoningGate | None = None
    reasoning_end: ReasoningEndDetector | None = None
    num_reasoning_tokens: int = 0

    def start(self, reasoning_gate: ReasoningGate | None = None) -> None:
        """A fresh matcher from the compiled constraint (raises the compile error, if it failed), and the output
        starts in reasoning or constrained as the owner's prompt says."""
        self.grammar = self.compiled.result()()
        self.reasoning_gate = reasoning_gate
        self._begin_output()

    def restart_for_chunk(self, chunk_params: StructuredOutputsParams | None) -> None:
        """A streaming session's new chunk ends the previous continuation. With the session's constraint in the
        chunk's params, the next continuation is constrained from the constraint's start (a fresh matcher, and
        reasoning re-evaluated from the new prompt: the session's prompt, its kept outputs and the chunk); without
        one it is unconstrained. (A chunk naming a different constraint is refused when it is added.)"""
        if chunk_params is None:
            self.grammar = None
            self.reasoning_end = None
            self.num_reasoning_tokens = 0
        elif self.compiled.done():
            self.start(self.reasoning_gate)

    def _begin_output(self) -> None:
        self.num_reasoning_tokens = 0
        self.reasoning_end = None
        request = self.owner()
        if self.reasoning_gate is not None and request is not None:
            self.reasoning_end = self.reasoning_gate.detector_for(
                request.prompt_token_ids, request.sampling_params.skip_special_tokens
            )

    def accept_token(self, token_id: int) -> bool:
        """Take the request's next kept output token (`grammar` must be set): the reasoning detector's while the
        reasoning lasts, the token that ends it included; the matcher's after. False, and no change, if the
        matcher does not allow it."""
        detector = self.reasoning_end
        if detector is None:
            assert self.grammar is not None
            return self.grammar.accept_tokens((token_id,))
        self.num_reasoning_tokens += 1
        if detector.accept(token_id):
            self.reasoning_end = None  # the constraint starts with the next token
        return True

    def valid_draft_prefix(self, drafts: list[int]) -> int:
        """How many leading `drafts` the constraint allows after the kept tokens (speculative decoding verifies
        only those): all of them for a chunk without a constraint, none while the output is in reasoning (a draft
        ending it would leave the ones after it unconstrained), else up to the first the matcher refuses or the
        one that completes the constraint. The matcher is left as it was."""
        if self.grammar is None:
            return len(drafts)
        if self.reasoning_end is not None:
            return 0
        grammar = self.grammar
        num_valid = 0
        for token_id in drafts:
            if grammar.is_terminated() or not grammar.accept_tokens((token_id,)):
                break
            num_valid += 1
        if num_valid:
            grammar.rollback(num_valid)
        return num_valid

    def fill_draft_bitmask(self, bitmask: np.ndarray, first_row: int, drafts: list[int]) -> None:
        """Rows `first_row .. first_row + len(drafts)` of `bitmask`: the tokens allowed after the kept tokens
        and after each prefix of `drafts` (the target's d + 1 verification rows). Rows after a draft the matcher
        refuses are left as they are: verification stops at that draft (its own row forbids it), so they are
        never sampled from. The matcher is left as it was."""
        grammar = self.grammar
        assert grammar is not None and self.reasoning_end is None
        grammar.fill_bitmask(bitmask, first_row)
        num_accepted = 0
        for offset, token_id in enumerate(drafts, 1):
            if grammar.is_terminated() or not grammar.accept_tokens((token_id,)):
                break
            num_accepted += 1
            grammar.fill_bitmask(bitmask, first_row + offset)
        if num_accepted:
            grammar.rollback(num_accepted)

    def is_terminated(self) -> bool:
        """The constraint is complete and its end accepted (never while in reasoning)."""
        return (
            self.reasoning_end is None and self.grammar is not None and self.grammar.is_terminated()
        )
