"""BERT and XLM-RoBERTa encoders (`BertModel`, `XLMRobertaModel`) and their sequence-classification heads, for
embeddings, reranking and classification (issue 43).

An encoder step is prefill-only and keeps no cache: `input_ids` is every sequence's tokens back to back
(`[total_tokens]`) with `seq_lens` (or `query_start_loc`, `[num_seqs + 1]`) saying where each sequence ends, and the
result is the last hidden states `[total_tokens, hidden_size]` (or, for a classifier, logits
`[num_seqs, num_labels]`). The sequences stay packed (no padding): attention runs per sequence (bidirectional, over
that sequence only) and every other operation row by row over all of them at once, so a sequence's output is bit for
bit the same alone or in any batch: the matrix products never run the few-row algorithms whose sums are ordered
otherwise (`_RowInvariantLinear`), so a row's result depends on its own values only (checked by the tests).

The config is read from `config.json` by `kvflow.models.encoder_config`, not by `kvflow.models.hf_config`, whose
`TransformerConfig` describes decoders; `load_encoder_model` builds and loads a model from a checkpoint folder.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from kvflow.distributed.parallel_state import TensorParallelGroup
from kvflow.kernels.encoder_attention import varlen_attention
from kvflow.models.checkpoint_files import iterate_safetensors_weights
from kvflow.models.encoder_config import (
    ENCODER_ARCHITECTURES,
    EncoderConfig,
    load_encoder_config,
    parse_encoder_config,
)
from kvflow.models.layers.linear import Linear
from kvflow.models.loader import CheckpointModel, resolve_runner_dtype

if TYPE_CHECKING:
    from kvflow.batch import BatchInputs
    from kvflow.config import ModelConfig
    from kvflow.model_info import ModelInfo
    from kvflow.models.quantization import QuantizationPlan

__all__ = [
    "ENCODER_ARCHITECTURES",
    "BertEncoderModel",
    "BertForSequenceClassification",
    "EncoderConfig",
    "XLMRobertaForSequenceClassification",
    "load_encoder_config",
    "load_encoder_model",
    "parse_encoder_config",
]

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}
# Checkpoint prefixes a base model's tensors carry inside a task checkpoint (`bert.` in BertFor*, `roberta.` in
# XLMRobertaFor*), stripped before mapping.
_BASE_PREFIXES = ("bert.", "roberta.")
# Tensors no parameter holds: the position-id buffer older checkpoints save, and heads an encoder does not run
# (the masked-LM heads `cls.` / `lm_head.`, and the pooler for a plain encoder).
_IGNORED_PREFIXES = ("cls.", "lm_head.")
_IGNORED_SUFFIXES = ("embeddings.position_ids",)


class _Embedding(nn.Module):
    """A lookup table `weight [num_embeddings, dim]`, loaded whole."""

    def __init__(
        self, num_embeddings: int, dim: int, dtype: torch.dtype, device: torch.device | str
    ):
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(num_embeddings, dim, dtype=dtype, device=device), requires_grad=False
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class _LayerNorm(nn.Module):
    """LayerNorm over the last dimension with a weight and a bias, in the activations' dtype (as BERT runs it)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(dim, dtype=dtype, device=device), requires_grad=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(hidden_states, self.weight.shape, self.weight, self.bias, self.eps)


class _RowInvariantLinear(Linear):
    """A `Linear` whose rows come out the same whatever rows are multiplied with them (`row_invariant_linear`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.row_invariant = True


class _EncoderLayer(nn.Module):
    """One post-LN encoder layer: `x = norm(x + attn(x))`, then `x = norm(x + down(act(up(x))))`.

    Invariant: attention is unmasked within each sequence (bidirectional) and never crosses sequences, with the
    scale `1 / sqrt(head_dim)`; every other operation works row by row. Attention runs on the CPU kernel over all
    the packed sequences at once (`kvflow.kernels.encoder_attention`, row invariant by construction) where it
    applies, else PyTorch's fused attention per sequence (float32 for a bfloat16 model).
    """

    def __init__(self, config: EncoderConfig, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        hidden, inter = config.hidden_size, config.intermediate_size
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.qkv_proj = _RowInvariantLinear(
            hidden, [hidden] * 3, bias=True, dtype=dtype, device=device
        )
        self.attn_out = _RowInvariantLinear(hidden, hidden, bias=True, dtype=dtype, device=device)
        self.attn_norm = _LayerNorm(hidden, config.layer_norm_eps, dtype, device)
        self.up = _RowInvariantLinear(hidden, inter, bias=True, dtype=dtype, device=device)
        self.down = _RowInvariantLinear(inter, hidden, bias=True, dtype=dtype, device=device)
        self.mlp_norm = _LayerNorm(hidden, config.layer_norm_eps, dtype, device)
        self.act = _ACTIVATIONS[config.hidden_act]

    def forward(
        self,
        hidden_states: torch.Tensor,
        bounds: list[tuple[int, int]] | None = None,
        cu_seqlens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The layer over packed sequences: `hidden_states` `[total_tokens, hidden]` holds each sequence's rows at
        its `(start, end)` in `bounds` (None: one sequence of every row; `cu_seqlens`, when given, the same bounds as
        an int64 tensor of the starts and the last end). Projections, norms and the activation run on all rows at
        once (row by row the same: they mix no rows); attention runs within each sequence."""
        num_tokens = hidden_states.shape[0]
        if bounds is None:
            bounds = [(0, num_tokens)]
        qkv = self.qkv_proj(hidden_states).view(num_tokens, 3, self.num_heads, self.head_dim)
        if cu_seqlens is None:
            cu_seqlens = _cu_seqlens(bounds)
        query, key, value = qkv.unbind(1)
        attended = varlen_attention(query, key, value, cu_seqlens, 1.0 / math.sqrt(self.head_dim))
        if attended is None:
            attended = self._torch_attention(qkv, bounds)
        hidden_states = self.attn_norm(hidden_states + self.attn_out(attended))
        mlp = self.down(self.act(self.up(hidden_states)))
        return self.mlp_norm(hidden_states + mlp)

    def _torch_attention(self, qkv: torch.Tensor, bounds: list[tuple[int, int]]) -> torch.Tensor:
        """`[total_tokens, heads * head_dim]` in qkv's dtype: PyTorch's fused attention, one sequence at a time."""
        num_tokens, dtype = qkv.shape[0], qkv.dtype
        if qkv.dtype is torch.bfloat16:
            # PyTorch's fused CPU attention runs float32 faster than bfloat16 (it widens bfloat16 block by block).
            qkv = qkv.float()
        attended = qkv.new_empty(num_tokens, self.num_heads * self.head_dim)
        for start, end in bounds:
            # [1, heads, seq_len, head_dim] each: the 4-D layout takes PyTorch's fused CPU attention kernel.
            query, key, value = qkv[start:end].permute(1, 2, 0, 3).unsqueeze(1).unbind(0)
            output = F.scaled_dot_product_attention(
                query, key, value, scale=1.0 / math.sqrt(self.head_dim)
            )
            attended[start:end] = output[0].transpose(0, 1).reshape(end - start, -1)
        return attended.to(dtype)


# The three checkpoint projections `qkv_proj` stacks, in shard order (`checkpoint_target` maps the names).
_PACKED_QKV = {"qkv_proj": ["query", "key", "value"]}
# Checkpoint name (after the base prefix) -> this module's name: (pattern, replacement, shard).
_NAME_RULES: tuple[tuple[re.Pattern[str], str, int | None], ...] = tuple(
    (re.compile(pattern), replacement, shard)
    for pattern, replacement, shard in (
        (r"^embeddings\.LayerNorm\.", "embeddings.norm.", None),
        (r"^encoder\.layer\.(\d+)\.attention\.self\.query\.", r"layers.\1.qkv_proj.", 0),
        (r"^encoder\.layer\.(\d+)\.attention\.self\.key\.", r"layers.\1.qkv_proj.", 1),
        (r"^encoder\.layer\.(\d+)\.attention\.self\.value\.", r"layers.\1.qkv_proj.", 2),
        (r"^encoder\.layer\.(\d+)\.attention\.output\.dense\.", r"layers.\1.attn_out.", None),
        (r"^encoder\.layer\.(\d+)\.attention\.output\.LayerNorm\.", r"layers.\1.attn_norm.", None),
        (r"^encoder\.layer\.(\d+)\.intermediate\.dense\.", r"layers.\1.up.", None),
        (r"^encoder\.layer\.(\d+)\.output\.dense\.", r"layers.\1.down.", None),
        (r"^encoder\.layer\.(\d+)\.output\.LayerNorm\.", r"layers.\1.mlp_norm.", None),
    )
)


def _encoder_target(checkpoint_name: str) -> tuple[str, int | None]:
    """This encoder's parameter name and shard for a (prefix-stripped) checkpoint tensor name."""
    for pattern, replacement, shard in _NAME_RULES:
        name, count = pattern.subn(replacement, checkpoint_name)
        if count:
            return name, shard
    return checkpoint_name, None


def _cu_seqlens(bounds: list[tuple[int, int]]) -> torch.Tensor:
    """The int64 CPU tensor `[num_seqs + 1]` of the sequences' starts and the last end (the kernel's bounds)."""
    return torch.tensor([start for start, _ in bounds] + [bounds[-1][1]], dtype=torch.int64)


def _strip_base_prefix(checkpoint_name: str) -> str:
    for prefix in _BASE_PREFIXES:
        if checkpoint_name.startswith(prefix):
            return checkpoint_name[len(prefix) :]
    return checkpoint_name


def _sequence_bounds(
    input_ids: torch.Tensor, seq_lens: torch.Tensor | None, query_start_loc: torch.Tensor | None
) -> list[tuple[int, int]]:
    """`(start, end)` of each sequence's rows in the flattened batch, from exactly one of `seq_lens` /
    `query_start_loc` (neither: one sequence of every token)."""
    if seq_lens is not None and query_start_loc is not None:
        raise ValueError("pass seq_lens or query_start_loc, not both")
    if query_start_loc is not None:
        starts = [int(x) for x in query_start_loc.tolist()]
    else:
        lens = [input_ids.shape[0]] if seq_lens is None else seq_lens.tolist()
        starts = [0, *itertools.accumulate(int(length) for length in lens)]
    if starts[0] != 0 or starts[-1] != input_ids.shape[0]:
        raise ValueError(
            f"the sequences cover tokens {starts[0]}..{starts[-1]}, input_ids has {input_ids.shape[0]}"
        )
    bounds = list(itertools.pairwise(starts))
    if any(end <= start for start, end in bounds):
        raise ValueError("every sequence needs at least one token")
    return bounds


class _EncoderCheckpoint(CheckpointModel):
    """A checkpoint model that loads only the tensors `_kept_weights` keeps (renamed as it says): an encoder's
    checkpoint also holds heads and buffers the model does not.

    As a runner model (runner "pooling" only) it keeps no KV cache (`make_kv_cache` is empty, a block costs 0
    bytes): every step gives it whole prompts, and `hidden_states(batch, kv_cache)` encodes each of the step's
    sequences on its own and returns the rows at `batch.logits_indices`.
    """

    samples_own_tokens = False
    # Bidirectional attention: a sequence is encoded whole, in one step (no chunked prefill, no prefix cache).
    is_causal = False

    @classmethod
    def build(
        cls,
        model_config: ModelConfig,
        model_info: ModelInfo,
        device: torch.device,
        tp: TensorParallelGroup | None = None,
    ) -> _EncoderCheckpoint:
        """The checkpoint folder's encoder with its weights, in `model_config.dtype` ("auto": the pooling runner's
        rule, `resolve_runner_dtype`), on one rank."""
        assert model_info.path is not None, f"model {model_info.name!r} has no checkpoint folder"
        if model_config.quantization is not None:
            raise ValueError(
                f"quantization={model_config.quantization!r}: encoder models run unquantized"
            )
        config = load_encoder_config(model_info.path)
        torch_dtype = resolve_runner_dtype(model_config.dtype, config, "pooling", device)
        model = cls(config, dtype=torch_dtype, device=device, tp=tp)
        model.load_weights(iterate_safetensors_weights(model_info.path))
        return model.eval()

    def make_kv_cache(self, num_blocks: int, block_size: int) -> torch.Tensor:
        return torch.zeros(0)

    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        return 0

    def encoder(self) -> BertEncoderModel:
        raise NotImplementedError

    def hidden_states(self, batch: BatchInputs, kv_cache: torch.Tensor) -> torch.Tensor:
        """The last hidden states `[len(logits_indices), hidden]` of the step's flat tokens at
        `batch.logits_indices`; each request's scheduled tokens are its whole prompt (token types from
        `batch.token_type_ids`, None: all 0)."""
        encoder = self.encoder()
        hidden = encoder.forward(
            batch.input_ids,
            query_start_loc=batch.query_start_loc,
            token_type_ids=batch.token_type_ids,
        )
        return hidden.index_select(0, batch.logits_indices.to(torch.int64))

    def _kept_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        raise NotImplementedError

    def load_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        strict: bool = True,
        sliced: bool = False,
    ) -> None:
        super().load_weights(self._kept_weights(weights), strict=strict, sliced=sliced)


class BertEncoderModel(_EncoderCheckpoint):
    """A `BertModel` / `XLMRobertaModel` encoder: embeddings (word + absolute position + token type, then
    LayerNorm) and `num_hidden_layers` post-LN layers; `forward` returns the last hidden states of every token.

    Invariants: attention never crosses sequences and everything else is row by row, so a sequence's hidden states
    are bit for bit those it gets alone (batch invariance, see the module docstring); position ids restart at
    `config.position_offset` for each sequence (XLM-RoBERTa's start after the padding index; equal to
    transformers' for sequences that hold no padding token). Checkpoint
    names load bare or under `bert.` / `roberta.`; the pooler, classifier and masked-LM heads are not held and are
    skipped (a classifier checkpoint loads as its base encoder).
    """

    packed_modules_mapping: ClassVar[dict[str, list[str]]] = _PACKED_QKV
    _skipped_prefixes: ClassVar[tuple[str, ...]] = ("pooler.", "classifier.", *_IGNORED_PREFIXES)

    def __init__(
        self,
        config: EncoderConfig,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        attention_backend: str = "torch",
        tp: TensorParallelGroup | None = None,
        quantization: QuantizationPlan | None = None,
    ) -> None:
        super().__init__()
        if tp is not None and tp.size > 1:
            raise ValueError("tensor parallelism: encoder models run on one rank")
        if quantization is not None:
            raise ValueError("quantization: encoder models run unquantized")
        self.config = config
        self.tp = tp if tp is not None else TensorParallelGroup.single()
        self.embeddings = nn.Module()
        self.embeddings.word_embeddings = _Embedding(
            config.vocab_size, config.hidden_size, dtype, device
        )
        self.embeddings.position_embeddings = _Embedding(
            config.max_position_embeddings, config.hidden_size, dtype, device
        )
        self.embeddings.token_type_embeddings = _Embedding(
            config.type_vocab_size, config.hidden_size, dtype, device
        )
        self.embeddings.norm = _LayerNorm(config.hidden_size, config.layer_norm_eps, dtype, device)
        self.layers = nn.ModuleList(
            _EncoderLayer(config, dtype, device) for _ in range(config.num_hidden_layers)
        )

    def checkpoint_target(self, checkpoint_name: str) -> tuple[str, int | None]:
        return _encoder_target(checkpoint_name)

    def encoder(self) -> BertEncoderModel:
        return self

    def _kept_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            name = _strip_base_prefix(name)
            if not name.startswith(self._skipped_prefixes) and not name.endswith(_IGNORED_SUFFIXES):
                yield name, tensor

    def embed(
        self,
        input_ids: torch.Tensor,
        token_type_ids: torch.Tensor | None,
        bounds: list[tuple[int, int]] | None = None,
    ) -> torch.Tensor:
        """Packed sequences' embeddings `[total_tokens, hidden]` after the embedding LayerNorm; position ids restart
        at each sequence's `(start, end)` in `bounds` (None: one sequence)."""
        if bounds is None:
            bounds = [(0, input_ids.shape[0])]
        longest = max(end - start for start, end in bounds)
        if longest > self.config.max_seq_len:
            raise ValueError(
                f"a sequence of {longest} tokens is longer than the model's {self.config.max_seq_len} positions"
            )
        offset = self.config.position_offset
        positions = torch.cat(
            [
                torch.arange(offset, offset + end - start, device=input_ids.device)
                for start, end in bounds
            ]
        )
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        embeddings = self.embeddings
        hidden = embeddings.word_embeddings(input_ids) + embeddings.token_type_embeddings(
            token_type_ids
        )
        hidden = hidden + embeddings.position_embeddings(positions)
        return embeddings.norm(hidden)

    def encode_sequence(
        self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The last hidden states `[seq_len, hidden]` of one sequence."""
        return self.encode_packed(input_ids, [(0, input_ids.shape[0])], token_type_ids)

    def encode_packed(
        self,
        input_ids: torch.Tensor,
        bounds: list[tuple[int, int]],
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The last hidden states `[total_tokens, hidden]` of sequences packed back to back, sequence i at rows
        `bounds[i]`. Batch invariance: attention is per sequence and everything else row by row, so a sequence's
        rows are bit for bit what it gets alone: the products never take their few-row algorithms
        (`_RowInvariantLinear`), so a row's result depends on its own values only (the tests check it)."""
        hidden_states = self.embed(input_ids, token_type_ids, bounds)
        cu_seqlens = _cu_seqlens(bounds)
        for layer in self.layers:
            hidden_states = layer(hidden_states, bounds, cu_seqlens)
        return hidden_states

    def forward(
        self,
        input_ids: torch.Tensor,
        seq_lens: torch.Tensor | None = None,
        query_start_loc: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The last hidden states `[total_tokens, hidden]` of a flattened batch (`_sequence_bounds`)."""
        bounds = _sequence_bounds(input_ids, seq_lens, query_start_loc)
        return self.encode_packed(input_ids, bounds, token_type_ids)

    def sequence_starts(
        self,
        input_ids: torch.Tensor,
        seq_lens: torch.Tensor | None,
        query_start_loc: torch.Tensor | None,
    ) -> torch.Tensor:
        """The row of each sequence's first token (its CLS / `<s>`) in the flattened batch."""
        bounds = _sequence_bounds(input_ids, seq_lens, query_start_loc)
        return torch.tensor([start for start, _ in bounds], device=input_ids.device)


class _SequenceClassifier(_EncoderCheckpoint):
    """An encoder and a head on each sequence's first token; `forward` returns logits `[num_seqs, num_labels]`.

    Invariants: the encoder's parameters are under `base.` (loaded from the checkpoint's `bert.` / `roberta.`
    tensors), the head's under their checkpoint names; a sequence's logits do not depend on the rest of the batch.
    """

    packed_modules_mapping: ClassVar[dict[str, list[str]]] = _PACKED_QKV
    _head_names: ClassVar[tuple[str, ...]] = ()

    def __init__(
        self,
        config: EncoderConfig,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        attention_backend: str = "torch",
        tp: TensorParallelGroup | None = None,
        quantization: QuantizationPlan | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.base = BertEncoderModel(
            config, dtype=dtype, device=device, tp=tp, quantization=quantization
        )
        self.tp = self.base.tp

    def checkpoint_target(self, checkpoint_name: str) -> tuple[str, int | None] | None:
        if checkpoint_name.startswith(self._head_names):
            return None
        name, shard = _encoder_target(checkpoint_name.removeprefix("base."))
        return f"base.{name}", shard

    def _kept_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            if name.startswith(self._head_names):
                yield name, tensor
                continue
            name = _strip_base_prefix(name)
            if name.startswith(self._head_names):  # BERT's pooler sits under `bert.`
                yield name, tensor
            elif not name.startswith(_IGNORED_PREFIXES) and not name.endswith(_IGNORED_SUFFIXES):
                yield f"base.{name}", tensor

    def encoder(self) -> BertEncoderModel:
        return self.base

    @property
    def num_labels(self) -> int:
        return self.config.num_labels

    def classify(self, first_token_states: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(
        self,
        input_ids: torch.Tensor,
        seq_lens: torch.Tensor | None = None,
        query_start_loc: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits `[num_seqs, num_labels]` of a flattened batch (`_sequence_bounds`), each sequence run alone."""
        bounds = _sequence_bounds(input_ids, seq_lens, query_start_loc)
        hidden_states = self.base.encode_packed(input_ids, bounds, token_type_ids)
        return torch.cat([self.classify(hidden_states[start : start + 1]) for start, _ in bounds])


class BertForSequenceClassification(_SequenceClassifier):
    """BERT's classifier: the pooler (`dense` + tanh on the CLS token's state), then `classifier`."""

    _head_names = ("pooler.", "classifier.")

    def __init__(self, config: EncoderConfig, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        weight = self.base.embeddings.word_embeddings.weight
        hidden = config.hidden_size
        self.pooler = nn.Module()
        self.pooler.dense = Linear(
            hidden, hidden, bias=True, dtype=weight.dtype, device=weight.device
        )
        self.classifier = Linear(
            hidden, config.num_labels, bias=True, dtype=weight.dtype, device=weight.device
        )

    def classify(self, first_token_states: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.tanh(self.pooler.dense(first_token_states)))


class XLMRobertaForSequenceClassification(_SequenceClassifier):
    """XLM-RoBERTa's classifier: `classifier.dense` + tanh on the `<s>` token's state, then `classifier.out_proj`."""

    _head_names = ("classifier.",)

    def __init__(self, config: EncoderConfig, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        weight = self.base.embeddings.word_embeddings.weight
        hidden = config.hidden_size
        self.classifier = nn.Module()
        self.classifier.dense = Linear(
            hidden, hidden, bias=True, dtype=weight.dtype, device=weight.device
        )
        self.classifier.out_proj = Linear(
            hidden, config.num_labels, bias=True, dtype=weight.dtype, device=weight.device
        )

    def classify(self, first_token_states: torch.Tensor) -> torch.Tensor:
        return self.classifier.out_proj(torch.tanh(self.classifier.dense(first_token_states)))


_MODEL_CLASSES: dict[str, type[CheckpointModel]] = {
    "BertModel": BertEncoderModel,
    "XLMRobertaModel": BertEncoderModel,
    "BertForSequenceClassification": BertForSequenceClassification,
    "XLMRobertaForSequenceClassification": XLMRobertaForSequenceClassification,
}


def load_encoder_model(
    model_path: str | Path, dtype: str = "auto", device: torch.device | str = "cpu"
) -> CheckpointModel:
    """The checkpoint folder's encoder (or classifier) with its weights, in eval mode, in `dtype` ("float32",
    "bfloat16", "float16", or "auto": the pooling runner's rule, `resolve_runner_dtype`: a float32 checkpoint in
    bfloat16 on a CPU with native bfloat16, float16 on CUDA, else the checkpoint's `torch_dtype`)."""
    config = load_encoder_config(model_path)
    torch_dtype = resolve_runner_dtype(dtype, config, "pooling", device)
    model = _MODEL_CLASSES[config.architecture](config, dtype=torch_dtype, device=device)
    model.load_weights(iterate_safetensors_weights(model_path))
    return model.eval()
