"""kvflow: an LLM inference and serving engine (vLLM-V1-style core: paged KV cache, continuous batching)."""

import os as _os

# Intel MKL (torch's CPU BLAS on x86) picks its code paths by data alignment unless told otherwise, so one product
# of the same rows could differ in the last bits between calls: on an Intel Xeon the same request's logprobs in two
# batches of the same shape differed at 1e-7 (tests/structured_output/test_llm_structured.py). STRICT mode makes
# MKL bitwise reproducible; MKL reads it at its first call, and engine processes inherit it. A user's own
# MKL_CBWR wins.
_os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

from kvflow.logger import configure_logging as _configure_logging
from kvflow.lora.request import LoRARequest
from kvflow.outputs import (
    ClassificationRequestOutput,
    CompletionOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringRequestOutput,
)
from kvflow.pooling_params import PoolerConfig, PoolingParams
from kvflow.sampling_params import BeamSearchParams, SamplingParams, StructuredOutputsParams
from kvflow.version import __version__

_configure_logging()  # the `kvflow` logger prints INFO to stderr (kvflow/logger.py; KVFLOW_LOGGING_LEVEL)

__all__ = [
    "LLM",
    "AsyncLLM",
    "BeamSearchParams",
    "ClassificationRequestOutput",
    "CompletionOutput",
    "EmbeddingRequestOutput",
    "LoRARequest",
    "PoolerConfig",
    "PoolingParams",
    "PoolingRequestOutput",
    "RequestOutput",
    "SamplingParams",
    "ScoringRequestOutput",
    "StreamingInput",
    "StructuredOutputsParams",
    "__version__",
]


def __getattr__(name: str):  # lazy: importing the engine pulls in torch
    if name == "LLM":
        from kvflow.entrypoints.llm import LLM

        return LLM
    if name == "AsyncLLM":
        from kvflow.engine.async_llm import AsyncLLM

        return AsyncLLM
    if name == "StreamingInput":
        from kvflow.engine.sessions import StreamingInput

        return StreamingInput
    raise AttributeError(f"module 'kvflow' has no attribute {name!r}")
