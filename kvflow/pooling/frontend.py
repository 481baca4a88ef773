"""The front end's side of pooling, shared by `LLM`, `AsyncLLM` and the server: which tasks an engine runs, each
prompt's `PoolingParams`, and the task-shaped outputs (`EmbeddingRequestOutput`, ...) made from a
`PoolingRequestOutput`."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvflow.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from kvflow.pooling.scoring import cosine_similarity
from kvflow.pooling_params import PoolingParams

if TYPE_CHECKING:
    from kvflow.config import EngineConfig
    from kvflow.pooling.model_spec import PoolingModelSpec


class PoolingRequestEndedError(RuntimeError):
    """A pooling request ended without its result (aborted, e.g. by `pause_generation(mode="abort")`, or failed
    in its step); the message says which and why."""


def supported_tasks(engine_config: EngineConfig) -> tuple[str, ...]:
    spec = engine_config.model_config.pooling
    return ("generate",) if spec is None else spec.supported_tasks


def pooling_spec_of(engine_config: EngineConfig, task: str) -> PoolingModelSpec:
    """The engine's pooling spec, when it runs `task`; a ValueError naming the runner or the task otherwise."""
    spec = engine_config.model_config.pooling
    if spec is None:
        raise ValueError(
            f"task {task!r} needs runner='pooling' (--runner pooling); this engine runs the 'generate' runner"
        )
    spec.check_task(task)
    return spec


def expand_pooling_params(
    pooling_params: PoolingParams | Sequence[PoolingParams] | None,
    num_prompts: int,
    task: str,
    truncate_prompt_tokens: int | None = None,
) -> list[PoolingParams]:
    """One `PoolingParams` per prompt (None: defaults; one: for all; a list: one each), each with `task` unless it
    names one, and `truncate_prompt_tokens` unless it has its own. The caller's objects are never changed."""
    if pooling_params is None:
        params_list = [PoolingParams()] * num_prompts
    elif isinstance(pooling_params, PoolingParams):
        params_list = [pooling_params] * num_prompts
    elif isinstance(pooling_params, Sequence) and not isinstance(pooling_params, str):
        params_list = list(pooling_params)
        for index, params in enumerate(params_list):
            if not isinstance(params, PoolingParams):
                raise ValueError(
                    f"pooling_params[{index}] must be PoolingParams, got {type(params).__name__}"
                )
        if len(params_list) != num_prompts:
            raise ValueError(
                f"pooling_params has {len(params_list)} entries for {num_prompts} prompts"
            )
    else:
        raise ValueError(
            "pooling_params must be PoolingParams (or a list of them, one per prompt), got "
            f"{type(pooling_params).__name__}"
        )
    return [with_task(params, task, truncate_prompt_tokens) for params in params_list]


def with_task(
    params: PoolingParams, task: str, truncate_prompt_tokens: int | None = None
) -> PoolingParams:
    if params.task is not None and params.task != task:
        raise ValueError(f"pooling_params task {params.task!r} in a call for task {task!r}")
    truncate = params.truncate_prompt_tokens
    if truncate is None:
        truncate = truncate_prompt_tokens
    return dataclasses.replace(params, task=task, truncate_prompt_tokens=truncate)


def pooled_output(output: RequestOutput | PoolingRequestOutput) -> PoolingRequestOutput:
    """`output` when it has its result; a request that ended without one raises `PoolingRequestEndedError`."""
    if isinstance(output, PoolingRequestOutput):
        return output
    completion = output.outputs[0] if output.outputs else None
    reason = None if completion is None else completion.finish_reason
    detail = (
        ""
        if completion is None or completion.stop_reason is None
        else f": {completion.stop_reason}"
    )
    raise PoolingRequestEndedError(
        f"pooling request {output.request_id!r} ended with finish_reason {reason!r} before its result{detail}"
    )


def as_embedding(output: PoolingRequestOutput) -> EmbeddingRequestOutput:
    return EmbeddingRequestOutput(
        output.request_id,
        EmbeddingOutput(output.outputs.data.tolist()),
        output.prompt_token_ids,
        output.finished,
        output.prompt,
    )


def as_classification(output: PoolingRequestOutput) -> ClassificationRequestOutput:
    return ClassificationRequestOutput(
        output.request_id,
        ClassificationOutput(output.outputs.data.tolist()),
        output.prompt_token_ids,
        output.finished,
        output.prompt,
    )


def as_score(output: PoolingRequestOutput) -> ScoringRequestOutput:
    data = output.outputs.data
    assert data.numel() == 1, "a score is one value"
    return ScoringRequestOutput(
        output.request_id,
        ScoringOutput(float(data.reshape(-1)[0])),
        output.prompt_token_ids,
        output.finished,
        output.prompt,
    )


def cosine_score(
    embedding_1: PoolingRequestOutput, embedding_2: PoolingRequestOutput, index: int
) -> ScoringRequestOutput:
    """The score of a pair an embedding model embedded: the cosine of the two embeddings; its prompt token ids are
    both texts' (as vLLM reports them)."""
    return ScoringRequestOutput(
        f"score-{index}",
        ScoringOutput(cosine_similarity(embedding_1.outputs.data, embedding_2.outputs.data)),
        embedding_1.prompt_token_ids + embedding_2.prompt_token_ids,
    )
