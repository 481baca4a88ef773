"""What the engine must know about a model before it starts: where it lives, its vocabulary, limits and EOS ids."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

HASH_MODEL_NAME = "hash"
_HASH_MODEL_MAX_MODEL_LEN = 4096


@dataclass(frozen=True)
class ModelInfo:
    """A resolved model reference.

    Invariants: `path` is an existing checkpoint folder (None only for the hash test model); `architecture` is
    the key `kvflow.models.registry.build_model` builds the model by (the checkpoint's Hugging Face architecture, or
    `HASH_MODEL_ARCHITECTURE` exactly when `path` is None); `max_model_len` is the longest sequence the model
    supports (`max_position_embeddings`; sliding-window layers mask keys outside their window, so it is not capped
    by the window); `eos_token_ids[0]` is the primary EOS id when the list is non-empty.
    """

    name: str
    path: Path | None
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    architecture: str

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def is_hash_model(self) -> bool:
        return self.path is None


def resolve_model_path(model: str | None) -> Path | None:
    """`None` -> the built-in default model (created on first use), "hash" -> None, else an existing folder."""
    if model == HASH_MODEL_NAME:
        return None
    if model is None:
        from kvflow.default_model import ensure_default_model

        return ensure_default_model()
    path = Path(model).expanduser()
    if not path.is_dir():
        raise ValueError(
            f"model={model!r}: not a checkpoint folder (kvflow loads Hugging Face checkpoint folders "
            "from local disk; nothing is downloaded)"
        )
    return path


def resolve_model_info(model: str | None) -> ModelInfo:
    """Read the checkpoint's config (and generation_config.json) without loading any weights."""
    path = resolve_model_path(model)
    if path is None:
        from kvflow.models.hash_model import DEFAULT_EOS_TOKEN_ID, DEFAULT_VOCAB_SIZE
        from kvflow.models.registry import HASH_MODEL_ARCHITECTURE

        return ModelInfo(
            HASH_MODEL_NAME,
            None,
            DEFAULT_VOCAB_SIZE,
            _HASH_MODEL_MAX_MODEL_LEN,
            (DEFAULT_EOS_TOKEN_ID,),
            HASH_MODEL_ARCHITECTURE,
        )
    from kvflow.models.hf_config import load_hf_config

    config = load_hf_config(path)
    max_model_len = config.max_position_embeddings
    eos_token_ids = _generation_eos_token_ids(path) or _as_id_tuple(config.eos_token_id)
    return ModelInfo(
        str(model) if model is not None else "default",
        path,
        config.vocab_size,
        max_model_len,
        eos_token_ids,
        config.architecture,
    )


def _generation_eos_token_ids(path: Path) -> tuple[int, ...]:
    """EOS ids from generation_config.json (where chat checkpoints list every end-of-turn token), if present."""
    file = path / "generation_config.json"
    if not file.is_file():
        return ()
    try:
        data = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{file}: not valid JSON ({error})") from error
    return _as_id_tuple(data.get("eos_token_id"))


def _as_id_tuple(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(token_id) for token_id in value)
