"""POST /classify (vLLM's): class probabilities for each input of a classifier model.

Each input is one engine request with task "classify"; `data[i]` holds input i's probabilities (softmax over the
labels, sigmoid for a one-label model; the raw logits with `use_activation: false`), their count, and the name of
the most probable class from the checkpoint's config.json `id2label` (transformers' `LABEL_<i>` where it names
none).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi.responses import JSONResponse, Response

from kvflow.entrypoints.openai.protocol_pooling import ClassificationRequest
from kvflow.entrypoints.openai.serving_engine import CLIENT_CLOSED_REQUEST
from kvflow.entrypoints.openai.serving_pooling import (
    OpenAIServingPooling,
    input_items,
    list_body,
)

if TYPE_CHECKING:
    from fastapi import Request

logger = logging.getLogger(__name__)

_FIELDS = frozenset(ClassificationRequest.model_fields)


def load_id2label(model_path: str | Path | None) -> dict[int, str]:
    """config.json's `id2label` as {class index: name} ({} when the checkpoint has none, or no config.json)."""
    if model_path is None:
        return {}
    config_path = Path(model_path) / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError):
        return {}
    id2label = config.get("id2label") if isinstance(config, dict) else None
    if not isinstance(id2label, dict):
        return {}
    labels: dict[int, str] = {}
    for key, name in id2label.items():
        try:
            labels[int(key)] = str(name)
        except ValueError:
            logger.warning("config.json's id2label has a key that is not a class index: %r", key)
    return labels


def label_of(probs: list[float], id2label: dict[int, str]) -> str | None:
    """The name of the most probable class (the first of equals); None for no classes."""
    if not probs:
        return None
    best = max(range(len(probs)), key=probs.__getitem__)
    return id2label.get(best, f"LABEL_{best}")


class OpenAIServingClassification(OpenAIServingPooling):
    """Serves /classify. Invariant: `id2label` is the checkpoint's, read once."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.id2label = load_id2label(self.engine.model_info.path)

    async def create_classify(
        self, request: ClassificationRequest, raw_request: Request
    ) -> Response:
        self.check_request(request, "classify", raw_request.url.path)
        request_id = self.request_id(raw_request, request.request_id)
        items = input_items(request.input)
        self.check_num_inputs(len(items), "input")
        truncate = request.truncate_prompt_tokens
        prompts = await self.prompts_of(items, request.add_special_tokens, truncate, "input")
        params = [
            self.pooling_params(
                _FIELDS,
                task="classify",
                use_activation=request.use_activation,
                truncate_prompt_tokens=truncate,
            )
            for _ in prompts
        ]
        outputs = await self.run(
            raw_request, request_id, prompts, params, request.priority, _FIELDS
        )
        if outputs is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        data = []
        for index, output in enumerate(outputs):
            probs = output.outputs.data.tolist()
            data.append(
                {
                    "index": index,
                    "object": "classification",
                    "label": label_of(probs, self.id2label),
                    "probs": probs,
                    "num_classes": len(probs),
                }
            )
        return JSONResponse(
            list_body(f"classify-{request_id}", self.models.served_model_name, data, outputs)
        )
