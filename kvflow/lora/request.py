"""`LoRARequest`: which adapter a request runs with (vLLM's `vllm.lora.request.LoRARequest`, same fields)."""

from __future__ import annotations

import msgspec


class LoRARequest(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True, gc=False):
    """One LoRA adapter a request runs with: `lora_name` (what the server lists and `model:` selects),
    `lora_int_id` (a positive integer naming the adapter inside the engine: two requests with the same id run the
    same adapter weights, and prefix-cache entries are keyed by it), `lora_path` (a PEFT adapter folder:
    `adapter_config.json` + `adapter_model.safetensors`), and optionally `base_model_name` (the model it was
    trained on; informational, listed as the adapter's `parent`).

    Invariants: `lora_int_id >= 1` (0 means "no adapter" inside the engine) and `lora_name` is not empty; the
    struct is immutable and crosses process boundaries as it is (msgspec-encoded by type).
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int):
            raise ValueError(f"lora_int_id must be an int, got {self.lora_int_id!r}")
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be >= 1, got {self.lora_int_id}")
        if not isinstance(self.lora_path, str):
            raise ValueError(f"lora_path must be a string, got {self.lora_path!r}")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    @property
    def cache_key(self) -> tuple[object, ...]:
        """What prefix-cache hashes of this adapter's requests carry (`RequestBlockHasher`): the id and the path,
        so two adapters never share KV blocks, and an id re-registered for another folder does not reuse the
        first folder's blocks."""
        return ("lora", self.lora_int_id, self.lora_path)
