"""Train kvflow's built-in default model: a small Llama that writes English, in Hugging Face format.

    python tools/train_default_model.py                         # fetch, train, write kvflow/default_model/checkpoint
    python tools/train_default_model.py --steps 40 --out /tmp/m   # a quick smoke run
    python tools/train_default_model.py --draft                 # the draft model, kvflow/default_model/draft

Deterministic for a given seed and machine: the corpus comes from fixed Debian packages
(`tools/default_model_corpus.py`), the tokenizer is trained on it, the weights start from a seeded generator and see
windows drawn by another, and the schedule is a fixed number of steps (not a time budget). Float32 on CPU with every
core; about an hour on 2 cores.

What it writes (`--out`): `config.json` (LlamaForCausalLM, tied embeddings), `model.safetensors` (bfloat16),
`tokenizer.json` (byte-level BPE with ChatML special tokens), `tokenizer_config.json` (with the chat template),
`generation_config.json` (sampling defaults), `eval.json` (held-out perplexities), `heldout_sample.txt` (the
held-out documents kvflow's perplexity test reads) and `README.md`, the model card.

Perplexity is defined once, in `kvflow.default_model.perplexity_windows`: each held-out document is encoded with its
BOS, cut into windows of `EVAL_WINDOW` tokens (each later window starts with BOS again), and every token after a
window's first is scored given the tokens before it in the window. The script scores the saved bfloat16 weights in
float32 with its own PyTorch model; kvflow's test scores them through the engine (prompt logprobs) and must agree.

`--draft` trains a much smaller model (`DRAFT_SHAPE`, `DRAFT_STEPS`) to draft tokens for speculative decoding of the
built-in model, on the same corpus and the same seeded windows. A draft must share its target's tokenizer, so it is
not trained: the shipped `kvflow/default_model/checkpoint/tokenizer.json` is loaded and written out unchanged. It writes
the same checkpoint files, `eval.json` and its own `README.md`, but no `heldout_sample.txt` (the main model's is the
test's). About 22 minutes on 2 cores.
"""

# ruff: noqa: E501  (the model card template has Markdown table rows, which cannot be wrapped)

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from torch import nn

# Run as a script, Python puts this folder first on sys.path, where a file could shadow an installed
# distribution: the repo root takes its place, and siblings import through the package.
if Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from kvflow import default_model
from kvflow.default_model import (
    BOS_TOKEN,
    END_OF_TEXT_TOKEN,
    EOS_TOKEN,
    SPECIAL_TOKENS,
    perplexity_windows,
    train_tokenizer,
)
from tools.default_model_corpus import (
    HELD_OUT_EVERY,
    PARAGRAPHS_PER_CHUNK,
    Corpus,
    load_corpus,
)

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class ModelShape:
    """The Llama architecture trained here (Hugging Face config names)."""

    vocab_size: int = 4096
    hidden_size: int = 384
    intermediate_size: int = 1024
    num_hidden_layers: int = 6
    num_attention_heads: int = 6
    num_key_value_heads: int = 2
    head_dim: int = 64
    max_position_embeddings: int = 1024
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0


@dataclass(frozen=True)
class TrainConfig:
    seed: int = 0
    steps: int = 750
    batch_size: int = 16
    seq_len: int = 512
    peak_lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 125


# The draft model for speculative decoding of the built-in one: same vocabulary, context and RoPE, a quarter of the
# parameters (2.6 M), a few MB in bfloat16.
DRAFT_SHAPE = ModelShape(
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
)
# Fixed, like the main model's schedule (not a time budget): picked from the measured speed of the first steps,
# 2.0-2.1 s a step on 2 idle cores, so about 22 minutes of training.
DRAFT_STEPS = 625
SHIPPED_CHECKPOINT = REPO / "kvflow/default_model/checkpoint"
DRAFT_OUT = REPO / "kvflow/default_model/draft"


# ------------------------------------------------------------------------------------------------ model
class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def rope_tables(shape: ModelShape, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for positions 0..length-1 in Hugging Face's rotate-half layout: [length, head_dim]."""
    inv_freq = 1.0 / (
        shape.rope_theta ** (torch.arange(0, shape.head_dim, 2).float() / shape.head_dim)
    )
    freqs = torch.outer(torch.arange(length).float(), inv_freq)
    angles = torch.cat([freqs, freqs], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.shape = shape
        q_size = shape.num_attention_heads * shape.head_dim
        kv_size = shape.num_key_value_heads * shape.head_dim
        self.q_proj = nn.Linear(shape.hidden_size, q_size, bias=False)
        self.k_proj = nn.Linear(shape.hidden_size, kv_size, bias=False)
        self.v_proj = nn.Linear(shape.hidden_size, kv_size, bias=False)
        self.o_proj = nn.Linear(q_size, shape.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        heads, kv_heads, head_dim = (
            self.shape.num_attention_heads,
            self.shape.num_key_value_heads,
            self.shape.head_dim,
        )
        q = self.q_proj(x).view(batch, length, heads, head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, length, kv_heads, head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, length, kv_heads, head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, heads * head_dim))


class MLP(nn.Module):
    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(shape.hidden_size, shape.intermediate_size, bias=False)
        self.up_proj = nn.Linear(shape.hidden_size, shape.intermediate_size, bias=False)
        self.down_proj = nn.Linear(shape.intermediate_size, shape.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.self_attn = Attention(shape)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.mlp = MLP(shape)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(shape) for _ in range(shape.num_hidden_layers))
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)


class TinyLlama(nn.Module):
    """Llama with tied input and output embeddings; parameter names are Hugging Face's (`model.` prefix)."""

    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.shape = shape
        self.model = Backbone(shape)
        cos, sin = rope_tables(shape, shape.max_position_embeddings)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits [batch, length, vocab] for token ids [batch, length]."""
        length = ids.shape[1]
        cos, sin = self.cos[:length], self.sin[:length]
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return F.linear(self.model.norm(x), self.model.embed_tokens.weight)


def init_weights(model: TinyLlama, seed: int) -> None:
    """Normal(0, 0.02) for every matrix, output projections scaled by 1/sqrt(2 * layers); norms at one."""
    generator = torch.Generator().manual_seed(seed)
    scaled = 0.02 / math.sqrt(2 * model.shape.num_hidden_layers)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                std = scaled if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
                param.copy_(torch.randn(param.shape, generator=generator) * std)


# ------------------------------------------------------------------------------------------------ data
def encode_stream(tokenizer: Tokenizer, documents: list[str]) -> torch.Tensor:
    """All documents as one token stream: BOS, the document, END_OF_TEXT, next document..."""
    end = tokenizer.token_to_id(END_OF_TEXT_TOKEN)
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(documents):
        ids += encoding.ids  # the post-processor put BOS first
        ids.append(end)
    return torch.tensor(ids, dtype=torch.long)


def batch_at(stream: torch.Tensor, config: TrainConfig, generator: torch.Generator) -> torch.Tensor:
    """`batch_size` windows of `seq_len + 1` tokens starting at seeded random offsets."""
    starts = torch.randint(
        0, len(stream) - config.seq_len - 1, (config.batch_size,), generator=generator
    )
    return torch.stack([stream[start : start + config.seq_len + 1] for start in starts.tolist()])


def learning_rate(step: int, config: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to `min_lr_ratio` of the peak."""
    if step < config.warmup_steps:
        return config.peak_lr * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return config.peak_lr * (config.min_lr_ratio + (1 - config.min_lr_ratio) * cosine)


@torch.no_grad()
def perplexity(model: TinyLlama, windows: list[list[int]]) -> tuple[float, int]:
    """exp(mean NLL) over every scored token of `windows` (each window's first token is context only)."""
    model.eval()
    total, count = 0.0, 0
    for window in windows:
        ids = torch.tensor([window])
        logits = model(ids)[0, :-1].float()
        total += F.cross_entropy(logits, ids[0, 1:], reduction="sum").item()
        count += len(window) - 1
    model.train()
    return math.exp(total / count), count


# ------------------------------------------------------------------------------------------------ train
def train(
    model: TinyLlama,
    stream: torch.Tensor,
    held_out_windows: list[list[int]],
    config: TrainConfig,
    log: list[dict],
) -> None:
    decay = [p for n, p in model.named_parameters() if p.ndim == 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": config.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=config.peak_lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    generator = torch.Generator().manual_seed(config.seed + 1)
    quick_eval = held_out_windows[:16]
    start = time.perf_counter()
    for step in range(config.steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, config)
        batch = batch_at(stream, config, generator)
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
        if step % 25 == 0 or (step + 1) % config.eval_every == 0 or step == config.steps - 1:
            elapsed = time.perf_counter() - start
            tokens_per_s = (step + 1) * config.batch_size * config.seq_len / elapsed
            entry = {"step": step, "loss": round(loss.item(), 4), "elapsed_s": round(elapsed, 1)}
            if (step + 1) % config.eval_every == 0 or step == config.steps - 1:
                entry["held_out_ppl"] = round(perplexity(model, quick_eval)[0], 3)
            log.append(entry)
            print(f"{json.dumps(entry)}  ({tokens_per_s:.0f} tok/s)", flush=True)


# ------------------------------------------------------------------------------------------------ write
def hf_config(shape: ModelShape, tokenizer: Tokenizer) -> dict:
    config = asdict(shape)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **config,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "rope_scaling": None,
        "tie_word_embeddings": True,
        "bos_token_id": tokenizer.token_to_id(BOS_TOKEN),
        "eos_token_id": tokenizer.token_to_id(EOS_TOKEN),
        "pad_token_id": tokenizer.token_to_id(END_OF_TEXT_TOKEN),
        # Stored in bfloat16 (half the bytes), computed in float32 by default: the precision it was trained and
        # evaluated in, and the faster one on CPUs without bfloat16 arithmetic. `dtype="bfloat16"` still works.
        "torch_dtype": "float32",
        "use_cache": True,
    }


def write_checkpoint(out: Path, model: TinyLlama, tokenizer: Tokenizer) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    special_ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
    (out / "tokenizer.json").write_text(tokenizer.to_str(pretty=True) + "\n", encoding="utf-8")
    tokenizer_config = default_model.tokenizer_config(
        special_ids, model.shape.max_position_embeddings
    )
    _write_json(out / "tokenizer_config.json", tokenizer_config)
    _write_json(out / "config.json", hf_config(model.shape, tokenizer))
    _write_json(
        out / "generation_config.json",
        {
            "bos_token_id": special_ids[BOS_TOKEN],
            "eos_token_id": [special_ids[EOS_TOKEN], special_ids[END_OF_TEXT_TOKEN]],
            "do_sample": True,
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": 40,
            "repetition_penalty": 1.1,
        },
    )
    tensors = {
        name: param.detach().to(torch.bfloat16).contiguous()
        for name, param in model.named_parameters()
    }
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def greedy_samples(
    model: TinyLlama, tokenizer: Tokenizer, prompts: list[str], max_tokens: int
) -> list[str]:
    model.eval()
    samples = []
    with torch.no_grad():
        for prompt in prompts:
            ids = tokenizer.encode(prompt).ids
            for _ in range(max_tokens):
                ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
            samples.append(tokenizer.decode(ids[len(tokenizer.encode(prompt).ids) :]))
    return samples


SAMPLE_PROMPTS = (
    "The capital of France is",
    "Once upon a time",
    "She walked into the room and",
    "A computer program is",
)


def model_card(
    out: Path,
    corpus: Corpus,
    shape: ModelShape,
    config: TrainConfig,
    evaluation: dict,
    samples: list[str],
    command: str,
) -> None:
    sources = "\n".join(
        f"| `{source.package}` | {source.version} | `{source.sha256[:16]}…` |"
        for source in corpus.sources
    )
    sizes = "\n".join(
        f"| {name} | {sum(map(len, corpus.train[name])) / 1e6:.2f} M | "
        f"{sum(map(len, corpus.held_out[name])) / 1e3:.1f} k |"
        for name in corpus.train
    )
    sample_text = "\n\n".join(
        f"> **{prompt}**{sample}".replace("\n", " ")
        for prompt, sample in zip(SAMPLE_PROMPTS, samples, strict=True)
    )
    specials = ", ".join(f"`{token}`" for token in SPECIAL_TOKENS)
    tokens_seen = config.steps * config.batch_size * config.seq_len
    note = f" {evaluation['train_note']}" if evaluation.get("train_note") else ""
    text = f"""# kvflow default model

A small Llama-architecture language model trained from scratch by `tools/train_default_model.py` in the kvflow
repository, so that kvflow's built-in default model writes English without downloading anything. It is a toy: it
continues prose in the style of its training text (mostly Jane Austen), knows few facts and follows no instructions.
The chat template (ChatML) is there so that chat endpoints work; the model was not trained on conversations.

## Model
| | |
|---|---|
| architecture | Llama (`LlamaForCausalLM`), tied input and output embeddings |
| parameters | {evaluation["parameters"] / 1e6:.1f} M |
| shape | hidden {shape.hidden_size}, {shape.num_hidden_layers} layers, {shape.num_attention_heads} query heads and {shape.num_key_value_heads} KV heads of {shape.head_dim}, MLP {shape.intermediate_size}, RoPE theta {shape.rope_theta:g} |
| context | {shape.max_position_embeddings} tokens; trained on {config.seq_len}-token windows, so text past position {config.seq_len} is weaker |
| tokenizer | byte-level BPE, {shape.vocab_size} tokens: {shape.vocab_size - len(SPECIAL_TOKENS)} BPE, then {specials}; trained on the training split |
| weights | bfloat16 safetensors; `torch_dtype` float32, so `dtype="auto"` computes in float32, as it was trained and evaluated |

## Data
English text from Debian packages, fetched with `apt-get download` (`tools/default_model_corpus.py` extracts it):

| source | licence |
|---|---|
| Jane Austen's six novels (`r-cran-janeaustenr`) | public domain texts (the R package is MIT) |
| Ambrose Bierce, *The Devil's Dictionary* (`dict-devil`) | public domain |
| The Jargon File 4.4.7 (`jargon-text`) | public domain |
| Python 3.11 tutorial, FAQ and HOWTOs (`python3.11-doc`) | PSF License Agreement; code examples Zero-Clause BSD |

| package | version | .deb SHA-256 |
|---|---|---|
{sources}

| source | training characters | held-out characters |
|---|---|---|
{sizes}

Documents are chunks of {PARAGRAPHS_PER_CHUNK} paragraphs; one chunk in {HELD_OUT_EVERY} of every source is held out.

## Training
| | |
|---|---|
| command | `{command}` |
| seed | {config.seed} |
| steps | {config.steps} of {config.batch_size} x {config.seq_len} tokens: {tokens_seen / 1e6:.1f} M tokens, {evaluation["epochs"]:.1f} passes over {evaluation["train_tokens"] / 1e6:.2f} M training tokens |
| optimizer | AdamW (betas 0.9 / 0.95, weight decay {config.weight_decay} on matrices), gradient clipping {config.grad_clip} |
| learning rate | peak {config.peak_lr}, {config.warmup_steps} warm-up steps, cosine decay to {config.min_lr_ratio:g} of the peak |
| compute | float32 on CPU, {evaluation["machine"]}: {evaluation["train_seconds"] / 60:.0f} minutes of wall time.{note} |

## Evaluation
Held-out perplexity of the saved bfloat16 weights, computed in float32 over windows of {evaluation["window"]} tokens
(`kvflow.default_model.perplexity_windows`):

| split | tokens scored | perplexity |
|---|---|---|
| all held-out text | {evaluation["held_out_tokens"]} | {evaluation["held_out_ppl"]:.3f} |
| `heldout_sample.txt` (kvflow's test) | {evaluation["sample_tokens"]} | {evaluation["sample_ppl"]:.3f} |

## Samples (greedy, 48 tokens)
{sample_text}
"""
    (out / "README.md").write_text(text, encoding="utf-8")


def draft_model_card(
    out: Path,
    corpus: Corpus,
    shape: ModelShape,
    config: TrainConfig,
    evaluation: dict,
    samples: list[str],
    command: str,
) -> None:
    """The draft model's card: what it is for, its shape and training, its perplexity next to the main model's."""
    target = json.loads((SHIPPED_CHECKPOINT / "eval.json").read_text())
    target_shape = ModelShape()
    sources = "\n".join(
        f"| `{source.package}` | {source.version} | `{source.sha256[:16]}…` |"
        for source in corpus.sources
    )
    sample_text = "\n\n".join(
        f"> **{prompt}**{sample}".replace("\n", " ")
        for prompt, sample in zip(SAMPLE_PROMPTS, samples, strict=True)
    )
    tokens_seen = config.steps * config.batch_size * config.seq_len
    note = f" {evaluation['train_note']}" if evaluation.get("train_note") else ""
    text = f"""# kvflow default model: draft

A draft model for speculative decoding of kvflow's built-in default model (`kvflow/default_model/checkpoint`): a much
smaller Llama that proposes the next few tokens cheaply, for the built-in model to verify in one step (kvflow's
`speculative_config={{"method": "draft_model", "model": ...}}`). Trained from scratch by
`tools/train_default_model.py --draft` on the same text and the same seeded training windows as the built-in model,
with the built-in model's tokenizer, unchanged: `tokenizer.json` is the shipped one byte for byte, so the two models
agree on every token id. On its own it is a weaker toy than the built-in model; it is meant to be right often about
the easy tokens.

## Model
| | |
|---|---|
| architecture | Llama (`LlamaForCausalLM`), tied input and output embeddings |
| parameters | {evaluation["parameters"] / 1e6:.2f} M (built-in model: {target["parameters"] / 1e6:.1f} M) |
| shape | hidden {shape.hidden_size}, {shape.num_hidden_layers} layers, {shape.num_attention_heads} query heads and {shape.num_key_value_heads} KV heads of {shape.head_dim}, MLP {shape.intermediate_size}, RoPE theta {shape.rope_theta:g} (built-in model: hidden {target_shape.hidden_size}, {target_shape.num_hidden_layers} layers, {target_shape.num_attention_heads} query heads, MLP {target_shape.intermediate_size}) |
| context | {shape.max_position_embeddings} tokens, as the built-in model; trained on {config.seq_len}-token windows |
| tokenizer | the built-in model's: byte-level BPE, {shape.vocab_size} tokens, same special tokens and chat template |
| weights | bfloat16 safetensors; `torch_dtype` float32, so `dtype="auto"` computes in float32, as it was trained and evaluated |

## Data
The built-in model's: Jane Austen's novels, *The Devil's Dictionary*, the Jargon File and the Python 3.11 tutorial,
FAQ and HOWTOs, from these Debian packages (`tools/default_model_corpus.py`; sources and licences are in the
built-in model's card):

| package | version | .deb SHA-256 |
|---|---|---|
{sources}

## Training
| | |
|---|---|
| command | `{command}` |
| seed | {config.seed} (the same training windows as the built-in model) |
| steps | {config.steps} of {config.batch_size} x {config.seq_len} tokens: {tokens_seen / 1e6:.1f} M tokens, {evaluation["epochs"]:.1f} passes over {evaluation["train_tokens"] / 1e6:.2f} M training tokens |
| optimizer | AdamW (betas 0.9 / 0.95, weight decay {config.weight_decay} on matrices), gradient clipping {config.grad_clip} |
| learning rate | peak {config.peak_lr}, {config.warmup_steps} warm-up steps, cosine decay to {config.min_lr_ratio:g} of the peak |
| compute | float32 on CPU, {evaluation["machine"]}: {evaluation["train_seconds"] / 60:.1f} minutes of wall time, {evaluation["train_seconds"] / config.steps:.2f} s a step.{note} |

## Evaluation
Held-out perplexity of the saved bfloat16 weights, computed in float32 over windows of {evaluation["window"]} tokens
(`kvflow.default_model.perplexity_windows`), on the same held-out text and tokens as the built-in model:

| split | tokens scored | draft perplexity | built-in model perplexity |
|---|---|---|---|
| all held-out text | {evaluation["held_out_tokens"]} | {evaluation["held_out_ppl"]:.3f} | {target["held_out_ppl"]:.3f} |
| `checkpoint/heldout_sample.txt` | {evaluation["sample_tokens"]} | {evaluation["sample_ppl"]:.3f} | {target["sample_ppl"]:.3f} |

## Samples (greedy, 48 tokens)
{sample_text}

## Acceptance
measured by benchmarks/spec_decode.py; see below
"""
    (out / "README.md").write_text(text, encoding="utf-8")


def shipped_tokenizer(shape: ModelShape) -> Tokenizer:
    """The built-in model's tokenizer, for its draft: speculative decoding compares token ids across the two models."""
    tokenizer = Tokenizer.from_file(str(SHIPPED_CHECKPOINT / "tokenizer.json"))
    target_config = json.loads((SHIPPED_CHECKPOINT / "config.json").read_text())
    assert tokenizer.get_vocab_size() == shape.vocab_size == target_config["vocab_size"]
    return tokenizer


def check_same_vocabulary(out: Path) -> None:
    """The draft written to `out` has the shipped model's vocabulary and special token ids."""
    shipped = Tokenizer.from_file(str(SHIPPED_CHECKPOINT / "tokenizer.json"))
    written = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert written.get_vocab(with_added_tokens=True) == shipped.get_vocab(with_added_tokens=True)
    assert (out / "tokenizer.json").read_bytes() == (
        SHIPPED_CHECKPOINT / "tokenizer.json"
    ).read_bytes()
    target_config = json.loads((SHIPPED_CHECKPOINT / "config.json").read_text())
    draft_config = json.loads((out / "config.json").read_text())
    for key in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id"):
        assert draft_config[key] == target_config[key], key


def rewrite_card(
    out: Path,
    corpus: Corpus,
    shape: ModelShape,
    config: TrainConfig,
    command: str,
    draft: bool = False,
) -> None:
    """The model card again, from the checkpoint's eval.json and weights (samples recomputed, same as training's)."""
    from safetensors.torch import load_file

    model = TinyLlama(shape)
    model.load_state_dict(
        {k: v.float() for k, v in load_file(str(out / "model.safetensors")).items()}
    )
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    samples = greedy_samples(model, tokenizer, list(SAMPLE_PROMPTS), 48)
    evaluation = json.loads((out / "eval.json").read_text())
    card = draft_model_card if draft else model_card
    card(out, corpus, shape, config, evaluation, samples, command)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="default kvflow/default_model/checkpoint; with --draft, kvflow/default_model/draft",
    )
    parser.add_argument("--data-dir", type=Path, default=REPO / ".cache/corpus")
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help=f"default {TrainConfig.steps}; with --draft, {DRAFT_STEPS}",
    )
    parser.add_argument("--seed", type=int, default=TrainConfig.seed)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument(
        "--card-only",
        action="store_true",
        help="rewrite --out's README.md from its eval.json and weights (no training)",
    )
    parser.add_argument(
        "--draft",
        action="store_true",
        help="train the draft model for speculative decoding of the built-in one (DRAFT_SHAPE, "
        "the shipped tokenizer)",
    )
    args = parser.parse_args()
    if args.out is None:
        args.out = DRAFT_OUT if args.draft else REPO / "kvflow/default_model/checkpoint"
    default_steps = DRAFT_STEPS if args.draft else TrainConfig.steps
    if args.steps is None:
        args.steps = default_steps
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    config = TrainConfig(seed=args.seed, steps=args.steps)
    shape = DRAFT_SHAPE if args.draft else ModelShape()

    corpus = load_corpus(args.data_dir)
    if args.draft:  # the thread count is recorded: float32 sums on CPU can differ with it
        command = "python tools/train_default_model.py --draft" + (
            f" --steps {args.steps}" if args.steps != default_steps else ""
        )
        command += f" --threads {args.threads}"
    else:
        command = "python tools/train_default_model.py" + (
            f" --steps {args.steps}" if args.steps != TrainConfig.steps else ""
        )
    if args.card_only:
        rewrite_card(args.out, corpus, shape, config, command, draft=args.draft)
        return
    tokenizer = (
        shipped_tokenizer(shape)
        if args.draft
        else train_tokenizer(corpus.train_text(), shape.vocab_size)
    )
    stream = encode_stream(tokenizer, corpus.train_text())
    held_out = corpus.held_out_text()
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    held_out_windows = perplexity_windows([e.ids for e in tokenizer.encode_batch(held_out)], bos_id)
    sample_docs = default_model.heldout_sample(held_out)
    sample_windows = perplexity_windows(
        [e.ids for e in tokenizer.encode_batch(sample_docs)], bos_id
    )
    print(f"training tokens {len(stream)}, held-out windows {len(held_out_windows)}", flush=True)

    model = TinyLlama(shape)
    init_weights(model, args.seed)
    log: list[dict] = []
    start = time.perf_counter()
    train(model, stream, held_out_windows, config, log)
    train_seconds = time.perf_counter() - start

    with torch.no_grad():  # evaluate exactly what is shipped: the bfloat16 weights
        for param in model.parameters():
            param.copy_(param.to(torch.bfloat16).float())
    held_out_ppl, held_out_tokens = perplexity(model, held_out_windows)
    sample_ppl, sample_tokens = perplexity(model, sample_windows)
    samples = greedy_samples(model, tokenizer, list(SAMPLE_PROMPTS), 48)
    evaluation = {
        "parameters": sum(p.numel() for p in model.parameters()),
        "train_tokens": len(stream),
        "epochs": config.steps * config.batch_size * config.seq_len / len(stream),
        "train_seconds": round(train_seconds, 1),
        "machine": f"{os.cpu_count()} CPU cores, torch {torch.__version__}",
        "window": default_model.EVAL_WINDOW,
        "held_out_ppl": held_out_ppl,
        "held_out_tokens": held_out_tokens,
        "sample_ppl": sample_ppl,
        "sample_tokens": sample_tokens,
        "log": log,
    }
    write_checkpoint(args.out, model, tokenizer)
    if args.draft:
        check_same_vocabulary(args.out)
        _write_json(args.out / "eval.json", evaluation)
        draft_model_card(args.out, corpus, shape, config, evaluation, samples, command)
    else:
        (args.out / "heldout_sample.txt").write_text(
            default_model.SAMPLE_SEPARATOR.join(sample_docs), encoding="utf-8"
        )
        _write_json(args.out / "eval.json", evaluation)
        model_card(args.out, corpus, shape, config, evaluation, samples, command)
    print(
        f"held-out perplexity {held_out_ppl:.3f} ({held_out_tokens} tokens); sample {sample_ppl:.3f}"
    )
    for prompt, sample in zip(SAMPLE_PROMPTS, samples, strict=True):
        print(f"{prompt!r} -> {sample!r}")


if __name__ == "__main__":
    main()
