"""The built-in default model: a small Llama that kvflow trained itself, shipped inside the package.

`LLM()`, `kvflow generate`, `kvflow chat` and `kvflow serve` use it when no model is named. The checkpoint lives in
`kvflow/default_model/checkpoint/` (Hugging Face format: `config.json`, bfloat16 `model.safetensors`,
`tokenizer.json`, `tokenizer_config.json` with a ChatML template, `generation_config.json`, and `README.md`, the model
card); `tools/train_default_model.py` produced it. On first use it is copied into kvflow's cache folder
(`$KVFLOW_CACHE_DIR`, else `~/.cache/kvflow`) and loaded from there through the same loader as any checkpoint.
`kvflow.default_model.random_weights` builds the old random-weight model for tests that need a fixed shape.

Beside it ships a draft for speculative decoding (`SHIPPED_DRAFT`, `kvflow/default_model/draft/`: a smaller Llama
with the same tokenizer, trained by `tools/train_default_model.py --draft`), which
`speculative_config={"method": "draft_model", "model": "default-draft", ...}` names (`DEFAULT_DRAFT_NAME`); it is
loaded from the package folder.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
import uuid
from pathlib import Path

from kvflow.default_model.evaluation import (
    EVAL_WINDOW,
    SAMPLE_DOCUMENTS,
    SAMPLE_SEPARATOR,
    heldout_sample,
    perplexity_windows,
)
from kvflow.default_model.tokenizer import (
    BOS_TOKEN,
    CHAT_TEMPLATE,
    END_OF_TEXT_TOKEN,
    EOS_TOKEN,
    IM_END_TOKEN,
    IM_START_TOKEN,
    SPECIAL_TOKENS,
    tokenizer_config,
    train_tokenizer,
)

__all__ = [
    "BOS_TOKEN",
    "CHAT_TEMPLATE",
    "COMPLETE_MARKER",
    "DEFAULT_DRAFT_NAME",
    "DEFAULT_MODEL_NAME",
    "END_OF_TEXT_TOKEN",
    "EOS_TOKEN",
    "EVAL_WINDOW",
    "IM_END_TOKEN",
    "IM_START_TOKEN",
    "SAMPLE_DOCUMENTS",
    "SAMPLE_SEPARATOR",
    "SHIPPED_CHECKPOINT",
    "SHIPPED_DRAFT",
    "SPECIAL_TOKENS",
    "build_default_model",
    "default_model_dir",
    "ensure_default_model",
    "heldout_sample",
    "is_complete",
    "perplexity_windows",
    "tokenizer_config",
    "train_tokenizer",
]

logger = logging.getLogger(__name__)

# The cache folder's name: bump it whenever the shipped checkpoint changes, so caches never serve a stale copy.
DEFAULT_MODEL_NAME = "default-model-v3"
CACHE_DIR_ENV = "KVFLOW_CACHE_DIR"
COMPLETE_MARKER = ".kvflow-complete"
SHIPPED_CHECKPOINT = Path(__file__).resolve().parent / "checkpoint"
# The built-in model's draft for speculative decoding, and the name `speculative_config` knows it by.
SHIPPED_DRAFT = Path(__file__).resolve().parent / "draft"
DEFAULT_DRAFT_NAME = "default-draft"
# Files of the shipped folder that are not the checkpoint: the held-out sample is for kvflow's perplexity test,
# eval.json is the training script's record. The model card (README.md) travels with the model.
_NOT_COPIED = ("heldout_sample.txt", "eval.json")


def default_model_dir() -> Path:
    """Where the default model lives: `$KVFLOW_CACHE_DIR/<DEFAULT_MODEL_NAME>`, else under `~/.cache/kvflow`."""
    root = os.environ.get(CACHE_DIR_ENV)
    cache_root = Path(root).expanduser() if root else Path.home() / ".cache" / "kvflow"
    return cache_root / DEFAULT_MODEL_NAME


def ensure_default_model(cache_dir: Path | None = None) -> Path:
    """Return the default model's folder, building it first if it is missing or incomplete.

    `cache_dir` is the cache root (the folder is `cache_dir / DEFAULT_MODEL_NAME`); None means
    `default_model_dir()`. The model is built into a temporary sibling folder, the completion marker is written
    last, and the folder is renamed into place atomically: a process that loses a race discards its copy.
    """
    target = (
        Path(cache_dir).expanduser() / DEFAULT_MODEL_NAME
        if cache_dir is not None
        else default_model_dir()
    )
    if is_complete(target):
        return target
    _prepare_cache_root(
        target.parent, from_env=cache_dir is None and bool(os.environ.get(CACHE_DIR_ENV))
    )
    staging = target.parent / f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex}"
    try:
        start = time.perf_counter()
        build_default_model(staging)
        logger.info("copied the default model in %.2f s", time.perf_counter() - start)
        _publish(staging, target)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target


def _prepare_cache_root(cache_root: Path, from_env: bool) -> None:
    """Create kvflow's cache folder if needed; a path that cannot be a writable folder is a ValueError naming
    where it came from (KVFLOW_CACHE_DIR, or the default ~/.cache/kvflow), not an OSError from deep inside."""
    source = (
        f"{CACHE_DIR_ENV}={str(cache_root)!r} (kvflow's cache folder)"
        if from_env
        else f"kvflow's cache folder {str(cache_root)!r} (set {CACHE_DIR_ENV} to use another)"
    )
    try:
        cache_root.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise ValueError(f"{source} is a file, not a folder") from None
    except NotADirectoryError:
        raise ValueError(f"{source} lies under a file, so it cannot be a folder") from None
    except OSError as error:
        raise ValueError(f"{source} cannot be created: {error.strerror or error}") from None
    if not cache_root.is_dir():
        raise ValueError(f"{source} is not a folder")
    if not os.access(cache_root, os.W_OK | os.X_OK):
        raise ValueError(f"{source} is not writable, so the default model cannot be built there")


def is_complete(model_dir: Path) -> bool:
    """Whether `model_dir` holds a finished build (its completion marker is written last)."""
    return (model_dir / COMPLETE_MARKER).is_file()


def _publish(staging: Path, target: Path) -> None:
    """Atomically move a finished build into place; if another process got there first, keep theirs."""
    for _ in range(3):
        try:
            os.rename(staging, target)
            logger.info("default model saved to %s", target)
            return
        except OSError:
            if is_complete(target):
                logger.info("another process built %s first; discarding this copy", target)
                return
            _discard_incomplete(target)
    raise RuntimeError(f"could not move the default model into {target}")


def _discard_incomplete(target: Path) -> None:
    """Move an incomplete folder out of the way (renaming is atomic, so racing processes cannot both take it)."""
    trash = target.parent / f".{target.name}.stale-{uuid.uuid4().hex}"
    try:
        os.rename(target, trash)
    except OSError:
        return  # gone already, or someone else moved it
    logger.warning("removed an incomplete default model folder at %s", target)
    shutil.rmtree(trash, ignore_errors=True)


# ---------------------------------------------------------------------------------------------------- build
def build_default_model(out_dir: Path) -> None:
    """Copy the shipped checkpoint into `out_dir` (created; must not exist), completion marker last."""
    out_dir.mkdir(parents=True)
    for source in sorted(SHIPPED_CHECKPOINT.iterdir()):
        if source.is_file() and source.name not in _NOT_COPIED:
            shutil.copyfile(source, out_dir / source.name)
            (out_dir / source.name).chmod(0o644)  # the cache may be shared
    (out_dir / COMPLETE_MARKER).write_text(DEFAULT_MODEL_NAME + "\n", encoding="utf-8")
