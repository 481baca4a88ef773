"""The decoder-only transformer configuration kvflow reads from a Hugging Face checkpoint's `config.json`.

Both RoPE styles found in the wild are accepted: hub checkpoints written by transformers 4 (`rope_theta` and
`rope_scaling` at the top level, the scaling dict keyed by `type` or `rope_type`) and transformers 5
(`rope_parameters: {"rope_type", "rope_theta", ...}`). Either way `TransformerConfig.rope_scaling` is None for plain
RoPE, else a dict holding `rope_type` and that type's parameters (never `rope_theta`).

Every architecture parses into the one `TransformerConfig`; where an architecture reads its keys differently from
Llama, its entry in `ARCHITECTURE_RULES` says how (the one place for per-architecture config handling). Which
architectures are accepted is the model registry's list, checked before any other key is read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvflow.models.encoder_config import ENCODER_ARCHITECTURES
from kvflow.models.registry import SUPPORTED_ARCHITECTURES, unsupported_architecture_error

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"

_REQUIRED_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)
_DEFAULT_ROPE_THETA = 10000.0
_DEFAULT_MAX_POSITION_EMBEDDINGS = 2048
# Gemma3TextConfig's defaults.
_GEMMA3_MAX_POSITION_EMBEDDINGS = 131_072
_GEMMA3_GLOBAL_THETA = 1_000_000.0
_GEMMA3_LOCAL_THETA = 10_000.0
_GEMMA3_SLIDING_WINDOW = 4096
_GEMMA3_SLIDING_WINDOW_PATTERN = 6
# Qwen2MoeConfig's and Qwen3MoeConfig's (used only with `use_sliding_window`).
_QWEN_MOE_SLIDING_WINDOW = 4096


@dataclass(frozen=True)
class ExpertRules:
    """How one mixture-of-experts architecture's `config.json` describes its experts; each default is its
    transformers config class's, for a key the file omits.

    `num_experts_keys`: the keys naming the expert count, first present wins (transformers 5 writes Qwen3-MoE's as
    `num_local_experts`). `qwen_keys`: the expert size is `moe_intermediate_size` (else `intermediate_size`, as
    Mixtral's), top-k weights are renormalised only with `norm_topk_prob` (else always, as Mixtral's), a shared
    expert is `shared_expert_intermediate_size` wide (`shared_expert_intermediate_size` here 0: the architecture has
    none), and `decoder_sparse_step` / `mlp_only_layers` make some layers dense.
    """

    num_experts_keys: tuple[str, ...]
    num_experts: int
    num_experts_per_tok: int
    qwen_keys: bool = False
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True


@dataclass(frozen=True)
class ArchitectureRules:
    """How one Hugging Face architecture's `config.json` is read where it departs from Llama's.

    `qkv_bias`: the q/k/v projections carry a bias unless the config's `qkv_bias` is false (Qwen2-MoE's key),
    and the output projection never does (whatever `attention_bias` says); `gated_sliding_window`:
    `sliding_window` applies only with `use_sliding_window`, to the layers from `max_window_layers` on; `qk_norm`:
    each query and key head is RMS-normalised before RoPE.
    `gemma2`: Gemma 2's keys (`hidden_activation`, `query_pre_attn_scalar`, the two soft-caps), embeddings tied
    unless `tie_word_embeddings` says otherwise, and without `layer_types` every even layer slides (transformers').
    `phi3_rope`: Phi-3 keeps `original_max_position_embeddings` and `partial_rotary_factor` at the top level; they
    go into `rope_scaling`, the top-level `original_max_position_embeddings` taking priority over the rope dict's
    for LongRoPE (as transformers' `Phi3Config` does), the rope dict's `partial_rotary_factor` over the top-level
    one (transformers 5 writes both; Phi-4-mini's is 0.75).
    `gemma3`: Gemma 3 text (`Gemma3TextConfig`): Gemma 2's keys with no soft-caps by default, q/k norms, layers
    sliding unless every `sliding_window_pattern`-th (default 6) without `layer_types`, and two RoPE settings: sliding
    layers `rope_local_base_freq` (plain), full ones `rope_theta` with `rope_scaling` (or transformers 5's
    per-layer-type `rope_parameters`); `Gemma3TextConfig`'s defaults for omitted keys.
    `experts`: the mixture-of-experts keys (`ExpertRules`), None for a dense architecture. Mixtral's
    `sliding_window` (when set) applies to every layer, as for Llama/Mistral.
    `qwen_moe_window`: `sliding_window` applies only with `use_sliding_window`: "alternate" (Qwen2-MoE's
    `layer_types`, else every other layer from the first, below `max_window_layers`, default 28), "all" (Qwen3-MoE:
    every layer).
    """

    qkv_bias: bool = False
    experts: ExpertRules | None = None
    qwen_moe_window: str = ""
    gated_sliding_window: bool = False
    qk_norm: bool = False
    gemma2: bool = False
    phi3_rope: bool = False
    gemma3: bool = False


# The per-architecture config hooks, in one place: an architecture the registry runs and this table does not list
# reads its config.json as Llama's (`ArchitectureRules()`).
ARCHITECTURE_RULES: dict[str, ArchitectureRules] = {
    "Qwen2ForCausalLM": ArchitectureRules(qkv_bias=True, gated_sliding_window=True),
    "Qwen3ForCausalLM": ArchitectureRules(gated_sliding_window=True, qk_norm=True),
    # The same decoders as embedding models (no LM head) and classifiers (a `score` head): runner "pooling".
    "Qwen2Model": ArchitectureRules(qkv_bias=True, gated_sliding_window=True),
    "Qwen2ForSequenceClassification": ArchitectureRules(qkv_bias=True, gated_sliding_window=True),
    "Qwen3Model": ArchitectureRules(gated_sliding_window=True, qk_norm=True),
    "Qwen3ForSequenceClassification": ArchitectureRules(gated_sliding_window=True, qk_norm=True),
    "Gemma2ForCausalLM": ArchitectureRules(gemma2=True),
    "Phi3ForCausalLM": ArchitectureRules(phi3_rope=True),
    "Gemma3ForCausalLM": ArchitectureRules(gemma3=True, qk_norm=True),
    "MixtralForCausalLM": ArchitectureRules(
        experts=ExpertRules(("num_local_experts",), num_experts=8, num_experts_per_tok=2)
    ),
    "Qwen2MoeForCausalLM": ArchitectureRules(
        qkv_bias=True,
        experts=ExpertRules(
            ("num_experts", "num_local_experts"),
            num_experts=60,
            num_experts_per_tok=4,
            qwen_keys=True,
            moe_intermediate_size=1408,
            shared_expert_intermediate_size=5632,
            norm_topk_prob=False,
        ),
        qwen_moe_window="alternate",
    ),
    "Qwen3MoeForCausalLM": ArchitectureRules(
        qk_norm=True,
        experts=ExpertRules(
            ("num_experts", "num_local_experts"),
            num_experts=128,
            num_experts_per_tok=8,
            qwen_keys=True,
            moe_intermediate_size=768,
            norm_topk_prob=False,
        ),
        qwen_moe_window="all",
    ),
}
_LLAMA_RULES = ArchitectureRules()


@dataclass(frozen=True)
class TransformerConfig:
    """A decoder-only transformer's shape and numerics, as parsed from `config.json`.

    Invariants: `num_attention_heads` is a multiple of `num_key_value_heads`; `head_dim` is the explicit `head_dim`
    key or `hidden_size // num_attention_heads`; `rope_scaling` is None or a dict with a `rope_type` key and no
    `rope_theta`; `layer_types` has one entry per layer, each `"full_attention"` or `"sliding_attention"`, and
    `sliding_window` is None exactly when no layer slides. `attention_bias` is the q/k/v bias, `o_proj_bias` the
    output projection's, `mlp_bias` the MLP projections'. `query_pre_attn_scalar` (None: `head_dim`) sets the
    attention scale `query_pre_attn_scalar ** -0.5`; `attn_logit_softcapping` / `final_logit_softcapping` (None:
    none) cap attention scores / final logits as `tanh(x / cap) * cap`. `sliding_rope_theta` (None: as the full
    layers) is the plain RoPE base of sliding-window layers (Gemma 3's local layers). `num_experts` (0: a dense
    model) and `num_experts_per_tok` describe a mixture-of-experts feed-forward block: experts
    `moe_intermediate_size` wide, top-k weights renormalised when `norm_topk_prob`, a shared expert when
    `shared_expert_intermediate_size` (0: none); layer i has experts when `layer_has_experts(i)` (every
    `decoder_sparse_step`-th layer not in `mlp_only_layers`), the others a dense MLP `intermediate_size` wide.
    A `partial_rotary_factor` in `rope_scaling`: RoPE rotates only the first `int(head_dim * factor)` dims of each
    head (`kvflow.models.layers.rotary`).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    sliding_window: int | None
    torch_dtype: str | None
    bos_token_id: int | None
    eos_token_id: int | list[int] | None
    o_proj_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    layer_types: tuple[str, ...] = ()
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    sliding_rope_theta: float | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # A sequence classifier's labels (`id2label`'s size, else `num_labels`; 2 as in transformers).
    num_labels: int = 2

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if not self.layer_types:
            object.__setattr__(self, "layer_types", (FULL_ATTENTION,) * self.num_hidden_layers)
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers"
            )
        unknown = sorted(set(self.layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION})
        if unknown:
            raise ValueError(
                f"unsupported layer_types {unknown}; supported: {FULL_ATTENTION!r}, {SLIDING_ATTENTION!r}"
            )
        if self.decoder_sparse_step < 1:
            raise ValueError(
                f"decoder_sparse_step {self.decoder_sparse_step} is not a positive integer"
            )
        outside = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        if outside:
            raise ValueError(
                f"mlp_only_layers {outside} outside the {self.num_hidden_layers} layers (0.."
                f"{self.num_hidden_layers - 1})"
            )

    def layer_has_experts(self, layer_index: int) -> bool:
        """Whether layer `layer_index`'s feed-forward block is the mixture of experts (else a dense MLP)."""
        return (
            self.num_experts > 0
            and layer_index not in self.mlp_only_layers
            and (layer_index + 1) % self.decoder_sparse_step == 0
        )

    def layer_sliding_window(self, layer_index: int) -> int | None:
        """The sliding window of layer `layer_index` (None: it attends to the whole sequence)."""
        return self.sliding_window if self.layer_types[layer_index] == SLIDING_ATTENTION else None


def load_hf_config(model_path: str | Path) -> TransformerConfig:
    """Parse `<model_path>/config.json`; errors name the missing folder, the file, or the missing key."""
    path = Path(model_path)
    if not path.is_dir():
        raise FileNotFoundError(f"model folder {str(path)!r} does not exist")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(
            f"{str(config_file)!r} not found: {str(path)!r} is not a Hugging Face checkpoint"
        )
    try:
        raw = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{str(config_file)!r} is not valid JSON: {error}") from error
    if not isinstance(raw, dict):
        raise ValueError(f"{str(config_file)!r} does not hold a JSON object")
    try:
        return parse_hf_config(raw)
    except KeyError as error:
        raise ValueError(f"{str(config_file)!r} lacks the required key {error.args[0]!r}") from None
    except (TypeError, ValueError) as error:
        raise ValueError(f"{str(config_file)!r}: {error}") from error


def parse_hf_config(raw: dict[str, Any]) -> TransformerConfig:
    """Build a `TransformerConfig` from a parsed `config.json`; an architecture kvflow does not run raises
    ValueError (before any other key is read), a missing required key KeyError(key)."""
    architecture = _architecture(raw)
    for key in _REQUIRED_KEYS:
        if raw.get(key) is None:
            raise KeyError(key)
    num_layers = int(raw["num_hidden_layers"])
    num_heads = int(raw["num_attention_heads"])
    rules = ARCHITECTURE_RULES.get(architecture, _LLAMA_RULES)
    rope_theta, rope_scaling = rope_settings(raw)
    gemma_fields: dict[str, Any] = {}
    if rules.gemma3:
        rope_theta, rope_scaling, sliding_theta = _gemma3_rope(raw)
        gemma_fields = {**_gemma2_fields(raw, None, None), "sliding_rope_theta": sliding_theta}
    elif rules.gemma2:
        gemma_fields = _gemma2_fields(raw, 50.0, 30.0)
    if rules.phi3_rope:
        rope_scaling = _phi3_rope_scaling(raw, rope_scaling)
    sliding_window, layer_types = _sliding_window(raw, rules, num_layers)
    attention_bias = bool(
        raw.get("qkv_bias", True) if rules.qkv_bias else raw.get("attention_bias", False)
    )
    return TransformerConfig(
        architecture=architecture,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=int(raw["hidden_size"]),
        intermediate_size=int(raw["intermediate_size"]),
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=int(raw.get("num_key_value_heads") or num_heads),
        head_dim=int(raw.get("head_dim") or int(raw["hidden_size"]) // num_heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=int(
            raw.get("max_position_embeddings")
            or (
                _GEMMA3_MAX_POSITION_EMBEDDINGS
                if rules.gemma3
                else _DEFAULT_MAX_POSITION_EMBEDDINGS
            )
        ),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", rules.gemma2 or rules.gemma3)),
        attention_bias=attention_bias,
        qk_norm=rules.qk_norm,
        sliding_window=sliding_window,
        torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_id=raw.get("eos_token_id"),
        o_proj_bias=attention_bias and not rules.qkv_bias,
        mlp_bias=bool(raw.get("mlp_bias", False)),
        layer_types=layer_types,
        num_labels=len(raw["id2label"]) if raw.get("id2label") else int(raw.get("num_labels", 2)),
        **_expert_fields(raw, rules.experts),
        **(gemma_fields or {"hidden_act": str(raw.get("hidden_act", "silu"))}),
    )


def _expert_fields(raw: dict[str, Any], rules: ExpertRules | None) -> dict[str, Any]:
    """The mixture-of-experts fields of `TransformerConfig` as `rules` reads them (none for a dense model)."""
    if rules is None:
        return {}
    num_experts = next(
        (raw[key] for key in rules.num_experts_keys if raw.get(key) is not None), rules.num_experts
    )
    fields: dict[str, Any] = {
        "num_experts": int(num_experts),
        "num_experts_per_tok": int(raw.get("num_experts_per_tok") or rules.num_experts_per_tok),
        "moe_intermediate_size": int(raw["intermediate_size"]),
        "norm_topk_prob": rules.norm_topk_prob,
    }
    if rules.qwen_keys:
        shared = raw.get("shared_expert_intermediate_size", rules.shared_expert_intermediate_size)
        fields.update(
            moe_intermediate_size=int(
                raw.get("moe_intermediate_size") or rules.moe_intermediate_size
            ),
            shared_expert_intermediate_size=int(shared or 0),
            norm_topk_prob=bool(raw.get("norm_topk_prob", rules.norm_topk_prob)),
            decoder_sparse_step=int(raw.get("decoder_sparse_step", 1)),
            mlp_only_layers=tuple(int(i) for i in raw.get("mlp_only_layers") or ()),
        )
    return fields


def _phi3_rope_scaling(
    raw: dict[str, Any], scaling: dict[str, Any] | None
) -> dict[str, Any] | None:
    """Phi-3's top-level rope keys folded into the scaling dict (see `ArchitectureRules.phi3_rope`)."""
    partial = raw.get("partial_rotary_factor")
    if partial is not None and float(partial) != 1.0:
        scaling = {
            "rope_type": "default",
            "partial_rotary_factor": float(partial),
            **(scaling or {}),
        }
    original = raw.get("original_max_position_embeddings")
    if scaling is not None and scaling["rope_type"] in ("longrope", "su") and original is not None:
        scaling = {**scaling, "original_max_position_embeddings": int(original)}
    return scaling


def _gemma2_fields(
    raw: dict[str, Any], attn_softcap: float | None, final_softcap: float | None
) -> dict[str, Any]:
    """Gemma's activation (transformers reads `hidden_activation`, not `hidden_act`), attention scale and
    soft-caps, with the given soft-cap defaults (`Gemma2Config`'s: 50 and 30; `Gemma3TextConfig`'s: none)."""

    def optional_float(key: str, default: float | None) -> float | None:
        value = raw.get(key, default)
        return None if value is None else float(value)

    return {
        "hidden_act": str(raw.get("hidden_activation") or "gelu_pytorch_tanh"),
        "query_pre_attn_scalar": float(raw.get("query_pre_attn_scalar", 256)),
        "attn_logit_softcapping": optional_float("attn_logit_softcapping", attn_softcap),
        "final_logit_softcapping": optional_float("final_logit_softcapping", final_softcap),
    }


def _gemma3_rope(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None, float]:
    """(full layers' theta, their scaling, sliding layers' theta) as `Gemma3TextConfig` reads them: transformers 5's
    `rope_parameters` keyed by layer type, else `rope_theta` / `rope_scaling` / `rope_local_base_freq`. Sliding
    layers' RoPE must be plain (transformers' defaults); bidirectional attention is a ValueError."""
    if raw.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention (Gemma 3 embedding models) is not supported")
    parameters = raw.get("rope_parameters")
    if isinstance(parameters, dict) and (
        "full_attention" in parameters or "sliding_attention" in parameters
    ):
        full = dict(parameters.get("full_attention") or {})
        sliding = dict(parameters.get("sliding_attention") or {})
        full.setdefault("rope_theta", _GEMMA3_GLOBAL_THETA)
        sliding.setdefault("rope_theta", _GEMMA3_LOCAL_THETA)
        theta, scaling = rope_settings({"rope_parameters": full})
        sliding_theta, sliding_scaling = rope_settings({"rope_parameters": sliding})
    else:
        theta, scaling = rope_settings(
            {**raw, "rope_theta": raw.get("rope_theta", _GEMMA3_GLOBAL_THETA)}
        )
        sliding_theta = float(raw.get("rope_local_base_freq", _GEMMA3_LOCAL_THETA))
        sliding_scaling = None
    if sliding_scaling is not None:
        raise ValueError(f"sliding-window layers' rope scaling {sliding_scaling} is not supported")
    return theta, scaling, sliding_theta


def _architecture(raw: dict[str, Any]) -> str:
    """The first decoder architecture kvflow supports in `architectures`, checked before any other key is read, so
    an unsupported model fails with the supported list rather than with a key only supported models have (an
    encoder's config is `kvflow.models.encoder_config`'s to read)."""
    architectures = raw.get("architectures")
    if not architectures:
        raise KeyError("architectures")
    names = [architectures] if isinstance(architectures, str) else [str(a) for a in architectures]
    for name in names:
        if name in SUPPORTED_ARCHITECTURES and name not in ENCODER_ARCHITECTURES:
            return name
    raise unsupported_architecture_error(names)


def rope_settings(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, normalised scaling dict or None) from either the old or the transformers-5 keys."""
    parameters = raw.get("rope_parameters")
    if isinstance(parameters, dict) and parameters:
        scaling = dict(parameters)
        theta = scaling.pop("rope_theta", raw.get("rope_theta", _DEFAULT_ROPE_THETA))
    else:
        theta = raw.get("rope_theta", _DEFAULT_ROPE_THETA)
        scaling = dict(raw["rope_scaling"]) if isinstance(raw.get("rope_scaling"), dict) else None
    if scaling is not None:
        rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
        scaling.pop("type", None)
        scaling = (
            None if rope_type == "default" and not scaling else {"rope_type": rope_type, **scaling}
        )
    return float(theta), scaling


def _sliding_window(
    raw: dict[str, Any], rules: ArchitectureRules, num_layers: int
) -> tuple[int | None, tuple[str, ...]]:
    """(window, per-layer attention types), following the architecture's rules in transformers."""
    default_window = _GEMMA3_SLIDING_WINDOW if rules.gemma3 else None
    if rules.qwen_moe_window:
        default_window = _QWEN_MOE_SLIDING_WINDOW
    window = raw.get("sliding_window", default_window)
    if rules.gemma3 and window is None:
        raise ValueError("Gemma 3 needs a sliding_window")
    if (rules.gated_sliding_window or rules.qwen_moe_window) and not raw.get(
        "use_sliding_window", False
    ):
        window = None
    if window is None:
        return None, (FULL_ATTENTION,) * num_layers
    explicit = raw.get("layer_types")
    if explicit:
        layer_types = tuple(str(layer_type) for layer_type in explicit)
    elif rules.gemma2:
        layer_types = tuple(
            SLIDING_ATTENTION if i % 2 == 0 else FULL_ATTENTION for i in range(num_layers)
        )
    elif rules.gemma3:
        pattern = int(raw.get("sliding_window_pattern", _GEMMA3_SLIDING_WINDOW_PATTERN))
        layer_types = tuple(
            SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION for i in range(num_layers)
        )
    elif rules.qwen_moe_window == "alternate":
        below = int(raw.get("max_window_layers", 28))
        layer_types = tuple(
            SLIDING_ATTENTION if i % 2 == 0 and i < below else FULL_ATTENTION
            for i in range(num_layers)
        )
    elif rules.gated_sliding_window:
        first_sliding = int(raw.get("max_window_layers", num_layers))
        layer_types = tuple(
            SLIDING_ATTENTION if i >= first_sliding else FULL_ATTENTION for i in range(num_layers)
        )
    else:
        layer_types = (SLIDING_ATTENTION,) * num_layers
    if SLIDING_ATTENTION not in layer_types:
        return None, layer_types
    return int(window), layer_types
