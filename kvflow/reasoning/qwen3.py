"""Qwen3's reasoning format: `<think>\\n...\\n</think>\\n\\ncontent`, the thought opened by the model itself (Qwen3)
or by the chat template (Qwen3-Thinking-2507 ends its prompt with `<think>\\n`)."""

from __future__ import annotations

from kvflow.reasoning.base import ReasoningParser


class Qwen3ReasoningParser(ReasoningParser):
    """The output starts in reasoning only if the prompt leaves a `<think>` open (its last `<think>` comes after
    its last `</think>`); otherwise it reasons only if it opens with `<think>` itself. Qwen3's
    `enable_thinking=False` prompt closes an empty thought (`<think>\\n\\n</think>\\n\\n`): the output is content."""

    name = "qwen3"

    def starts_in_reasoning(self, prompt_text: str) -> bool:
        return self.last_prompt_marker(prompt_text) == self.start_marker
