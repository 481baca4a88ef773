"""The causal-LM shell every decoder family shares: the KV cache, the per-forward attention metadata and RoPE, the
layer loop, the final norm and the LM head, around a family's decoder layers.

A family's module subclasses `DecoderForCausalLM`, names its layer class in `decoder_layer` (or, when its layers
differ, returns one per layer from `layer_factories`; and, when its fused modules differ, its
`packed_modules_mapping`), and is registered in `kvflow.models.registry` under its Hugging Face
architecture names; the checkpoint loading is `CheckpointModel`'s.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from kvflow import kernels
from kvflow.core.kv_cache_utils import KVCacheLayout
from kvflow.distributed.parallel_state import TensorParallelGroup
from kvflow.models.attention import AttentionBackend, get_attention_backend
from kvflow.models.layers import LMHead, RotaryEmbedding
from kvflow.models.layers.decoder import DecoderLayerFactory, DecoderModel
from kvflow.models.layers.linear import Linear
from kvflow.models.layers.self_attention import tp_head_ranges
from kvflow.models.loader import CheckpointModel

if TYPE_CHECKING:
    from kvflow.batch import BatchInputs
    from kvflow.lora.layers import LoRAStepState
    from kvflow.models.hf_config import TransformerConfig
    from kvflow.models.quantization import QuantizationPlan


class DecoderForCausalLM(CheckpointModel):
    """A decoder-only causal LM run by the model runner over a paged KV cache.

    Invariants: every parameter is in `dtype` on `device`; with tied embeddings `lm_head.weight` IS
    `model.embed_tokens.weight`. The KV cache is `[kv_cache_layout.num_pages, *backend.kv_cache_shape(...)]`
    (K then V) in `dtype`: one tensor per layer, unless the layers mix attention kinds, in which case they form KV
    cache groups (`KVCacheLayout`) and layer i reads and writes tensor `layer_pages[i]` through its group's block
    tables (`batch.for_group`). `forward` writes each scheduled token's K/V at its group's slot mapping before any
    layer reads it, and returns float32 logits for `batch.logits_indices` only. Attention metadata and RoPE cos/sin
    are built once per forward (one metadata per distinct sliding window in `layer_windows`, or per KV cache group
    when there are several) and shared by the layers; in the last
    layer only the rows at `logits_indices` go past attention. It does not sample: the runner's `Sampler` turns its
    logits into tokens (`samples_own_tokens` is False).

    Tensor parallelism (`tp` of N ranks): each rank holds its query heads and KV heads (`tp_head_ranges`), its
    slice of the feed-forward blocks and of the vocabulary; `num_kv_heads` and the KV cache are this rank's, and the
    logits are gathered, so every rank returns the whole vocabulary's logits. With `tp=None` (one rank) nothing is
    split and no collective runs. A `quantization` plan is applied to the layers before any weight loads.
    """

    samples_own_tokens = False
    # The fused modules of the shared layers (`SelfAttention`, `GatedMLP`), each with its checkpoint parts in order.
    packed_modules_mapping: ClassVar[dict[str, list[str]]] = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }
    decoder_layer: ClassVar[DecoderLayerFactory]

    def __init__(
        self,
        config: TransformerConfig,
        *,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        attention_backend: str = "torch",
        tp: TensorParallelGroup | None = None,
        quantization: QuantizationPlan | None = None,
    ) -> None:
        super().__init__()
        self.tp = tp if tp is not None else TensorParallelGroup.single()
        (_, num_heads), (_, num_kv_heads) = tp_head_ranges(config, self.tp)
        self.config = config
        self.vocab_size = config.vocab_size
        self.dtype = dtype
        self.device = torch.device(device)
        self.num_layers = config.num_hidden_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = config.head_dim
        self.attention_backend: AttentionBackend = get_attention_backend(attention_backend)(
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=config.head_dim,
            scale=(config.query_pre_attn_scalar or config.head_dim) ** -0.5,
            softcap=config.attn_logit_softcapping,
            dtype=dtype,
        )
        self.model = DecoderModel(
            config,
            self.attention_backend,
            self.layer_factories(config),
            dtype=dtype,
            device=self.device,
            tp=self.tp,
        )
        self.lm_head = LMHead(
            config.vocab_size,
            config.hidden_size,
            dtype=dtype,
            device=self.device,
            tied_to=self.model.embed_tokens if config.tie_word_embeddings else None,
            tp=self.tp,
        )
        self.rotary_emb = RotaryEmbedding(
            config.head_dim,
            config.max_position_embeddings,
            config.rope_theta,
            config.rope_scaling,
            device=self.device,
        )
        # The sliding window of each layer (None: it attends to the whole sequence).
        self.layer_windows = [
            config.layer_sliding_window(i) for i in range(config.num_hidden_layers)
        ]
        # The distinct windows, in a fixed order: the keys of the metadata `hidden_states` builds per step.
        self._distinct_windows = tuple(dict.fromkeys(self.layer_windows))
        self.kv_cache_layout = KVCacheLayout(self.layer_windows)
        layout = self.kv_cache_layout
        # Per layer: its KV tensor, and the key of its metadata in the dict `forward` builds (its window, or with
        # several KV cache groups its group).
        self.layer_pages = layout.layer_pages
        self.layer_metadata_keys: tuple[int | None, ...] = (
            layout.layer_groups if layout.is_hybrid else tuple(self.layer_windows)
        )
        self.quantization = quantization
        # LoRA: the step's token -> adapter slot map the LoRA layers read, set by `kvflow.lora.model_manager`
        # (None: no adapters on this model).
        self.lora_state: LoRAStepState | None = None
        # Before any weight loads: the layers take the plan's storage and kernels.
        if quantization is not None:
            quantization.apply(self)
        if dtype is torch.bfloat16 and self.device.type == "cpu":
            # Before the fast paths are chosen (the fused decode layer reads the plan's row limit); a bad
            # KVFLOW_BF16_GEMM fails here, at load, not in a forward pass.
            kernels.choose_bf16_gemm_plan(self.dense_product_shapes())
        self.add_family_parts(config)
        if layout.is_hybrid and getattr(self, "fused_decode", None) is not None:
            # The fused decode path reads one slot mapping and a tensor per layer: not this layout.
            self.fused_decode = None

    def dense_product_shapes(self) -> set[tuple[int, int]]:
        """The distinct [out, in] weight shapes of the decoder layers' unquantized linear layers (what the bfloat16
        GEMM plan is measured on)."""
        return {
            (module.weight.shape[0], module.weight.shape[1])
            for module in self.model.modules()
            if isinstance(module, Linear) and module.quant_method is None
        }

    def layer_factories(self, config: TransformerConfig) -> list[DecoderLayerFactory]:
        """What builds each decoder layer: the family's `decoder_layer` for every layer (a family whose layers differ,
        such as dense layers between mixture-of-experts ones, overrides this)."""
        return [type(self).decoder_layer] * config.num_hidden_layers

    def add_family_parts(self, config: TransformerConfig) -> None:
        """What a family adds once the shared parts are built (and a quantization plan applied), before any weight
        loads: a family-specific norm, an extra rotary table, a fast path. The shared model adds nothing."""

    # ------------------------------------------------------------------------------------------ KV cache
    def use_one_kv_group(self) -> None:
        """Give every layer a KV tensor of its own, all read through one block table (a sliding layer masks what is
        outside its window): for a model run on another model's block ids, such as a draft model on its target's
        first (full-attention) group. Call before `make_kv_cache`."""
        self.kv_cache_layout = KVCacheLayout([None] * self.num_layers)
        self.layer_pages = self.kv_cache_layout.layer_pages
        self.layer_metadata_keys = tuple(self.layer_windows)

    def make_kv_cache(self, num_blocks: int, block_size: int) -> torch.Tensor:
        """A zeroed cache `[num_pages, *backend.kv_cache_shape(...)]` (torch backend: `[pages, 2, kv_heads, blocks,
        block_size, head_dim]`; a page per layer unless the layers form KV cache groups); zeros because padding that
        attention masks out must still be finite."""
        layer_shape = self.attention_backend.kv_cache_shape(
            num_blocks, block_size, self.num_kv_heads, self.head_dim
        )
        return torch.zeros(
            (self.kv_cache_layout.num_pages, *layer_shape), dtype=self.dtype, device=self.device
        )

    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        """Bytes one block takes, K and V: across all layers, or with KV cache groups across one group's layers (a
        block belongs to one group at a time)."""
        element_size = torch.empty((), dtype=self.dtype).element_size()
        num_pages = self.kv_cache_layout.num_pages
        return num_pages * 2 * block_size * self.num_kv_heads * self.head_dim * element_size

    # ------------------------------------------------------------------------------------------ forward
    def forward(self, batch: BatchInputs, kv_cache: torch.Tensor) -> torch.Tensor:
        """Run the batch's tokens, fill their KV slots, and return float32 logits `[num_sampled, vocab_size]`."""
        return self.lm_head(self.hidden_states(batch, kv_cache))

    def hidden_states(self, batch: BatchInputs, kv_cache: torch.Tensor) -> torch.Tensor:
        """Run the batch's tokens, fill their KV slots, and return the last hidden states (after the final norm)
        of the flat tokens at `batch.logits_indices`, `[len(logits_indices), hidden_size]` in the model dtype: what
        `forward` feeds the LM head, and what a pooling runner pools."""
        layout = self.kv_cache_layout
        if layout.is_hybrid:
            # Keyed by KV cache group: each group reads its own block tables.
            metadata_by_window = {
                group_id: self.attention_backend.build_metadata(batch.for_group(group_id), window)
                for group_id, window in enumerate(layout.group_windows)
            }
        else:
            build_metadata = self.attention_backend.build_metadata
            metadata_by_window = {
                window: build_metadata(batch, window) for window in self._distinct_windows
            }
        cos, sin = self.rotary_emb.cos_sin(batch.positions, self.dtype, _max_position(batch))
        logits_indices = batch.logits_indices
        if logits_indices.dtype is not torch.int64:
            logits_indices = logits_indices.to(torch.int64)
        if self.lora_state is not None:
            self.lora_state.set_step(batch.lora_token_slots, logits_indices)
        hidden_states = self.embed(batch.input_ids)
        hidden_states, residual = self.run_layers(
            batch, hidden_states, cos, sin, kv_cache, metadata_by_window, logits_indices
        )
        if residual is None:  # no layers
            hidden_states = hidden_states.index_select(0, logits_indices)
        hidden_states, _ = self.model.norm.forward_with_residual(hidden_states, residual)
        return hidden_states

    def load_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        strict: bool = True,
        sliced: bool = False,
    ) -> None:
        """`CheckpointModel.load_weights`, also taking a base model's bare names (`layers.0...`, `embed_tokens...`,
        `norm...`: a checkpoint saved from `Qwen3Model` / `LlamaModel`, as embedding models such as Qwen3-Embedding
        are) as the `model.` names they are."""
        super().load_weights(_with_model_prefix(weights), strict=strict, sliced=sliced)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The first layer's input for `input_ids` (a family that scales its embeddings overrides this)."""
        return self.model.embed_tokens(input_ids)

    def layer_rotations(
        self, batch: BatchInputs, cos: torch.Tensor, sin: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's `(cos, sin)` for this forward: the one table's for every layer (a family whose layers rotate
        with tables of their own overrides this)."""
        return [(cos, sin)] * self.num_layers

    def run_layers(
        self,
        batch: BatchInputs,
        hidden_states: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata_by_window: dict[int | None, Any],
        logits_indices: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Every decoder layer in turn: `(block output, residual)` of the last one (the residual is None when there
        are no layers), the last layer's rows cut to `logits_indices`. `metadata_by_window` is keyed by
        `layer_metadata_keys` (windows, or KV cache groups)."""
        rotations = self.layer_rotations(batch, cos, sin)
        residual: torch.Tensor | None = None
        last_layer = self.num_layers - 1
        layer_pages, metadata_keys = self.layer_pages, self.layer_metadata_keys
        for layer_index, layer in enumerate(self.model.layers):
            layer_cos, layer_sin = rotations[layer_index]
            hidden_states, residual = layer(
                hidden_states,
                residual,
                layer_cos,
                layer_sin,
                kv_cache[layer_pages[layer_index]],
                metadata_by_window[metadata_keys[layer_index]],
                logits_indices if layer_index == last_layer else None,
            )
        return hidden_states, residual


def _max_position(batch: BatchInputs) -> int:
    """`max(seq_lens) - 1` (0 without requests): the largest position a step's tokens may sit at, read as a
    Python list (no torch reduction to dispatch: a step's few requests are cheaper to scan in Python)."""
    if not batch.num_reqs:
        return 0
    return max(batch.seq_lens.tolist()) - 1


_BASE_MODEL_PREFIXES = ("layers.", "embed_tokens.", "norm.")


def _with_model_prefix(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        yield (f"model.{name}" if name.startswith(_BASE_MODEL_PREFIXES) else name), tensor
