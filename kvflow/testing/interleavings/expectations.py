"""What the checker expects of each added request: its rounds (a session's chunks) and their tokens so far, each
checked against the hash-model oracle as outputs arrive."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvflow.testing.interleavings.model import oracle

if TYPE_CHECKING:
    from kvflow.core.sched.output import EngineCoreOutput


@dataclass
class Chunk:
    """One generation round of a request (a session's chunk): the prompt it ran on (folded) and its tokens."""

    prompt: tuple[int, ...]
    max_tokens: int
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None

    def key(self) -> tuple[Any, ...]:
        return self.prompt, self.max_tokens, tuple(self.tokens), self.finish_reason


@dataclass
class Track:
    """What the checker expects of one added request. Invariant: `chunks[-1]` is the round that runs now;
    `unfed` are session chunks not sent yet, `sent` those sent while a round ran (applied when it stops)."""

    request_id: str
    is_session: bool
    chunks: list[Chunk]
    unfed: list[tuple[tuple[int, ...], int]] = field(default_factory=list)
    sent: list[tuple[tuple[int, ...], int]] = field(default_factory=list)
    closing: bool = False
    aborted: bool = False
    done: bool = False

    def key(self) -> tuple[Any, ...]:
        return (
            self.request_id,
            tuple(chunk.key() for chunk in self.chunks),
            tuple(self.unfed),
            tuple(self.sent),
            self.closing,
            self.aborted,
            self.done,
        )

    def fold(self, update: tuple[tuple[int, ...], int]) -> None:
        """Mirror the scheduler: a round's outputs except the last sampled token fold into the prompt."""
        previous = self.chunks[-1]
        prompt = previous.prompt + tuple(previous.tokens[:-1]) + update[0]
        self.chunks.append(Chunk(prompt, update[1]))


@dataclass
class Tracker:
    """The checker's expectations: added requests, the next to add, and the requests a "wait" pause holds.

    Invariant: a track is `done` exactly when its request left the scheduler (finished, aborted or closed).
    """

    tracks: dict[str, Track] = field(default_factory=dict)
    num_added: int = 0
    held_by_wait: frozenset[str] | None = None  # None: no "wait" pause

    def key(self) -> tuple[Any, ...]:
        return (
            tuple(track.key() for track in self.tracks.values()),
            self.num_added,
            self.held_by_wait,
        )

    def live(self) -> list[Track]:
        return [track for track in self.tracks.values() if not track.done]

    def consume(self, output: EngineCoreOutput, frozen: bool) -> None:
        track = self.tracks.get(output.request_id)
        assert track is not None and not track.done, f"output for a finished request: {output}"
        if frozen:
            assert not output.new_token_ids, f"tokens emitted while a pause is in effect: {output}"
        if self.held_by_wait is not None and output.request_id in self.held_by_wait:
            assert not output.new_token_ids, f"a request held by a wait pause ran: {output}"
        chunk = track.chunks[-1]
        chunk.tokens.extend(output.new_token_ids)
        expected = oracle(chunk.prompt, chunk.max_tokens)
        assert tuple(chunk.tokens) == expected[: len(chunk.tokens)], (
            f"{output.request_id}: tokens {chunk.tokens} do not continue the oracle {list(expected)}"
        )
        assert len(chunk.tokens) <= chunk.max_tokens, f"{output.request_id}: past max_tokens"
        if output.finish_reason is None:
            return
        chunk.finish_reason = output.finish_reason
        if output.finish_reason == "abort":
            track.aborted = True
        else:
            assert output.finish_reason == "length", f"unexpected finish: {output}"
            assert tuple(chunk.tokens) == expected, (
                f"{output.request_id} finished with {chunk.tokens}, expected {list(expected)}"
            )
        if not output.session_continues:
            track.done = True
        elif track.sent:
            track.fold(track.sent.pop(0))
