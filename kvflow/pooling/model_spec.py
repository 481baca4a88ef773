"""What the engine must know about a pooling model before it starts: its kind (embedding model or classifier),
the runner an `auto` choice gives it, the pooling its checkpoint asks for (sentence-transformers' files), and the
embedding sizes it was trained for.

Reads JSON files only (no torch): the front end, the server and the engine core all call it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvflow.pooling_params import PoolerConfig, PoolingParams

# Architectures that only pool: encoders, base decoders without an LM head, classifiers.
_CLASSIFIER_SUFFIX = "ForSequenceClassification"
_BASE_MODEL_SUFFIXES = ("Model", "EmbeddingModel")
_ST_MODULES_FILE = "modules.json"
# sentence-transformers' module classes by name: `sentence_transformers.models.Pooling` in the files the Hub's
# models carry, `sentence_transformers.sentence_transformer.modules.pooling.Pooling` in what version 6 writes.
_ST_POOLING = "Pooling"
_ST_NORMALIZE = "Normalize"
_ST_TRANSFORMER = "Transformer"
# sentence-transformers' pooling modes and the pooling type each is: the older boolean keys of
# 1_Pooling/config.json, and the names of the newer `pooling_mode` key.
_ST_POOLING_FLAGS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_lasttoken": "lasttoken",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
}
_ST_POOLING_TYPES = {"cls": "CLS", "mean": "MEAN", "lasttoken": "LAST"}


@dataclass(frozen=True)
class PoolingModelSpec:
    """A checkpoint as a pooling model.

    Invariants: `kind` is "embed" (an embedding model: tasks embed, encode, score by cosine) or "classify" (a
    classifier: tasks classify, score on a text pair when it has one label, encode); `is_causal` says whether its
    attention is causal (a decoder: chunked prefill and the prefix cache work for LAST pooling) or bidirectional
    (an encoder: whole prompts only); `pooler_config` has every field set. `matryoshka_dimensions` lists the
    embedding sizes `dimensions` may take (None: any size up to `hidden_size`, for a model that declares
    `is_matryoshka` without sizes), and `supports_dimensions` is False for a model that declares neither.
    """

    kind: str
    is_causal: bool
    hidden_size: int
    num_labels: int
    id2label: dict[int, str]
    pooler_config: PoolerConfig
    supports_dimensions: bool
    matryoshka_dimensions: tuple[int, ...] | None

    @property
    def supported_tasks(self) -> tuple[str, ...]:
        if self.kind == "embed":
            return ("embed", "encode", "score")
        if self.num_labels == 1:
            return ("classify", "score", "encode")
        return ("classify", "encode")

    def check_task(self, task: str) -> None:
        """ValueError naming `task` when this model does not run it."""
        if task not in self.supported_tasks:
            raise ValueError(
                f"task {task!r} is not supported by this {_kind_name(self)}; its tasks: "
                f"{', '.join(self.supported_tasks)}"
            )

    def check_params(self, params: PoolingParams) -> None:
        """ValueError naming the field when `params` asks this model for what it cannot do."""
        if params.task is not None:
            self.check_task(params.task)
        if params.dimensions is not None:
            self.check_dimensions(params.dimensions, "dimensions")

    def check_dimensions(self, dimensions: int, field_name: str) -> None:
        if not self.supports_dimensions:
            raise ValueError(
                f"{field_name}: this model does not declare Matryoshka embeddings (config.json "
                "`is_matryoshka` / `matryoshka_dimensions`), so its embeddings cannot be shortened"
            )
        if dimensions > self.hidden_size:
            raise ValueError(
                f"{field_name}={dimensions} is larger than the model's embedding size {self.hidden_size}"
            )
        allowed = self.matryoshka_dimensions
        if allowed is not None and dimensions not in allowed:
            raise ValueError(
                f"{field_name}={dimensions} is not one of the model's Matryoshka sizes {list(allowed)}"
            )


def _kind_name(spec: PoolingModelSpec) -> str:
    return "embedding model" if spec.kind == "embed" else "classification model"


def is_pooling_only_architecture(architecture: str) -> bool:
    """An architecture that cannot generate: an encoder, a base model without an LM head, a classifier."""
    return architecture.endswith(_CLASSIFIER_SUFFIX) or architecture.endswith(_BASE_MODEL_SUFFIXES)


def has_sentence_transformers_files(path: Path | None) -> bool:
    return path is not None and path.is_dir() and (path / _ST_MODULES_FILE).is_file()


def resolve_runner(runner: str, architecture: str, path: Path | None) -> str:
    """The runner, "generate" or "pooling", for the engine option `runner` ("auto": pooling for a pooling-only
    architecture or a folder with sentence-transformers' modules.json). ValueError when the model cannot run as
    asked."""
    if path is None:  # the hash models: test stand-ins that generate
        if runner == "pooling":
            raise ValueError("runner='pooling' needs a checkpoint (the hash model only generates)")
        return "generate"
    pooling_only = is_pooling_only_architecture(architecture)
    if runner == "auto":
        return "pooling" if pooling_only or has_sentence_transformers_files(path) else "generate"
    if runner == "generate" and pooling_only:
        raise ValueError(
            f"runner='generate': {architecture} has no language-model head; run it with runner='pooling'"
        )
    return runner


def load_pooling_model_spec(
    path: Path, architecture: str, option: PoolerConfig | dict[str, Any] | None
) -> PoolingModelSpec:
    """The spec of checkpoint folder `path` (architecture `architecture`), with the engine's `pooler_config`
    option over the checkpoint's sentence-transformers settings over the architecture's defaults."""
    raw = _read_json(path / "config.json")
    is_classifier = architecture.endswith(_CLASSIFIER_SUFFIX)
    is_encoder = architecture.startswith(("Bert", "XLMRoberta"))
    given = PoolerConfig.from_option(option)
    from_files = _sentence_transformers_pooler(path)
    default_type = "CLS" if is_encoder else "LAST"
    pooling_type = given.pooling_type or from_files.pooling_type or default_type
    normalize = given.normalize
    if normalize is None:
        normalize = from_files.normalize if from_files.normalize is not None else True
    pooler_config = PoolerConfig(
        pooling_type=pooling_type,
        normalize=normalize,
        dimensions=given.dimensions,
        use_activation=True if given.use_activation is None else given.use_activation,
    )
    id2label_raw = raw.get("id2label") or {}
    id2label = {int(k): str(v) for k, v in id2label_raw.items()}
    num_labels = len(id2label) if id2label else int(raw.get("num_labels", 2))
    if is_classifier and not id2label:
        id2label = {i: f"LABEL_{i}" for i in range(num_labels)}
    matryoshka = raw.get("matryoshka_dimensions")
    spec = PoolingModelSpec(
        kind="classify" if is_classifier else "embed",
        is_causal=not is_encoder,
        hidden_size=int(raw["hidden_size"]),
        num_labels=num_labels if is_classifier else 0,
        id2label=id2label if is_classifier else {},
        pooler_config=pooler_config,
        supports_dimensions=bool(raw.get("is_matryoshka")) or bool(matryoshka),
        matryoshka_dimensions=tuple(int(d) for d in matryoshka) if matryoshka else None,
    )
    if pooler_config.dimensions is not None:
        spec.check_dimensions(pooler_config.dimensions, "pooler_config dimensions")
    return spec


def _sentence_transformers_pooler(path: Path) -> PoolerConfig:
    """The pooling type and normalization sentence-transformers' files ask for (fields None where they say
    nothing, or there are no files). A module kvflow does not run (Dense, ...) or a pooling mode it does not
    compute is a ValueError naming it: ignoring it would give other embeddings than the model's."""
    modules_file = path / _ST_MODULES_FILE
    if not modules_file.is_file():
        return PoolerConfig()
    modules = _read_json(modules_file)
    if not isinstance(modules, list):
        raise ValueError(f"{modules_file}: expected a list of modules")
    pooling_type: str | None = None
    normalize = False
    for module in modules:
        module_type = str(module.get("type", ""))
        class_name = module_type.rsplit(".", 1)[-1]
        if class_name == _ST_POOLING:
            pooling_type = _pooling_mode(path / str(module.get("path", "")) / "config.json")
        elif class_name == _ST_NORMALIZE:
            normalize = True
        elif class_name != _ST_TRANSFORMER:
            raise ValueError(
                f"{modules_file}: module {module_type!r} is not supported (kvflow runs Transformer, "
                "Pooling and Normalize)"
            )
    return PoolerConfig(pooling_type=pooling_type, normalize=normalize)


def _pooling_mode(config_file: Path) -> str | None:
    """The pooling type of sentence-transformers' pooling config (its `pooling_mode_*` flags, or the newer
    `pooling_mode` name); a mode kvflow does not compute, several at once, or a pooling that leaves the prompt out
    (`include_prompt: false`) is a ValueError naming it."""
    if not config_file.is_file():
        return None
    config = _read_json(config_file)
    mode = config.get("pooling_mode")
    if mode is None:
        modes = [name for key, name in _ST_POOLING_FLAGS.items() if config.get(key)]
    else:
        modes = [mode] if isinstance(mode, str) else list(mode)
    if config.get("include_prompt") is False:
        raise ValueError(
            f"{config_file}: include_prompt false is not supported (the whole prompt is pooled)"
        )
    if len(modes) > 1:
        raise ValueError(
            f"{config_file}: several pooling modes at once ({modes}) are not supported"
        )
    if not modes:
        return None
    pooling_type = _ST_POOLING_TYPES.get(str(modes[0]))
    if pooling_type is None:
        raise ValueError(
            f"{config_file}: pooling mode {modes[0]!r} is not supported (cls, mean and lasttoken are)"
        )
    return pooling_type


def _read_json(file: Path) -> Any:
    try:
        return json.loads(file.read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"cannot read {file}: {error}") from None
