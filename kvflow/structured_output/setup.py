"""Whether an engine core gets a `StructuredOutputManager`, and over which vocabulary."""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

from kvflow.structured_output.backend import GrammarVocab
from kvflow.structured_output.manager import StructuredOutputManager

if TYPE_CHECKING:
    from kvflow.config import EngineConfig
    from kvflow.model_info import ModelInfo


def make_structured_output_manager(
    engine_config: EngineConfig, model_info: ModelInfo
) -> tuple[StructuredOutputManager | None, str]:
    """The engine core's manager, or None and the reason structured outputs are unavailable (no logits, or no
    tokenizer). Nothing is compiled or loaded until the first constrained request."""
    if not model_info.has_logits:
        return None, f"model {model_info.name!r} samples its own tokens and has no logits to mask"
    model_config = engine_config.model_config
    if model_info.is_hash_model:
        vocab_factory = partial(_hash_vocab, model_info.vocab_size)
    elif model_config.skip_tokenizer_init:
        return None, "needs a tokenizer (the engine runs with skip_tokenizer_init)"
    else:
        tokenizer_path = model_config.tokenizer or model_info.path
        vocab_factory = partial(
            _tokenizer_vocab, str(tokenizer_path), model_info.vocab_size, model_info.eos_token_ids
        )
    manager = StructuredOutputManager(
        engine_config.structured_outputs_config, vocab_factory, model_info.vocab_size
    )
    return manager, ""


def _tokenizer_vocab(path: str, vocab_size: int, eos_token_ids: tuple[int, ...]) -> GrammarVocab:
    from kvflow.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(path)
    eos = tuple(dict.fromkeys([*eos_token_ids, *tokenizer.eos_token_ids]))
    return GrammarVocab(vocab_size, eos, tokenizer=tokenizer)


def _hash_vocab(vocab_size: int) -> GrammarVocab:
    from kvflow.models.hash_model import hash_grammar_stop_token_id, hash_grammar_token_bytes

    return GrammarVocab(
        vocab_size,
        (hash_grammar_stop_token_id(vocab_size),),
        token_bytes=hash_grammar_token_bytes(vocab_size),
    )
