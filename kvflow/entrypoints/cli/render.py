"""How the commands print samples and logprobs (plain text; parse-friendly where documented in --help)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvflow.outputs import Logprob


def sample_header(prompt_index: int, sample_index: int) -> str:
    """The line before each sample when a run prints more than one: `[prompt 0, sample 1]`."""
    return f"[prompt {prompt_index}, sample {sample_index}]"


def format_token_ids(token_ids: Sequence[int]) -> str:
    """`1,2,3`: the same form `--prompt-token-ids` and `--stop-token-ids` read."""
    return ",".join(str(token_id) for token_id in token_ids)


def token_label(token_id: int, logprob: Logprob | None) -> str:
    """`' the'(262)`: the token's text in Python quotes (so spaces and newlines show), then its id."""
    if logprob is None or logprob.decoded_token is None:
        return f"({token_id})"
    return f"{logprob.decoded_token!r}({token_id})"


def format_logprobs(
    token_ids: Sequence[int],
    logprobs: Sequence[dict[int, Logprob]],
    num_top: int,
    cumulative_logprob: float | None,
) -> list[str]:
    """One line per generated token: position, token, its logprob and rank, then the `num_top` most likely
    tokens with their logprobs; a last line with the sum. `logprobs[i]` belongs to `token_ids[i]`.

        logprobs: position  token(id)  logprob  rank  | top-2: token(id) logprob ...
             0  ' the'(262)  -1.2346  #1  | ' the'(262) -1.2346  ' a'(64) -2.1000
        cumulative logprob: -12.3456
    """
    header = "logprobs: position  token(id)  logprob  rank"
    lines = [header + (f"  | top-{num_top}: token(id) logprob ..." if num_top else "")]
    labels = [
        token_label(t, entries.get(t)) for t, entries in zip(token_ids, logprobs, strict=False)
    ]
    width = max((len(label) for label in labels), default=0)
    for position, (token_id, entries) in enumerate(zip(token_ids, logprobs, strict=False)):
        sampled = entries.get(token_id)
        value = f"{sampled.logprob:9.4f}" if sampled is not None else "        ?"
        rank = f"#{sampled.rank}" if sampled is not None and sampled.rank is not None else "#?"
        line = f"{position:6d}  {labels[position]:<{width}}  {value}  {rank:>4}"
        top = sorted(
            (
                item
                for item in entries.items()
                if item[1].rank is not None and item[1].rank <= num_top
            ),
            key=lambda item: item[1].rank or 0,
        )
        if top:
            line += "  | " + "  ".join(f"{token_label(t, lp)} {lp.logprob:.4f}" for t, lp in top)
        lines.append(line)
    if cumulative_logprob is not None:
        lines.append(f"cumulative logprob: {cumulative_logprob:.4f}")
    return lines
