"""Pooling models (runner "pooling"): which checkpoints are embedders or classifiers and how they pool
(`kvflow.pooling.model_spec`), and the pooler that turns a sequence's hidden states into its result
(`kvflow.pooling.pooler`)."""
