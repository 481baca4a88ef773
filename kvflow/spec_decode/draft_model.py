"""Draft-model proposals: a smaller model with the target's tokenizer drafts the next tokens (not implemented yet).

`speculative_config={"method": "draft_model", "model": PATH, ...}` parses, and `EngineArgs` refuses it by name
until the engine runs a second model; this class holds the registry entry so the refusal is a clear message, not
an import error.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvflow.config import SpeculativeConfig


class DraftModelProposer:
    """Drafts from a smaller model (not implemented yet: constructing one raises NotImplementedError)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        raise NotImplementedError(
            f"speculative_config method 'draft_model' (model {config.model!r}) is not implemented yet; "
            "use method 'ngram'"
        )
