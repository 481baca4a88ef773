"""What the engine must know about a model before it starts: where it lives, its vocabulary, limits and EOS ids."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvflow.builtin_models import HASH_ARCHITECTURES, HASH_MODEL_ARCHITECTURE

_HASH_MODEL_MAX_MODEL_LEN = 4096

GENERATION_CONFIG_FILE = "generation_config.json"
# generation_config.json keys that become request defaults (vLLM's list), and the SamplingParams field each sets.
SAMPLING_DEFAULT_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
_INT_FIELDS = frozenset({"top_k", "max_tokens"})


@dataclass(frozen=True)
class ModelInfo:
    """A resolved model reference.

    Invariants: `path` is an existing checkpoint folder or GGUF file (None only for the hash test model);
    `architecture` is
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

    @property
    def has_logits(self) -> bool:
        """False only for the hash model that samples its own tokens ("hash"; "hash-logits" has logits)."""
        return self.architecture != HASH_MODEL_ARCHITECTURE


def resolve_model_path(model: str | None, revision: str | None = None) -> Path | None:
    """`None` -> the built-in default model (created on first use), "hash" / "hash-logits" -> None, an existing
    folder or *.gguf file -> itself, a Hugging Face id ("org/name") -> its snapshot in the local Hugging Face
    cache (`revision`: a branch, tag or commit; default "main"). Nothing is downloaded; a miss is a ValueError
    saying where kvflow looked."""
    if model in HASH_ARCHITECTURES:
        return None
    if model is None:
        from kvflow.default_model import ensure_default_model

        return ensure_default_model()
    path = Path(model).expanduser()
    if path.is_dir() or (path.suffix == ".gguf" and path.is_file()):
        return path
    if _looks_like_hub_id(model):
        return _cached_snapshot(model, revision)
    raise ValueError(
        f"model={model!r}: not a checkpoint folder or .gguf file (kvflow loads Hugging Face checkpoint "
        "folders and GGUF files from local disk, or an org/name id already in the local Hugging Face cache; "
        "nothing is downloaded)"
    )


def _looks_like_hub_id(model: str) -> bool:
    """ "org/name": exactly one slash, neither part empty or a path component like "." or "~"."""
    parts = model.split("/")
    return (
        len(parts) == 2
        and all(parts)
        and not model.startswith(("~", "."))
        and not any(part in (".", "..") for part in parts)
    )


def _cached_snapshot(repo_id: str, revision: str | None) -> Path:
    """The snapshot folder of `repo_id` in the local Hugging Face cache (huggingface_hub's own lookup: HF_HOME,
    HF_HUB_CACHE), offline."""
    try:
        from huggingface_hub import constants, snapshot_download
    except (
        ImportError
    ) as error:  # kvflow does not depend on huggingface_hub; transformers brings it
        raise ValueError(
            f"model={repo_id!r}: looks like a Hugging Face id, and resolving it from the local cache needs the "
            "huggingface_hub package (pip install huggingface_hub), or pass the checkpoint folder"
        ) from error
    try:
        folder = snapshot_download(repo_id, revision=revision, local_files_only=True)
    except (
        Exception
    ) as error:  # huggingface_hub's "not in the cache" errors differ between versions
        where = constants.HF_HUB_CACHE
        raise ValueError(
            f"model={repo_id!r}{'' if revision is None else f' (revision {revision!r})'}: no such folder, and "
            f"not in the local Hugging Face cache ({where}; set HF_HOME or HF_HUB_CACHE to use another); kvflow "
            f"downloads nothing: run `huggingface-cli download {repo_id}` first, or pass the checkpoint folder"
        ) from error
    return Path(folder)


def resolve_model_info(model: str | None, revision: str | None = None) -> ModelInfo:
    """Read the checkpoint's config (and generation_config.json) without loading any weights."""
    path = resolve_model_path(model, revision)
    if path is None:
        from kvflow.models.hash_model import DEFAULT_EOS_TOKEN_ID, DEFAULT_VOCAB_SIZE

        assert model is not None
        return ModelInfo(
            model,
            None,
            DEFAULT_VOCAB_SIZE,
            _HASH_MODEL_MAX_MODEL_LEN,
            (DEFAULT_EOS_TOKEN_ID,),
            HASH_ARCHITECTURES[model],
        )
    if path.is_file():  # a GGUF file: the configuration is in its metadata
        from kvflow.models.quantization.gguf_file import GGUFCheckpoint

        config = GGUFCheckpoint(path).hf_config()
        eos_token_ids = _as_id_tuple(config.eos_token_id)
    elif _is_encoder_checkpoint(path):
        return _encoder_model_info(model, path)
    else:
        from kvflow.models.hf_config import load_hf_config

        config = load_hf_config(path)
        eos_token_ids = _generation_eos_token_ids(path) or _as_id_tuple(config.eos_token_id)
    max_model_len = config.max_position_embeddings
    return ModelInfo(
        str(model) if model is not None else "default",
        path,
        config.vocab_size,
        max_model_len,
        eos_token_ids,
        config.architecture,
    )


def _is_encoder_checkpoint(path: Path) -> bool:
    from kvflow.models.encoder_config import ENCODER_ARCHITECTURES

    return _config_architecture(path) in ENCODER_ARCHITECTURES


def _config_architecture(path: Path) -> str | None:
    """The first architecture config.json names (None when it names none or there is no readable file)."""
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    architectures = raw.get("architectures") if isinstance(raw, dict) else None
    if isinstance(architectures, list) and architectures:
        return str(architectures[0])
    return None


def _encoder_model_info(model: str | None, path: Path) -> ModelInfo:
    """A BERT / XLM-RoBERTa checkpoint's info: its longest sequence is its position table less the offset
    XLM-RoBERTa's positions start at; an encoder generates nothing, so it has no EOS."""
    from kvflow.models.encoder_config import load_encoder_config

    config = load_encoder_config(path)
    return ModelInfo(
        str(model) if model is not None else "default",
        path,
        config.vocab_size,
        config.max_seq_len,
        (),
        config.architecture,
    )


def _generation_eos_token_ids(path: Path) -> tuple[int, ...]:
    """EOS ids from generation_config.json (where chat checkpoints list every end-of-turn token), if present."""
    file = path / GENERATION_CONFIG_FILE
    if not file.is_file():
        return ()
    return _as_id_tuple(_read_generation_config(file).get("eos_token_id"))


def load_sampling_defaults(model_path: Path | None, generation_config: str) -> dict[str, Any]:
    """The SamplingParams defaults a model's creator recommends: {field: value} from generation_config.json.

    `generation_config` (the engine option) picks the file: "auto" reads the checkpoint's (none for the hash
    model, `model_path=None`, or a checkpoint without the file), "kvflow" / "vllm" read nothing (kvflow's own
    defaults), a folder path reads that folder's (which must hold the file). Keys in `SAMPLING_DEFAULT_KEYS` with
    a non-null value are taken (`max_new_tokens` becomes `max_tokens`); everything else in the file is ignored. A
    value SamplingParams rejects is a ValueError naming the file and the key.
    """
    from kvflow.sampling_params import SamplingParams

    if generation_config in ("kvflow", "vllm"):
        return {}
    folder = model_path if generation_config == "auto" else Path(generation_config)
    if folder is None:
        return {}
    file = folder / GENERATION_CONFIG_FILE
    if not file.is_file():
        if generation_config == "auto":
            return {}
        raise ValueError(f"generation_config={generation_config!r}: {file} does not exist")
    raw = _read_generation_config(file)
    defaults: dict[str, Any] = {}
    for key, field_name in SAMPLING_DEFAULT_KEYS.items():
        value = raw.get(key)
        if value is None:
            continue
        if field_name in _INT_FIELDS and isinstance(value, float) and value.is_integer():
            value = int(value)  # "top_k": 20.0 means 20
        try:
            SamplingParams(**{field_name: value})
        except ValueError as error:
            raise ValueError(
                f"{file}: {key}={value!r} is not a valid sampling default ({error})"
            ) from None
        defaults[field_name] = value
    return defaults


def _read_generation_config(file: Path) -> dict[str, Any]:
    """generation_config.json as a dict; ValueError naming the file if it is not a JSON object."""
    try:
        data = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{file}: not valid JSON ({error})") from error
    if not isinstance(data, dict):
        raise ValueError(f"{file}: not valid JSON (expected an object, got {type(data).__name__})")
    return data


def _as_id_tuple(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(token_id) for token_id in value)
