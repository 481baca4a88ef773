"""Held-out perplexity of the default model, defined once for the training script and kvflow's own test."""

from __future__ import annotations

EVAL_WINDOW = 256  # tokens per perplexity window, its BOS included
SAMPLE_DOCUMENTS = 6  # held-out documents in the shipped sample (`heldout_sample.txt`)
SAMPLE_SEPARATOR = "\n\n<|document|>\n\n"


def heldout_sample(documents: list[str]) -> list[str]:
    """The held-out documents kvflow's perplexity test scores: every k-th, `SAMPLE_DOCUMENTS` of them."""
    step = max(1, len(documents) // SAMPLE_DOCUMENTS)
    return documents[::step][:SAMPLE_DOCUMENTS]


def perplexity_windows(encoded_documents: list[list[int]], bos_id: int) -> list[list[int]]:
    """Cut each document's token ids (BOS first) into windows of at most `EVAL_WINDOW` tokens; every window after
    a document's first starts with BOS again. Perplexity is exp(mean NLL) of every token after a window's first,
    given the tokens before it in its window: the training script and kvflow's engine compute the same thing."""
    windows = []
    for ids in encoded_documents:
        body = ids[1:] if ids[:1] == [bos_id] else ids
        for start in range(0, len(body), EVAL_WINDOW - 1):
            windows.append([bos_id, *body[start : start + EVAL_WINDOW - 1]])
    return [window for window in windows if len(window) > 1]
