"""Llama-family decoders over the paged KV cache: Llama (1-3), Mistral, Qwen2 and Qwen3 share this implementation.

Per forward: the attention metadata and the RoPE cos/sin are built once from the `BatchInputs`; each layer then runs
one fused QKV matmul, RoPE (after the per-head q/k RMSNorm for Qwen3), paged attention through the backend, the
output projection, and one fused gate/up matmul. In the last layer only the rows at `logits_indices` go past attention
(output projection, MLP, final norm, LM head), and only the logits are upcast to float32.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from kvflow import kernels
from kvflow.distributed.parallel_state import (
    TensorParallelGroup,
    kv_head_partition,
    split_evenly,
)
from kvflow.kernels import load_cpu_kernels
from kvflow.models.attention import AttentionBackend, get_attention_backend
from kvflow.models.attention.cpu_paged import CpuPagedAttention
from kvflow.models.layers import (
    ColumnParallelLinear,
    Linear,
    LMHead,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabEmbedding,
    silu_and_mul,
)

if TYPE_CHECKING:
    from kvflow.batch import BatchInputs
    from kvflow.models.hf_config import TransformerConfig

logger = logging.getLogger(__name__)

# (kvflow fused projection, checkpoint projection, shard index): checkpoint tensors that load into a fused weight.
_STACKED_PROJECTIONS = (
    (".qkv_proj.", ".q_proj.", 0),
    (".qkv_proj.", ".k_proj.", 1),
    (".qkv_proj.", ".v_proj.", 2),
    (".gate_up_proj.", ".gate_proj.", 0),
    (".gate_up_proj.", ".up_proj.", 1),
)
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# Most decode rows a step may run through `decode_layer` (the C++ side's kMaxDecodeLayerRows).
FUSED_DECODE_MAX_ROWS = 64


def tp_head_ranges(
    config: TransformerConfig, tp: TensorParallelGroup
) -> tuple[tuple[int, int], tuple[int, int]]:
    """`((first query head, query heads), (first KV head, KV heads))` rank `tp.rank` holds: the query heads divided
    evenly, the KV heads as `kv_head_partition` says (each rank's query heads attend to its KV heads only).
    Counts that do not divide are a ValueError naming the field."""
    heads = split_evenly(config.num_attention_heads, tp.size, tp.rank, "num_attention_heads")
    kv_heads = kv_head_partition(config.num_key_value_heads, tp.size, tp.rank)
    return heads, kv_heads


class LlamaAttention(nn.Module):
    """Self-attention with fused QKV: `qkv_proj` stacks q (num_heads), k and v (num_kv_heads) rows, in that order.

    Invariants: `q_norm`/`k_norm` exist exactly when the config has `qk_norm` (Qwen3), and are applied per head
    before RoPE; the backend is shared by every layer and holds no per-layer state. Under tensor parallelism
    `num_heads` / `num_kv_heads` are this rank's heads (`tp_head_ranges`): `qkv_proj` is column-parallel, `o_proj`
    row-parallel (one all-reduce).
    """

    def __init__(
        self,
        config: TransformerConfig,
        backend: AttentionBackend,
        *,
        dtype: torch.dtype,
        device: torch.device,
        tp: TensorParallelGroup,
    ) -> None:
        super().__init__()
        (first_head, self.num_heads), (first_kv_head, self.num_kv_heads) = tp_head_ranges(
            config, tp
        )
        self.head_dim = config.head_dim
        q_range = (first_head * self.head_dim, self.num_heads * self.head_dim)
        kv_range = (first_kv_head * self.head_dim, self.num_kv_heads * self.head_dim)
        self.qkv_proj = ColumnParallelLinear(
            config.hidden_size,
            (q_range, kv_range, kv_range),
            bias=config.attention_bias,
            dtype=dtype,
            device=device,
        )
        self.o_proj = RowParallelLinear(
            q_range,
            config.hidden_size,
            bias=config.o_proj_bias,
            tp=tp,
            dtype=dtype,
            device=device,
        )
        self.q_norm = (
            RMSNorm(self.head_dim, config.rms_norm_eps, dtype=dtype, device=device)
            if config.qk_norm
            else None
        )
        self.k_norm = (
            RMSNorm(self.head_dim, config.rms_norm_eps, dtype=dtype, device=device)
            if config.qk_norm
            else None
        )
        self.backend = backend

    def forward(
        self,
        hidden_states: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache_layer: torch.Tensor,
        metadata: Any,
        output_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attend for every token (all of them write K/V); with `output_rows`, project only those rows."""
        num_tokens = hidden_states.shape[0]
        qkv = self.qkv_proj(hidden_states).view(
            num_tokens, self.num_heads + 2 * self.num_kv_heads, self.head_dim
        )
        value = qkv[:, self.num_heads + self.num_kv_heads :]
        if self.q_norm is not None and self.k_norm is not None:
            query = RotaryEmbedding.apply(self.q_norm(qkv[:, : self.num_heads]), cos, sin)
            key = RotaryEmbedding.apply(
                self.k_norm(qkv[:, self.num_heads : self.num_heads + self.num_kv_heads]), cos, sin
            )
        else:
            rotated = RotaryEmbedding.apply(qkv[:, : self.num_heads + self.num_kv_heads], cos, sin)
            query, key = rotated[:, : self.num_heads], rotated[:, self.num_heads :]
        attended = self.backend.forward(query, key, value, kv_cache_layer, metadata)
        if output_rows is not None:
            attended = attended.index_select(0, output_rows)
        return self.o_proj(attended.reshape(attended.shape[0], self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    """SwiGLU MLP: `down(silu(gate(x)) * up(x))` with gate and up fused in `gate_up_proj` (gate rows first).
    Under tensor parallelism each rank holds a slice of the intermediate size: gate/up column-parallel, down
    row-parallel (one all-reduce)."""

    def __init__(
        self,
        config: TransformerConfig,
        *,
        dtype: torch.dtype,
        device: torch.device,
        tp: TensorParallelGroup,
    ) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(
                f"unsupported hidden_act {config.hidden_act!r}; only 'silu' is implemented"
            )
        intermediate_range = split_evenly(
            config.intermediate_size, tp.size, tp.rank, "intermediate_size"
        )
        self.gate_up_proj = ColumnParallelLinear(
            config.hidden_size,
            (intermediate_range,) * 2,
            bias=config.mlp_bias,
            dtype=dtype,
            device=device,
        )
        self.down_proj = RowParallelLinear(
            intermediate_range,
            config.hidden_size,
            bias=config.mlp_bias,
            tp=tp,
            dtype=dtype,
            device=device,
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(hidden_states)))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block; the residual stream is carried separately and added inside the next norm.

    Invariants: `forward` returns `(block output, residual before that output)`; their sum is the block's
    transformers-equivalent hidden state. With `output_rows` (the last layer: only sampled tokens matter) every
    token still writes its K/V, but only those rows go through the output projection and the MLP.
    """

    def __init__(
        self,
        config: TransformerConfig,
        backend: AttentionBackend,
        *,
        dtype: torch.dtype,
        device: torch.device,
        tp: TensorParallelGroup,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device
        )
        self.self_attn = LlamaAttention(config, backend, dtype=dtype, device=device, tp=tp)
        self.post_attention_layernorm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device
        )
        self.mlp = LlamaMLP(config, dtype=dtype, device=device, tp=tp)

    def forward(
        self,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache_layer: torch.Tensor,
        metadata: Any,
        output_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden_states, residual = self.input_layernorm.forward_with_residual(
            hidden_states, residual
        )
        hidden_states = self.self_attn(
            hidden_states, cos, sin, kv_cache_layer, metadata, output_rows
        )
        if output_rows is not None:
            residual = residual.index_select(0, output_rows)
        hidden_states, residual = self.post_attention_layernorm.forward_with_residual(
            hidden_states, residual
        )
        return self.mlp(hidden_states), residual

    def fused_decode_weights(self) -> tuple[torch.Tensor | None, ...]:
        """The layer's weights in `decode_layer`'s order: the two norms, then (weight, bias) of QKV, o, gate/up
        and down."""
        attention, mlp = self.self_attn, self.mlp
        return (
            self.input_layernorm.weight,
            self.post_attention_layernorm.weight,
            attention.qkv_proj.weight,
            attention.qkv_proj.bias,
            attention.o_proj.weight,
            attention.o_proj.bias,
            mlp.gate_up_proj.weight,
            mlp.gate_up_proj.bias,
            mlp.down_proj.weight,
            mlp.down_proj.bias,
        )


class LlamaModel(nn.Module):
    """Embedding, decoder layers and the final norm (parameter names follow the checkpoint's `model.*`)."""

    def __init__(
        self,
        config: TransformerConfig,
        backend: AttentionBackend,
        *,
        dtype: torch.dtype,
        device: torch.device,
        tp: TensorParallelGroup,
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(
            config.vocab_size, config.hidden_size, dtype=dtype, device=device, tp=tp
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, backend, dtype=dtype, device=device, tp=tp)
            for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device)


class LlamaForCausalLM(nn.Module):
    """A Llama-family causal LM run by the model runner over a paged KV cache.

    Invariants: every parameter is in `dtype` on `device`; with tied embeddings `lm_head.weight` IS
    `model.embed_tokens.weight`. The KV cache is `[num_layers, *backend.kv_cache_shape(...)]`
    (K then V) in `dtype`; `forward` writes each scheduled token's K/V at `batch.slot_mapping` before any layer reads
    it, and returns float32 logits for `batch.logits_indices` only. Attention metadata and RoPE cos/sin are built once
    per forward (one metadata per distinct sliding window) and shared by all layers. It does not sample: the
    runner's `Sampler` turns its logits into tokens (`samples_own_tokens` is False).

    Tensor parallelism (`tp` of N ranks): each rank holds its query heads and KV heads (`tp_head_ranges`), its
    slice of the MLP and of the vocabulary; `num_kv_heads` and the KV cache are this rank's, and the logits are
    gathered, so every rank returns the whole vocabulary's logits. `checkpoint_index` says which part of each
    checkpoint tensor a rank loads. With `tp=None` (one rank) nothing is split and no collective runs.
    """

    samples_own_tokens = False

    def __init__(
        self,
        config: TransformerConfig,
        *,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        attention_backend: str = "torch",
        tp: TensorParallelGroup | None = None,
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
            scale=config.head_dim**-0.5,
        )
        self.model = LlamaModel(
            config, self.attention_backend, dtype=dtype, device=self.device, tp=self.tp
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
        self._layer_windows = [
            config.layer_sliding_window(i) for i in range(config.num_hidden_layers)
        ]
        self._num_heads = num_heads
        # Whether decode-only steps may run each layer as one C++ call (decided at the first forward), and each
        # layer's `fused_decode_weights()` (gathered at the first such step; `load_weights` forgets them).
        self._fused_decode: bool | None = None
        self._fused_weights: list[tuple[torch.Tensor | None, ...]] | None = None

    # ------------------------------------------------------------------------------------------ KV cache
    def make_kv_cache(self, num_blocks: int, block_size: int) -> torch.Tensor:
        """A zeroed cache `[num_layers, *backend.kv_cache_shape(...)]` (torch backend: `[layers, 2, kv_heads,
        blocks, block_size, head_dim]`); zeros because padding that attention masks out must still be finite."""
        layer_shape = self.attention_backend.kv_cache_shape(
            num_blocks, block_size, self.num_kv_heads, self.head_dim
        )
        return torch.zeros((self.num_layers, *layer_shape), dtype=self.dtype, device=self.device)

    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        """Bytes one block takes across all layers, K and V."""
        element_size = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * block_size * self.num_kv_heads * self.head_dim * element_size

    # ------------------------------------------------------------------------------------------ forward
    def forward(self, batch: BatchInputs, kv_cache: torch.Tensor) -> torch.Tensor:
        """Run the batch's tokens, fill their KV slots, and return float32 logits `[num_sampled, vocab_size]`."""
        metadata_by_window = {
            window: self.attention_backend.build_metadata(batch, window)
            for window in set(self._layer_windows)
        }
        max_position = int(batch.seq_lens.max()) - 1 if batch.num_reqs else 0
        cos, sin = self.rotary_emb.cos_sin(batch.positions, self.dtype, max_position)
        logits_indices = batch.logits_indices.to(torch.int64)
        hidden_states = self.model.embed_tokens(batch.input_ids)
        residual: torch.Tensor | None = None
        if self._is_fused_decode_step(batch, metadata_by_window, logits_indices):
            hidden_states, residual = self._fused_decode_layers(
                hidden_states, cos, sin, kv_cache, metadata_by_window
            )
        else:
            last_layer = self.num_layers - 1
            for layer_index, layer in enumerate(self.model.layers):
                hidden_states, residual = layer(
                    hidden_states,
                    residual,
                    cos,
                    sin,
                    kv_cache[layer_index],
                    metadata_by_window[self._layer_windows[layer_index]],
                    logits_indices if layer_index == last_layer else None,
                )
        if residual is None:  # no layers
            hidden_states = hidden_states.index_select(0, logits_indices)
        hidden_states, _ = self.model.norm.forward_with_residual(hidden_states, residual)
        return self.lm_head(hidden_states)

    def _fused_decode_supported(self) -> bool:
        """Whether this model's layers match `decode_layer`: bfloat16 on the CPU with the AVX-512 kernels and the
        "cpu" attention backend, one rank, no per-head q/k norm. Then its decode-only steps take the very kernels
        the per-op path takes, in the same order, so the results are equal (see `_is_fused_decode_step`)."""
        if (
            self.device.type != "cpu"
            or self.dtype is not torch.bfloat16
            or self.tp.size != 1
            or self.config.qk_norm
            or not isinstance(self.attention_backend, CpuPagedAttention)
        ):
            return False
        ops = load_cpu_kernels()
        return ops is not None and ops.has_avx512()

    def _is_fused_decode_step(
        self,
        batch: BatchInputs,
        metadata_by_window: dict[int | None, Any],
        logits_indices: torch.Tensor,
    ) -> bool:
        """A step of only decode rows (one token each, every one sampled): up to `MAX_GEMV_ROWS` rows, or up to
        `FUSED_DECODE_MAX_ROWS` where `kernels.linear` sends more rows to the kernel's GEMM (which `decode_layer`
        then calls too), so the products are the per-op path's."""
        if self._fused_decode is None:
            self._fused_decode = self._fused_decode_supported()
        num_tokens = batch.num_tokens
        max_rows = (
            FUSED_DECODE_MAX_ROWS if kernels.gemm_kernel_wins_here() else kernels.MAX_GEMV_ROWS
        )
        if (
            not self._fused_decode
            or not 0 < num_tokens <= max_rows
            or batch.num_reqs != num_tokens
            or logits_indices.numel() != num_tokens
        ):
            return False
        return all(
            metadata.decode is not None and not metadata.torch_plan.prefills
            for metadata in metadata_by_window.values()
        )

    def _fused_decode_layers(
        self,
        hidden_states: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata_by_window: dict[int | None, Any],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every decoder layer as one `decode_layer` call; returns `(last layer's output, residual)`."""
        ops = load_cpu_kernels()
        slot_mapping = next(iter(metadata_by_window.values())).torch_plan.slot_mapping
        eps = self.config.rms_norm_eps
        scale = self.attention_backend.scale
        num_heads = self._num_heads
        if self._fused_weights is None:  # module attribute lookups cost ~1.5 ms a step, so once
            self._fused_weights = [layer.fused_decode_weights() for layer in self.model.layers]
        residual: torch.Tensor | None = None
        for layer_index, weights in enumerate(self._fused_weights):
            decode = metadata_by_window[self._layer_windows[layer_index]].decode
            hidden_states, residual = ops.decode_layer(
                hidden_states,
                residual,
                *weights,
                cos,
                sin,
                kv_cache,
                layer_index,
                slot_mapping,
                decode.block_tables,
                decode.seq_lens,
                num_heads,
                eps,
                scale,
                decode.window,
                kernels.MAX_GEMV_ROWS,
            )
        assert residual is not None
        return hidden_states, residual

    # ------------------------------------------------------------------------------------------ weights
    def checkpoint_index(self, checkpoint_name: str) -> tuple[slice, ...] | None:
        """The part of checkpoint tensor `checkpoint_name` this rank loads: `()` for all of it (always, with one
        rank), slices of its rows or columns, or None when this rank holds none of it (a row-parallel bias off the
        first rank). Names the model does not know are read whole, so `load_weights` reports them."""
        if self.tp.size == 1:
            return ()
        name, shard = _target_of(checkpoint_name)
        module_name, _, param_name = name.rpartition(".")
        module = dict(self.named_modules()).get(module_name)
        if isinstance(module, RowParallelLinear) and param_name == "bias" and module.bias is None:
            return None if module.has_checkpoint_bias else ()
        if module is None or not hasattr(module, "checkpoint_index"):
            return ()
        return module.checkpoint_index(param_name, shard)

    def load_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        strict: bool = True,
        sliced: bool = False,
    ) -> None:
        """Copy Hugging Face-named tensors in (fusing q/k/v and gate/up, casting to `dtype`).

        `weights` are whole checkpoint tensors, cut here to this rank's part (`checkpoint_index`), or, with
        `sliced`, already this rank's parts (as `iterate_safetensors_weights(path, model.checkpoint_index)` reads
        them). Raises one ValueError naming every unexpected name, shape mismatch and (when `strict`, as for a
        whole checkpoint) missing parameter; `strict=False` updates just the tensors given (a weight update).
        """
        self._fused_weights = None  # in-place copies keep the tensors, but a tie may swap one
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        expected = {
            (name, shard) for name in params for shard in range(self._num_shards(name, modules))
        }
        loaded: set[tuple[str, int]] = set()
        unexpected: list[str] = []
        mismatched: list[str] = []
        saw_lm_head = False
        for checkpoint_name, tensor in weights:
            if checkpoint_name.endswith(_IGNORED_SUFFIXES):
                continue
            if checkpoint_name == "lm_head.weight" and "lm_head.weight" not in params:
                saw_lm_head = True  # tied: the embedding provides it
                continue
            name, shard = _target_of(checkpoint_name)
            index = self.checkpoint_index(checkpoint_name)
            if index is None:
                continue  # another rank holds it
            if name not in params:
                unexpected.append(checkpoint_name)
                continue
            if index and not sliced:
                tensor = tensor[index]
            destination = self._destination(params[name], name, shard, modules)
            if tuple(destination.shape) != tuple(tensor.shape):
                mismatched.append(
                    f"{checkpoint_name}: checkpoint {tuple(tensor.shape)}, "
                    f"model {tuple(destination.shape)}"
                )
                continue
            with torch.no_grad():
                destination.copy_(tensor)
            loaded.add((name, shard))
        if strict:
            self._tie_if_lm_head_absent(expected, loaded)
        self._raise_on_load_errors(unexpected, mismatched, expected - loaded if strict else set())
        if saw_lm_head:
            logger.debug("tie_word_embeddings: ignored the checkpoint's lm_head.weight")

    @staticmethod
    def _num_shards(name: str, modules: dict[str, nn.Module]) -> int:
        module = modules[name.rsplit(".", 1)[0]]
        return len(module.output_sizes) if isinstance(module, Linear) else 1

    @staticmethod
    def _destination(
        param: torch.Tensor, name: str, shard: int, modules: dict[str, nn.Module]
    ) -> torch.Tensor:
        module = modules[name.rsplit(".", 1)[0]]
        if isinstance(module, Linear):
            return param.data[module.shard_rows(shard)]
        if isinstance(module, VocabEmbedding | LMHead):
            return module.checkpoint_destination()
        return param.data

    def _tie_if_lm_head_absent(
        self, expected: set[tuple[str, int]], loaded: set[tuple[str, int]]
    ) -> None:
        """A checkpoint without `lm_head.weight` ties the head to the embedding (as transformers does)."""
        lm_head = ("lm_head.weight", 0)
        if (
            lm_head in expected
            and lm_head not in loaded
            and ("model.embed_tokens.weight", 0) in loaded
        ):
            logger.warning(
                "checkpoint has no lm_head.weight: tying the LM head to the token embedding"
            )
            self.lm_head.tie(self.model.embed_tokens)
            expected.discard(lm_head)

    @staticmethod
    def _raise_on_load_errors(
        unexpected: list[str], mismatched: list[str], missing: set[tuple[str, int]]
    ) -> None:
        problems = []
        if unexpected:
            problems.append(f"unexpected parameters: {', '.join(unexpected)}")
        if mismatched:
            problems.append(f"shape mismatches: {'; '.join(mismatched)}")
        if missing:
            problems.append(f"missing parameters: {', '.join(_checkpoint_names(sorted(missing)))}")
        if problems:
            raise ValueError("cannot load checkpoint weights: " + " | ".join(problems))


def _target_of(checkpoint_name: str) -> tuple[str, int]:
    """The kvflow parameter and shard a checkpoint tensor loads into."""
    for fused, part, shard in _STACKED_PROJECTIONS:
        if part in checkpoint_name:
            return checkpoint_name.replace(part, fused), shard
    return checkpoint_name, 0


def _checkpoint_names(missing: list[tuple[str, int]]) -> list[str]:
    """Checkpoint-side names of missing (parameter, shard) pairs, so errors name what the file should hold."""
    names = []
    for name, shard in missing:
        for fused, part, part_shard in _STACKED_PROJECTIONS:
            if fused in name and part_shard == shard:
                names.append(name.replace(fused, part))
                break
        else:
            names.append(name)
    return names
