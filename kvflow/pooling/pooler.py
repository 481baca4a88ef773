"""The pooler: one finished prompt's last hidden states -> its result (embedding, class probabilities, score or
raw pooled states), as `PoolingParams` and the model's `PoolerConfig` ask.

Invariants: a request's result depends on its own rows only (every reduction here runs per request), so it is the
same alone or in any batch; results are float32 numpy arrays.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from kvflow.pooling.model_spec import PoolingModelSpec
    from kvflow.pooling_params import PoolingParams


class Classifier(Protocol):
    """A model with a classification head: pooled states `[n, hidden]` -> float logits `[n, num_labels]`."""

    def classify(self, pooled_states: torch.Tensor) -> torch.Tensor: ...


def pooled_token_offsets(pooling_type: str, num_tokens: int) -> tuple[int, int]:
    """`(start, end)` of the rows pooling needs among a prompt's `num_tokens` rows computed in its last step:
    LAST the final one, CLS the first, MEAN and ALL every one."""
    if pooling_type == "LAST":
        return num_tokens - 1, num_tokens
    if pooling_type == "CLS":
        return 0, 1
    return 0, num_tokens


def pool(pooling_type: str, rows: torch.Tensor) -> torch.Tensor:
    """A prompt's pooled state from its rows (`pooled_token_offsets`): `[hidden]` (float32), or for ALL
    `[num_tokens, hidden]`."""
    rows = rows.float()
    if pooling_type == "MEAN":
        return rows.mean(dim=0)
    if pooling_type == "ALL":
        return rows
    return rows[0]


def finish_pooled(
    pooled: torch.Tensor,
    params: PoolingParams,
    spec: PoolingModelSpec,
    model: Classifier | None,
) -> np.ndarray:
    """What the request's task returns for its pooled state `pooled`.

    * embed: the first `dimensions` values (the request's, else the pooler config's), then L2-normalized unless
      `normalize` (the request's, else the pooler config's) is False;
    * encode: the pooled state, L2-normalized (each row) only when the request asks `normalize=True`;
    * classify / score: the model's logits, through softmax (sigmoid for one label) unless `use_activation` is
      False.
    """
    config = spec.pooler_config
    task = params.task or ("embed" if spec.kind == "embed" else "classify")
    if task in ("classify", "score"):
        assert model is not None, "a classification task on a model without a classifier"
        logits = model.classify(pooled.unsqueeze(0).to(_dtype_of(model)))[0].float()
        use_activation = (
            params.use_activation if params.use_activation is not None else config.use_activation
        )
        if use_activation:
            logits = torch.sigmoid(logits) if logits.numel() == 1 else torch.softmax(logits, -1)
        return logits.numpy()
    if task == "embed":
        dimensions = params.dimensions if params.dimensions is not None else config.dimensions
        if dimensions is not None:
            pooled = pooled[..., :dimensions]
        normalize = params.normalize if params.normalize is not None else config.normalize
        if normalize:
            pooled = F.normalize(pooled, p=2, dim=-1)
        return pooled.numpy()
    if params.normalize:
        pooled = F.normalize(pooled, p=2, dim=-1)
    return pooled.numpy()


def _dtype_of(model: object) -> torch.dtype:
    dtype = getattr(model, "dtype", None)
    if isinstance(dtype, torch.dtype):
        return dtype
    parameter = next(model.parameters(), None) if hasattr(model, "parameters") else None  # type: ignore[attr-defined]
    return parameter.dtype if parameter is not None else torch.float32
