"""The explorer: depth-first enumeration of every interleaving up to a depth, with state deduplication."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from kvflow.testing.interleavings.checks import check_state
from kvflow.testing.interleavings.model import (
    Action,
    CheckerConfig,
    InterleavingViolation,
    NotApplicable,
    SearchResult,
)
from kvflow.testing.interleavings.world import World

logger = logging.getLogger(__name__)


class _Search:
    """Depth-first enumeration with deduplication. `best_remaining[key]` is the most remaining depth a state was
    expanded with (it is expanded again only with more); `children[key]` its successors, in action order."""

    def __init__(self, config: CheckerConfig) -> None:
        self.config = config
        self.world = World(config)
        self.result = SearchResult(config)
        self.best_remaining: dict[int, int] = {}
        self.children: dict[int, list[int]] = {}
        self.drained_ok: set[int] = set()
        self.trace: list[Action] = []

    def run(self) -> SearchResult:
        start = time.perf_counter()
        world = self.world
        root = world.key()
        self._explore(root, *self._visit_new(root), self.config.depth)
        result = self.result
        result.num_states = len(self.best_remaining)
        result.events = world.events
        result.num_interleavings = self._count_interleavings(root, self.config.depth) - 1
        result.elapsed_s = time.perf_counter() - start
        logger.info("%s", result.summary())
        return result

    def _visit_new(self, key: int, keep: bool = True) -> tuple[bytes, bool]:
        """Check a state reached for the first time and drain it. With `keep`, returns its snapshot and whether
        the world is still in that state (the drain found it already known); without, the state is not needed
        again (it will not be expanded) and no snapshot is taken."""
        world = self.world
        self._checked(lambda: check_state(world))
        snapshot = world.snapshot() if keep else b""
        self.result.num_drains += 1
        num_steps = self._checked(lambda: world.drain(self.drained_ok, key), in_drain=True)
        self.result.num_drain_steps += num_steps or 0
        self.best_remaining[key] = 0
        return snapshot, num_steps is None

    def _explore(self, key: int, snapshot: bytes, in_state: bool, remaining: int) -> None:
        """Expand the state `key` (saved in `snapshot`; `in_state`: the world is in it) with `remaining` actions
        left."""
        self.best_remaining[key] = remaining
        if remaining == 0:
            return
        if (
            self.config.max_states is not None
            and len(self.best_remaining) >= self.config.max_states
        ):
            self.result.complete = False
            return
        world = self.world
        if not in_state:
            world.restore(snapshot)
        actions = world.enabled_actions()
        children: list[int] = []
        index = -1
        while index + 1 < len(actions):
            index += 1
            action = actions[index]
            if index:
                world.restore(snapshot)
            num_in_flight = len(world.core.batch_queue)
            self.trace.append(action)
            try:
                self._checked(lambda action=action: world.apply(action))
            except NotApplicable:
                self.trace.pop()
                continue
            if action.outcome == 0 and world.num_outcomes > 1:
                # The batch it ran can end in several ways (accepted draft lengths): each is an action.
                actions[index + 1 : index + 1] = self._other_outcomes(action, world.num_outcomes)
            self.result.coverage[(action.kind, num_in_flight)] += 1
            self.result.num_transitions += 1
            child = world.key()
            children.append(child)
            seen = self.best_remaining.get(child)
            if seen is None and remaining == 1:
                self._visit_new(child, keep=False)  # a leaf: checked and drained, never expanded
            elif seen is None:
                self._explore(child, *self._visit_new(child), remaining - 1)
            elif seen < remaining - 1:
                self._explore(child, world.snapshot(), True, remaining - 1)
            self.trace.pop()
        self.children.setdefault(key, children)

    def _other_outcomes(self, action: Action, num_outcomes: int) -> list[Action]:
        if num_outcomes > self.config.max_worker_outcomes:
            raise ValueError(
                f"a batch has {num_outcomes} outcomes, over max_worker_outcomes="
                f"{self.config.max_worker_outcomes}, after {' '.join(map(str, self.trace))}"
            )
        self.result.max_outcomes = max(self.result.max_outcomes, num_outcomes)
        return [Action(action.kind, action.arg, outcome) for outcome in range(1, num_outcomes)]

    def _checked(self, run: Callable[[], Any], in_drain: bool = False) -> Any:
        """`run()`, with any failure (an invariant, or an error raised by the engine) turned into an
        `InterleavingViolation` carrying the trace."""
        try:
            return run()
        except (NotApplicable, InterleavingViolation):
            raise
        except Exception as error:
            message = f"{type(error).__name__}: {error}"
            raise InterleavingViolation(message, self.trace, in_drain) from error

    def _count_interleavings(self, root: int, depth: int) -> int:
        """Action sequences of length 0..depth from the root, counted over the explored graph."""
        memo: dict[tuple[int, int], int] = {}

        def count(key: int, remaining: int) -> int:
            if remaining == 0:
                return 1
            cached = memo.get((key, remaining))
            if cached is None:
                cached = 1 + sum(
                    count(child, remaining - 1) for child in self.children.get(key, ())
                )
                memo[(key, remaining)] = cached
            return cached

        return count(root, depth)


def explore(config: CheckerConfig) -> SearchResult:
    """Enumerate every interleaving of `config` up to `config.depth` actions and check each state (see the module
    docstring). Raises `InterleavingViolation` (with the action trace) on the first violation."""
    return _Search(config).run()


def find_violation(config: CheckerConfig) -> InterleavingViolation | None:
    """The first violation the search meets, or None when every interleaving passes."""
    try:
        explore(config)
    except InterleavingViolation as violation:
        return violation
    return None
