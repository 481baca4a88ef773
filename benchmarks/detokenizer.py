"""Incremental detokenization cost per token as the output grows (the serving hot path's per-token text work).

    python benchmarks/detokenizer.py

The built-in default model's tokenizer decodes a long English text (the README, repeated) one token at a time, with
one delta read per token as a stream does, with and without stop strings armed. Each figure is microseconds per
token over outputs of 128 ... 32,768 tokens; the baseline beside it is the same run's 128-token figure: a ratio
near 1 at every length means the per-token cost does not grow with the output.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from kvflow import SamplingParams
from kvflow.default_model import __file__ as default_model_file
from kvflow.engine.detokenizer import IncrementalDetokenizer
from kvflow.tokenizer import load_tokenizer

LENGTHS = (128, 1024, 8192, 32768)
STOP = ["<never seen>", "the end."]


def us_per_token(tokenizer, token_ids: list[int], stop: list[str] | None, repeats: int) -> float:  # type: ignore[no-untyped-def]
    best = float("inf")
    for _ in range(repeats):
        detokenizer = IncrementalDetokenizer(
            tokenizer, token_ids[:5], SamplingParams(stop=stop, max_tokens=1)
        )
        start = time.perf_counter()
        for token_id in token_ids[5:]:
            detokenizer.update([token_id], False)
            detokenizer.get_next_output_text(False, True)
        best = min(best, time.perf_counter() - start)
    return 1e6 * best / (len(token_ids) - 5)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3, help="best of this many runs per figure")
    args = parser.parse_args(argv)
    tokenizer = load_tokenizer(Path(default_model_file).parent / "checkpoint")
    readme = Path(__file__).resolve().parents[1] / "README.md"
    text = readme.read_text().replace("the end.", "")
    ids = tokenizer.encode(text * (1 + 40 * max(LENGTHS) // max(len(text), 1)))
    assert len(ids) > max(LENGTHS) + 5, "the sample text is too short"
    print(f"{'output tokens':>14}{'us/token':>10}{'x 128':>8}{'with stop strings':>19}{'x 128':>8}")
    base: dict[bool, float] = {}
    for length in LENGTHS:
        row = []
        for armed in (False, True):
            figure = us_per_token(
                tokenizer, ids[: length + 5], STOP if armed else None, args.repeats
            )
            base.setdefault(armed, figure)
            row += [figure, figure / base[armed]]
        print(f"{length:>14}{row[0]:>10.2f}{row[1]:>8.2f}{row[2]:>19.2f}{row[3]:>8.2f}")


if __name__ == "__main__":
    main()
