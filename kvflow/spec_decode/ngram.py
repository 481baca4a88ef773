"""Prompt-lookup (n-gram) drafts: the tokens that followed the request's last n tokens the last time they occurred.

Repetitive text (code edits, quoting, summaries of the prompt, structured output) often continues the way an
earlier occurrence of its last few tokens did; copying that continuation costs no model call at all.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kvflow.spec_decode.proposer import LookupProposer

if TYPE_CHECKING:
    from kvflow.config import SpeculativeConfig

# Candidates extended one by one in Python (cheaper than numpy's per-call overhead for so few).
_FEW_CANDIDATES = 8


class NgramProposer(LookupProposer):
    """Drafts by prompt lookup in one request's own tokens (prompt and output so far).

    The rule: for n from `prompt_lookup_max` down to `prompt_lookup_min`, if the last n tokens occurred earlier
    in the sequence (an occurrence starting before the final n-gram itself; it may overlap it), the draft is the
    up to `min(num_speculative_tokens, max_drafts)` tokens that followed the most recent such occurrence; the
    first n that matches wins, so a longer match beats a more recent shorter one. No match: no draft ([]).

    Invariants: stateless (one proposer serves every request, on any thread); a draft is never empty when a match
    exists and `max_drafts >= 1` (an earlier occurrence is always followed by at least one token); the cost is one
    vectorised comparison over the sequence plus work on the candidate matches only, so it stays in the tens of
    microseconds for thousands of tokens.
    """

    def __init__(self, config: SpeculativeConfig) -> None:
        if config.method != "ngram":
            raise ValueError(f"NgramProposer needs method 'ngram', got {config.method!r}")
        self.num_speculative_tokens = config.num_speculative_tokens
        self.prompt_lookup_max = config.prompt_lookup_max
        self.prompt_lookup_min = config.prompt_lookup_min

    def propose(self, token_ids: np.ndarray, max_drafts: int) -> list[int]:
        """The draft for a request whose tokens so far are `token_ids` (1-D integers), at most `max_drafts`
        tokens (e.g. what is left of `max_tokens` or of the model's length)."""
        num_drafts = min(self.num_speculative_tokens, max_drafts)
        match_end = self._most_recent_match_end(token_ids)
        if match_end < 0 or num_drafts <= 0:
            return []
        return token_ids[match_end + 1 : match_end + 1 + num_drafts].tolist()

    def _most_recent_match_end(self, token_ids: np.ndarray) -> int:
        """The last index of the chosen earlier occurrence of the final n-gram, or -1 when none matches.

        Candidates are the end positions j < last of earlier runs agreeing with the run ending at `last`; every
        candidate in `ends` agrees over `length` tokens. While there are many, numpy filters them one length at a
        time; the few left are extended in Python, most recent first, stopping at the first full-length match.
        """
        last = len(token_ids) - 1
        lookup_max = self.prompt_lookup_max
        if last < self.prompt_lookup_min:
            return -1  # too short to hold the n-gram and an earlier occurrence of it
        ends = np.flatnonzero(token_ids[:last] == token_ids[last])
        length = 1
        best_end, best_length = -1, 0
        while ends.size > _FEW_CANDIDATES and length < lookup_max:
            best_end, best_length = int(ends[-1]), length  # ascending: the last is the most recent
            ends = ends[ends >= length]  # an occurrence needs a token before it to grow
            ends = ends[token_ids[ends - length] == token_ids[last - length]]
            length += 1
        if ends.size:
            # The suffix, read backwards from `last`: suffix[n] is token_ids[last - n].
            suffix = token_ids[max(last - lookup_max + 1, 0) : last + 1].tolist()[::-1]
            for end in reversed(ends.tolist()):
                window = token_ids[max(end - lookup_max + 1, 0) : end + 1].tolist()[::-1]
                matched = length
                while matched < min(lookup_max, len(window)) and window[matched] == suffix[matched]:
                    matched += 1
                if matched > best_length:
                    best_end, best_length = end, matched
                if matched == lookup_max:
                    break
        return best_end if best_length >= self.prompt_lookup_min else -1
