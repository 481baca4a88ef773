"""KV cache bytes per token at a long context, before and after sliding-window layers hold only their window.

For a model shape (its Hugging Face config: layer count, KV heads, head size, sliding window and which layers slide),
builds the engine's KV cache layout (`KVCacheLayout`, from the layer windows kvflow's config parser gives) and its KV
cache manager, then runs one request of `--context` tokens through the real manager the way the scheduler does
(chunked prefill, then decode steps) and counts the blocks it holds at the end. "Before" is one group of every layer
(kvflow's layout until KV cache groups: each block spans all layers); "after" is the layout the engine now builds.
No model forward runs, so no weights are needed.

    .venv/bin/python benchmarks/kv_memory.py [--context 8192] [--block-size 16] [--chunk 2048]
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from kvflow.core.hybrid_kv_cache_manager import make_kv_cache_manager
from kvflow.core.kv_cache_utils import KVCacheLayout, RequestBlockHasher
from kvflow.models.hf_config import parse_hf_config
from kvflow.request import Request
from kvflow.sampling_params import SamplingParams
from kvflow.utils import cdiv

BF16_BYTES = 2

# Shapes from the Hugging Face model cards' config.json (google/gemma-2-2b, google/gemma-3-1b-pt).
GEMMA2_2B: dict[str, Any] = {
    "architectures": ["Gemma2ForCausalLM"],
    "vocab_size": 256000,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "max_position_embeddings": 8192,
    "sliding_window": 4096,
    "query_pre_attn_scalar": 256,
    "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
}
GEMMA3_1B: dict[str, Any] = {
    "architectures": ["Gemma3ForCausalLM"],
    "vocab_size": 262144,
    "hidden_size": 1152,
    "intermediate_size": 6912,
    "num_hidden_layers": 26,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "max_position_embeddings": 32768,
    "sliding_window": 512,
    "sliding_window_pattern": 6,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "rope_local_base_freq": 10000.0,
}


@dataclass
class Measurement:
    layout: KVCacheLayout
    bytes_per_block: int
    num_blocks_held: int
    context: int

    @property
    def num_bytes(self) -> int:
        return self.bytes_per_block * self.num_blocks_held

    @property
    def bytes_per_token(self) -> float:
        return self.num_bytes / self.context


def measure(
    raw_config: dict[str, Any],
    layer_windows: list[int | None],
    *,
    context: int,
    block_size: int,
    chunk: int,
) -> Measurement:
    """Blocks one `context`-token request holds at its end under the layout of `layer_windows`."""
    config = parse_hf_config(raw_config)
    layout = KVCacheLayout(layer_windows)
    bytes_per_block = (
        layout.num_pages
        * 2
        * block_size
        * config.num_key_value_heads
        * config.head_dim
        * BF16_BYTES
    )
    num_blocks = 4 * cdiv(context, block_size) * layout.num_groups + 1
    manager = make_kv_cache_manager(
        num_blocks, block_size, group_windows=layout.group_windows, max_model_len=context
    )
    prompt_len = context - 64  # then 64 decode steps
    request = Request(
        "long",
        [(index * 7919) % 30000 + 3 for index in range(prompt_len)],
        SamplingParams(max_tokens=64),
        block_hasher=RequestBlockHasher(block_size),
    )
    while request.num_computed_tokens < request.num_tokens:
        num_new = min(chunk, request.num_tokens - request.num_computed_tokens)
        assert manager.allocate_slots(request, num_new) is not None
        request.num_computed_tokens += num_new
    while request.num_tokens < context:
        request.append_output_token_ids([5])
        assert manager.allocate_slots(request, 1) is not None
        request.num_computed_tokens += 1
    pool = manager.block_pool
    num_held = pool.num_usable_blocks - pool.get_num_free_blocks()
    return Measurement(layout, bytes_per_block, num_held, context)


def report(name: str, raw_config: dict[str, Any], args: argparse.Namespace) -> None:
    config = parse_hf_config(raw_config)
    windows = [config.layer_sliding_window(i) for i in range(config.num_hidden_layers)]
    options = {"context": args.context, "block_size": args.block_size, "chunk": args.chunk}
    before = measure(raw_config, [None] * len(windows), **options)
    after = measure(raw_config, windows, **options)
    num_sliding = sum(window is not None for window in windows)
    print(
        f"{name}: {len(windows)} layers ({num_sliding} sliding, window {config.sliding_window}), "
        f"{config.num_key_value_heads} KV heads x {config.head_dim}, bf16, block {args.block_size}, "
        f"{args.context}-token request"
    )
    print(
        f"  before: 1 group, {before.layout.num_pages} layers per block, {before.num_blocks_held} blocks "
        f"-> {before.num_bytes / 2**20:.1f} MiB, {before.bytes_per_token / 1024:.1f} KiB/token"
    )
    print(
        f"  after:  {after.layout.num_groups} groups {after.layout.group_windows}, {after.layout.num_pages} "
        f"layers per block, {after.num_blocks_held} blocks -> {after.num_bytes / 2**20:.1f} MiB, "
        f"{after.bytes_per_token / 1024:.1f} KiB/token ({before.num_bytes / after.num_bytes:.2f}x less)"
    )
    budget = 4 * 2**30
    print(
        f"  a 4 GiB KV cache holds {budget / before.num_bytes:.1f} such requests before, "
        f"{budget / after.num_bytes:.1f} after"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--chunk", type=int, default=2048, help="prefill chunk (max_num_batched_tokens)"
    )
    args = parser.parse_args()
    report("Gemma-2-2B", GEMMA2_2B, args)
    report("Gemma-3-1B", GEMMA3_1B, args)


if __name__ == "__main__":
    main()
