"""RequestLimits: what a request must fit to run on one engine, checked by the front end and again by the core.

The front end (`InputProcessor`) checks every prompt and parameter before anything is queued, so a client gets a
ValueError naming its field. The engine core (`EngineCore.add_requests`) checks again what reaches it: a request
may come from another process, from a front end of another version, or from a `SamplingParams` changed after it
was built. Together with `SamplingParams.validate` (every number fits the type the engine stores it in), this is
what makes a bad request fail alone: nothing a request carries can raise inside an engine step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvflow.sampling_params import INT64_MAX, INT64_MIN, SamplingParams
from kvflow.utils import short_repr

if TYPE_CHECKING:
    from kvflow.config import ModelConfig
    from kvflow.model_info import ModelInfo
    from kvflow.request import Request


@dataclass(frozen=True)
class RequestLimits:
    """One engine's limits: token ids in [0, `vocab_size`), prompts shorter than `max_model_len`, at most
    `max_logprobs` logprobs (-1: no cap) and none at all for a model without logits (`has_logits` False: the hash
    model samples its own tokens). Every check raises ValueError naming the field at fault."""

    vocab_size: int
    max_model_len: int
    max_logprobs: int = 20
    has_logits: bool = True
    # The hash-logits test model has logits for the sampled rows only, none at prompt positions.
    has_prompt_logits: bool = True

    @classmethod
    def of(
        cls, model_info: ModelInfo, model_config: ModelConfig, max_model_len: int
    ) -> RequestLimits:
        return cls(
            vocab_size=model_info.vocab_size,
            max_model_len=max_model_len,
            max_logprobs=model_config.max_logprobs,
            has_logits=model_info.has_logits,
            has_prompt_logits=not model_info.is_hash_model,
        )

    # ------------------------------------------------------------------------------------------------ checks
    def check_params(self, sampling_params: SamplingParams) -> None:
        """What needs the model: logprobs within the cap and the model's logits, stop token ids in the vocabulary,
        and the logits controls (`allowed_token_ids`, `logit_bias` keys, `bad_words_token_ids`) in the vocabulary
        and on a model with logits. Costs O(size of the controls)."""
        for name in ("logprobs", "prompt_logprobs"):
            self._check_num_logprobs(name, getattr(sampling_params, name))
        self._check_in_vocab("stop_token_ids", sampling_params.stop_token_ids or ())
        if sampling_params.allowed_token_ids is not None:
            self._check_in_vocab("allowed_token_ids", sampling_params.allowed_token_ids)
        if sampling_params.logit_bias is not None:
            self._check_in_vocab("logit_bias", list(sampling_params.logit_bias))
        self._check_bad_words_token_ids(sampling_params.bad_words_token_ids)
        if not self.has_logits:
            for name in ("allowed_token_ids", "logit_bias", "bad_words", "structured_outputs"):
                if getattr(sampling_params, name):
                    raise ValueError(
                        f"SamplingParams.{name}: the hash model samples its own tokens and has no logits, "
                        "so it cannot apply logits controls or structured outputs"
                    )

    def check_request(self, request: Request) -> None:
        """A core request about to be queued: its params (validated again), its prompt's token ids and its
        priority (the scheduler checks the length). Costs O(prompt) in C (min / max), not a Python loop."""
        params = request.sampling_params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        params.validate()
        self.check_params(params)
        token_ids = request.prompt_token_ids
        if token_ids and not (min(token_ids) >= 0 and max(token_ids) < self.vocab_size):
            outside = [t for t in token_ids if not 0 <= t < self.vocab_size]
            raise ValueError(
                f"prompt_token_ids holds {short_list(outside)}, not token ids in [0, {self.vocab_size})"
            )
        if not INT64_MIN <= request.priority <= INT64_MAX:
            raise ValueError(
                f"priority must be an int in [-2**63, 2**63), got {short_repr(request.priority)}"
            )

    def _check_in_vocab(self, name: str, token_ids: Sequence[int]) -> None:
        outside = [t for t in token_ids if t >= self.vocab_size]
        if outside:
            raise ValueError(
                f"SamplingParams.{name} holds {short_list(outside)}, not token ids in [0, {self.vocab_size})"
            )

    def _check_bad_words_token_ids(self, bad_words_token_ids: object) -> None:
        """The engine sets this field from `bad_words`; a request from elsewhere may carry anything, so its shape
        is checked here (`SamplingParams.validate` leaves the derived field alone)."""
        if bad_words_token_ids is None:
            return
        if not isinstance(bad_words_token_ids, list) or not all(
            isinstance(word, list)
            and word
            and all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.vocab_size
                for t in word
            )
            for word in bad_words_token_ids
        ):
            raise ValueError(
                "SamplingParams.bad_words_token_ids must be None or a list of non-empty lists of token ids in "
                f"[0, {self.vocab_size}) (the engine derives it from bad_words), got "
                f"{short_repr(bad_words_token_ids)}"
            )

    def _check_num_logprobs(self, name: str, num_logprobs: int | None) -> None:
        if num_logprobs is None:
            return
        if self.max_logprobs != -1 and num_logprobs > self.max_logprobs:
            raise ValueError(
                f"SamplingParams.{name}={num_logprobs} is more than this engine allows "
                f"(max_logprobs={self.max_logprobs}); ask for fewer or raise max_logprobs"
            )
        if num_logprobs > self.vocab_size:
            raise ValueError(
                f"SamplingParams.{name}={num_logprobs} is more than the vocabulary size "
                f"({self.vocab_size})"
            )
        if name == "prompt_logprobs" and self.has_logits and not self.has_prompt_logits:
            raise ValueError(
                f"SamplingParams.{name}={num_logprobs}: the hash-logits test model has no logits at "
                "prompt positions"
            )
        if not self.has_logits:
            raise ValueError(
                f"SamplingParams.{name}={num_logprobs}: the hash model samples its own tokens and has no "
                "logits, so it cannot return logprobs"
            )


def short_list(values: Sequence[object], limit: int = 8) -> str:
    """`[1, 2, 3]`, or the first `limit` items and an ellipsis, each item's repr bounded."""
    shown = ", ".join(short_repr(value, 24) for value in values[:limit])
    return f"[{shown}{', ...' if len(values) > limit else ''}]"
