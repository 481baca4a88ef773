"""The served model: the name clients ask for, and its card in GET /v1/models."""

from __future__ import annotations

from http import HTTPStatus
from typing import TYPE_CHECKING

from kvflow.entrypoints.openai.errors import OpenAIServingError
from kvflow.entrypoints.openai.protocol import ModelCard, ModelList

if TYPE_CHECKING:
    from kvflow.engine.async_llm import AsyncLLM

# The served name of the built-in default model (`kvflow serve` without MODEL).
DEFAULT_MODEL_NAME = "default"


class OpenAIServingModels:
    """One engine serves one model under one name.

    Invariants: `served_model_name` is what requests' `model` must be (or omit); `root` is the checkpoint folder
    (or the model's own name for the built-in and hash models); `max_model_len` is the engine's.
    """

    def __init__(self, engine: AsyncLLM, served_model_name: str) -> None:
        self.served_model_name = served_model_name
        model_info = engine.model_info
        self.root = str(model_info.path) if model_info.path is not None else model_info.name
        self.max_model_len = engine.engine_config.scheduler_config.max_model_len

    def check_model(self, model: str | None) -> None:
        """404 (param "model") unless `model` is the served name; a missing `model` means the served one."""
        if model is not None and model != self.served_model_name:
            raise OpenAIServingError(
                f"The model `{model}` does not exist (this server serves "
                f"`{self.served_model_name}`).",
                status_code=HTTPStatus.NOT_FOUND,
                param="model",
            )

    def model_list(self) -> ModelList:
        return ModelList(
            data=[
                ModelCard(
                    id=self.served_model_name, root=self.root, max_model_len=self.max_model_len
                )
            ]
        )
