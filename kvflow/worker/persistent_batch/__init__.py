"""The persistent-batch runner protocol (`use_v2_model_runner=False`), kept apart from the default slot runner."""

from __future__ import annotations

from kvflow.worker.persistent_batch.model_runner import ParkedRequest, PersistentBatchModelRunner

__all__ = ["ParkedRequest", "PersistentBatchModelRunner"]
