"""A tiny Qwen3-style checkpoint for reasoning and tool-calling tests: a random `qwen3` model whose tokenizer, like
Qwen3's, holds `<think>`, `</think>`, `<tool_call>` and `</tool_call>` as single added tokens (not special, so
they stay in the detokenized text), and whose chat template is the built-in model's ChatML with tools (hermes
calls) and Qwen3-Thinking-2507's generation prompt, which opens the thought (`<|im_start|>assistant\\n<think>\\n`).
With `chat_template_kwargs={"open_thought": False}` it renders Qwen3's own (hybrid) generation prompt instead,
after which the model opens the thought itself.

`make_qwen3_style_checkpoint(path)` writes it; `QWEN3_STYLE_IDS` are the added tokens' ids, after the built-in
model's 4096 (e.g. `QWEN3_STYLE_IDS["</think>"]` for a `logit_bias` that closes a thought).
"""

from __future__ import annotations

import json
from pathlib import Path

THINK_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>")
_BASE_VOCAB = 4096  # the built-in model's tokenizer
QWEN3_STYLE_IDS = {token: _BASE_VOCAB + index for index, token in enumerate(THINK_TOKENS)}
_GENERATION_PROMPT = "    {{- '<|im_start|>assistant\\n' }}\n"
_OPEN_THOUGHT = (
    "    {%- if open_thought is not defined or open_thought %}{{- '<think>\\n' }}{%- endif %}\n"
)


def thinking_template(template: str) -> str:
    """`template` with a generation prompt that opens a thought, as Qwen3-Thinking-2507's does, unless the
    template variable `open_thought` is false."""
    if _GENERATION_PROMPT not in template:
        raise ValueError("the template has no '<|im_start|>assistant\\n' generation prompt line")
    return template.replace(_GENERATION_PROMPT, _GENERATION_PROMPT + _OPEN_THOUGHT)


def make_qwen3_style_checkpoint(path: str | Path, *, seed: int = 0) -> Path:
    """Write the checkpoint (see the module docstring) to `path`; returns the folder."""
    from tokenizers import AddedToken, Tokenizer

    from kvflow.default_model import CHAT_TEMPLATE, ensure_default_model
    from kvflow.testing.hf_checkpoints import make_tiny_checkpoint

    folder = make_tiny_checkpoint(path, "qwen3", seed=seed, vocab_size=_BASE_VOCAB + 8)
    default_dir = ensure_default_model()
    tokenizer = Tokenizer.from_file(str(default_dir / "tokenizer.json"))
    tokenizer.add_tokens([AddedToken(token, normalized=False) for token in THINK_TOKENS])
    assert all(tokenizer.token_to_id(token) == id_ for token, id_ in QWEN3_STYLE_IDS.items())
    tokenizer.save(str(folder / "tokenizer.json"))
    tokenizer_config = json.loads((default_dir / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = thinking_template(CHAT_TEMPLATE)
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    config_file = folder / "config.json"
    config = json.loads(config_file.read_text())
    special_ids = {
        name: tokenizer.token_to_id(tokenizer_config[name]) for name in ("bos_token", "eos_token")
    }
    config.update(bos_token_id=special_ids["bos_token"], eos_token_id=special_ids["eos_token"])
    config_file.write_text(json.dumps(config, indent=2))
    return folder
