"""The pooling runner: the slot runner's request bookkeeping and batch building, with a pooler in place of the
sampler (runner "pooling": embeddings, classification, scores)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvflow.core.sched.output import ModelRunnerOutput
from kvflow.models.layers.linear import Linear
from kvflow.pooling.pooler import finish_pooled, pool, pooled_token_offsets
from kvflow.utils import to_device
from kvflow.worker.model_runner import ModelRunner

if TYPE_CHECKING:
    from kvflow.batch import BatchInputs
    from kvflow.core.sched.output import NewRequestData, SchedulerOutput
    from kvflow.models.interface import RunnerModel
    from kvflow.pooling.model_spec import PoolingModelSpec
    from kvflow.pooling_params import PoolingParams


class PoolingModelRunner(ModelRunner):
    """Runs pooling requests: each holds a slot while its prompt is computed (in chunks for a causal model that
    pools its last token, else whole in one step) and, in the step that computes the last of its prompt, gets its
    pooled result (`ModelRunnerOutput.pooler_output`); it never samples.

    Invariants: every held request has its `PoolingParams` in `pooling_params` (they arrive once, with the request
    in `scheduled_new_reqs`); the model returns last hidden states only for the rows pooling needs (the step's
    `logits_indices`: the final token for LAST, the first for CLS, every token for MEAN / ALL), so a step costs the
    forward pass plus O(pooled rows); every linear layer runs batch-invariant products (`row_invariant_linear`)
    and results are computed per request, so a request's result does not depend on what shares its steps (a
    decoder's may on how its prompt was split: prefix-cache hits, chunks).
    """

    def __init__(self, model: RunnerModel, *, pooling: PoolingModelSpec, **kwargs: Any) -> None:
        super().__init__(model, **kwargs)
        self.pooling = pooling
        self.pooling_params: dict[str, PoolingParams] = {}
        # Every product batch-invariant: a request's result must not depend on what shares its step.
        for module in model.modules():  # type: ignore[attr-defined]
            if isinstance(module, Linear):
                module.row_invariant = True
        has_classifier = callable(getattr(model, "classify", None))
        assert has_classifier == (pooling.kind == "classify"), (
            f"a {pooling.kind} spec for a model {'with' if has_classifier else 'without'} a classifier"
        )

    # ------------------------------------------------------------------------------------------ requests
    def _add_new_requests(self, new_reqs: Iterable[NewRequestData]) -> None:
        new_reqs = list(new_reqs)
        super()._add_new_requests(new_reqs)
        for new_req in new_reqs:
            if new_req.pooling_params is None:
                raise ValueError(
                    f"request {new_req.req_id!r} has no pooling_params: a pooling engine does not generate"
                )
            self.pooling_params[new_req.req_id] = new_req.pooling_params

    def _forget(self, req_id: str) -> None:
        super()._forget(req_id)
        self.pooling_params.pop(req_id, None)

    def _preempt(self, req_id: str) -> None:
        super()._preempt(req_id)
        self.pooling_params.pop(req_id, None)

    # ------------------------------------------------------------------------------------------ step
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Apply the step's plan, run its tokens, and pool the requests whose prompt it completes."""
        self._apply_plan(scheduler_output)
        if not scheduler_output.num_scheduled_tokens:
            return ModelRunnerOutput.make_empty()
        batch, arrays, _ = self._prepare_inputs(scheduler_output.num_scheduled_tokens)
        pooled_rows = arrays.sampled_rows.tolist()  # rows whose prompt completes this step
        query_start_loc = batch.query_start_loc.cpu().numpy()
        pooling_type = self.pooling.pooler_config.pooling_type
        assert pooling_type is not None
        row_ranges: list[tuple[int, int]] = []  # per pooled row: its rows in the model's output
        flat_indices: list[np.ndarray] = []
        num_rows = 0
        for row in pooled_rows:
            start, end = pooled_token_offsets(
                pooling_type, int(query_start_loc[row + 1] - query_start_loc[row])
            )
            flat_indices.append(np.arange(start, end) + query_start_loc[row])
            row_ranges.append((num_rows, num_rows + end - start))
            num_rows += end - start
        logits_indices = np.concatenate(flat_indices) if flat_indices else np.zeros(0, np.int64)
        batch = dataclasses.replace(
            batch,
            logits_indices=to_device(logits_indices.astype(np.int64), self.device),
            token_type_ids=self._token_type_ids(batch, arrays.slot_indices),
        )
        with torch.inference_mode():
            hidden = self.model.hidden_states(batch, self.kv_cache)  # type: ignore[attr-defined]
            pooler_output: list[np.ndarray | None] = [None] * batch.num_reqs
            classifier = self.model if self.pooling.kind == "classify" else None
            for row, (first, last) in zip(pooled_rows, row_ranges, strict=True):
                pooled = pool(pooling_type, hidden[first:last].cpu())
                params = self.pooling_params[batch.req_ids[row]]
                pooler_output[row] = finish_pooled(pooled, params, self.pooling, classifier)  # type: ignore[arg-type]
        self.slots.num_computed_tokens[arrays.slot_indices] += arrays.num_scheduled
        return ModelRunnerOutput(
            req_ids=batch.req_ids,
            req_id_to_index=arrays.req_id_to_index,
            sampled_token_ids=[[] for _ in batch.req_ids],
            pooler_output=pooler_output,
        )

    def _token_type_ids(self, batch: BatchInputs, slot_indices: np.ndarray) -> torch.Tensor | None:
        """Each flat token's type (1 from its request's `token_type_start` on, else 0), or None when no scheduled
        request is a text pair."""
        starts = [self.pooling_params[req_id].token_type_start for req_id in batch.req_ids]
        if all(start is None for start in starts):
            return None
        positions = batch.positions.cpu().numpy()
        query_start_loc = batch.query_start_loc.cpu().numpy()
        types = np.zeros(len(positions), dtype=np.int64)
        for row, start in enumerate(starts):
            if start is not None:
                begin, end = query_start_loc[row], query_start_loc[row + 1]
                types[begin:end] = positions[begin:end] >= start
        return to_device(types, self.device)
