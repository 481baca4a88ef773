"""benchmarks/quantized.py's pure parts: arguments, the synthetic tokenizer, byte counts, llama.cpp's output
parsing and the table. Nothing here needs llama.cpp, a checkpoint or kvflow's GGUF loading (the script itself is
run by hand: it takes half an hour). Imported as `benchmarks.<name>`."""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="module")
def quantized() -> Any:
    return importlib.import_module("benchmarks.quantized")


def test_arguments_pick_the_quick_or_full_sizes_and_parse_formats(quantized: Any) -> None:
    full = quantized.Settings.for_args(quantized._parse_args([]))
    assert full.shape == quantized.LLAMA_32_1B_SHAPE
    assert (full.output_len, full.prefill_len, full.num_requests, full.repeat) == (128, 512, 64, 3)
    args = quantized._parse_args(
        ["--quick", "--formats", "q4_k_m,INT8,Q4_K_M", "--repeat", "4", "--skip-llama-cpp"]
    )
    quick = quantized.Settings.for_args(args)
    assert quick.shape == quantized.QUICK_SHAPE and quick.repeat == 4
    assert args.formats == ("Q4_K_M", "int8") and args.skip_llama_cpp
    assert args.server_parallel == [16, 64] and args.batched_format == ("Q4_K_M",)
    with pytest.raises(argparse.ArgumentTypeError, match="unknown format"):
        quantized.parse_formats("Q5_K")
    with pytest.raises(SystemExit):
        quantized._parse_args(["--batched-format", "int8"])


def test_every_matrix_of_both_shapes_is_a_multiple_of_256_wide(quantized: Any) -> None:
    for shape in (quantized.LLAMA_32_1B_SHAPE, quantized.QUICK_SHAPE):
        widths = (
            shape["hidden_size"],
            shape["intermediate_size"],
            shape["num_attention_heads"] * shape["head_dim"],
        )
        assert all(width % 256 == 0 for width in widths)
        assert quantized.shape_key(shape).startswith(f"llama-h{shape['hidden_size']}-")
    assert quantized.llama_cpp_format("int8") == "Q8_0"
    assert quantized.llama_cpp_format("Q4_K_M") == "Q4_K_M"


def test_the_synthetic_tokenizer_has_exactly_the_vocabulary_and_round_trips(
    quantized: Any, tmp_path: Path
) -> None:
    import tokenizers

    data = quantized.synthetic_tokenizer(1024, num_special=8)
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    tokenizer = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert tokenizer.get_vocab_size() == 1024
    assert tokenizer.id_to_token(1016) == "<|begin_of_text|>"
    text = "Hello, world: every byte \u00e9 decodes"
    assert tokenizer.decode(tokenizer.encode(text).ids) == text
    every_id = tokenizer.decode(list(range(1024)), skip_special_tokens=False)
    assert "<|reserved_special_token_5|>" in every_id
    # Past the pairs of bytes the merges go on with pair + byte.
    assert len(quantized.synthetic_tokenizer(256 + 65536 + 10, 2)["model"]["merges"]) == 65536 + 8


def test_byte_counts(quantized: Any) -> None:
    tied = {"token_embd.weight": 100, "blk.0.attn_q.weight": 10, "output_norm.weight": 1}
    assert quantized.decode_bytes_per_token(tied) == 111
    assert quantized.decode_bytes_per_token({**tied, "output.weight": 100}) == 111
    shape = dict(quantized.QUICK_SHAPE)
    hidden, layers = shape["hidden_size"], shape["num_hidden_layers"]
    weights = layers * (
        (4 + 2 * 2) * 64 * hidden + hidden * 4 * 64 + 2 * 512 * hidden + hidden * 512
    ) + (shape["vocab_size"] * hidden)
    rows = layers * ((4 + 2 * 2) * 64 + hidden + 2 * 512 + hidden) + shape["vocab_size"]
    norms = (2 * layers + 1) * hidden * 4
    assert quantized.int8_bytes_per_token(shape) == weights + 4 * rows + norms


def test_llama_bench_json_gives_decode_and_prefill(quantized: Any) -> None:
    command = quantized.llama_bench_command(Path("llama-bench"), Path("m.gguf"), 2, 128, 512, 3)
    assert command[command.index("-p") + 1] == "512" and command[command.index("-n") + 1] == "128"
    assert command[command.index("-t") + 1] == "2" and command[command.index("-r") + 1] == "3"
    stdout = json.dumps(
        [
            {"n_prompt": 512, "n_gen": 0, "avg_ts": 80.5},
            {"n_prompt": 0, "n_gen": 128, "avg_ts": 12.25},
        ]
    )
    result = quantized.parse_llama_bench(stdout, "cmd")
    assert (result.decode_tokens_per_s, result.prefill_tokens_per_s) == (12.25, 80.5)


def test_request_bodies_and_the_finite_check(quantized: Any) -> None:
    body = quantized.llama_completion_payload([1, 2, 3], 7)
    assert body["prompt"] == [1, 2, 3] and body["n_predict"] == 7 and body["ignore_eos"]
    assert quantized.kvflow_completion_payload("m", [4], 5)["max_tokens"] == 5
    assert quantized.llama_output_tokens({"tokens_predicted": 9}) == 9
    assert quantized.kvflow_output_tokens({"usage": {"completion_tokens": 9}}) == 9
    finite = {"completion_probabilities": [{"logprob": -0.5, "top_logprobs": [{"logprob": -1.0}]}]}
    assert quantized.finite_top_logprobs(finite)
    assert not quantized.finite_top_logprobs(
        {"completion_probabilities": [{"logprob": float("nan")}]}
    )
    assert not quantized.finite_top_logprobs({})
    serve = quantized.kvflow_serve_command(
        {"model": "m.gguf", "tokenizer": "folder"}, 8000, 512, 64
    )
    assert serve[3:6] == ["serve", "m.gguf", "--tokenizer"] and serve[-2:] == [
        "--max-num-seqs",
        "64",
    ]


def test_the_table_puts_kvflow_beside_llama_cpp(quantized: Any) -> None:
    kvflow = quantized.KvflowResult([100.0, 100.0], [2.0], 2_000_000_000, "uint8", [125.0, 125.0])
    llama = quantized.LlamaBenchResult(20.0, 400.0, "llama-bench ...")
    reports = [
        quantized.FormatReport(
            "Q4_K_M", "Q4_K_M", 1_000_000_000, 1_000_000_000, kvflow, None, llama
        ),
        quantized.FormatReport("int8", "Q8_0", 2_000_000_000, 1_300_000_000, None, "boom", llama),
    ]
    batched = [
        quantized.BatchedResult("kvflow serve", 10.0, 1000),
        quantized.BatchedResult("llama-server -np 16", 10.0, 500),
        quantized.BatchedResult("llama-server -np 64", 5.0, 1000),
    ]
    table = quantized.markdown_table(reports, 40e9, 512, 128, batched, "Q4_K_M")
    lines = table.splitlines()
    assert lines[0].startswith("| figure | format | kvflow | llama.cpp |")
    assert "| decode tg128 tok/s | Q4_K_M | 10.00 | 20.00 | 0.50 | 40.00 | 0.25 | 0.50 |" in lines
    assert "| prefill pp512 tok/s | Q4_K_M | 256.0 | 400.0 | 0.64 | | | |" in lines
    # the same-run A/B of the fused decode layer: 100 ms per token fused vs 125 per op
    assert (
        "| decode tg128 tok/s, fused layers vs per-op | Q4_K_M | 10.00 | 8.00 (kvflow per-op) | 1.25 | | | |"
        in lines
    )
    assert not any("fused layers vs per-op | int8" in line for line in lines)  # no kvflow figures
    assert any(
        line.startswith("| decode tg128 tok/s | int8 vs Q8_0 | - | 20.00 |") for line in lines
    )
    assert any(
        "kvflow serve vs llama-server -np 64" in line and "| 0.50 |" in line for line in lines
    )


def test_alternated_rounds_report_the_median_of_each_rounds_ratio(quantized: Any) -> None:
    """`--alternate N`: each round's kvflow figure is divided by the llama.cpp figure taken right after it; the row
    gives both sides' medians and the median of those per-round ratios (not the ratio of the medians)."""
    args = quantized._parse_args(["--quick", "--alternate", "3", "--formats", "Q4_K_M"])
    assert args.alternate == 3
    rounds = [(30.0, 40.0), (36.0, 36.0), (33.0, 30.0)]  # ratios 0.75, 1.00, 1.10
    kvflow = quantized.KvflowResult([100.0], [2.0], 1, "float32", [], rounds)
    assert kvflow.alternated_ratios == [0.75, 1.0, 1.1]
    report = quantized.FormatReport("Q4_K_M", "Q4_K_M", 10**9, 10**9, kvflow, None, None)
    lines = quantized.markdown_table([report], 40e9, 512, 128, [], "Q4_K_M").splitlines()
    row = next(line for line in lines if "alternated rounds" in line)
    # medians 33.00 and 36.00 would give 0.92; the rounds' ratios give 1.00
    assert row.endswith("| Q4_K_M | 33.00 | 36.00 | 1.00 | | | |")
    assert "3 alternated rounds" in row and "0.75-1.10" in row
    plain = quantized.KvflowResult([100.0], [2.0], 1, "float32")
    report.kvflow = plain
    lines = quantized.markdown_table([report], 40e9, 512, 128, [], "Q4_K_M").splitlines()
    assert not any("alternated rounds" in line for line in lines)
