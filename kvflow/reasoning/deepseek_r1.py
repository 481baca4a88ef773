"""DeepSeek-R1's reasoning format: the chat template opens the thought (its assistant tag, then `<think>\\n`; older
templates leave even that to the model), so the output is reasoning until `</think>`."""

from __future__ import annotations

from kvflow.reasoning.base import ReasoningParser


class DeepSeekR1ReasoningParser(ReasoningParser):
    """The output starts in reasoning unless the prompt itself closed the thought (its last marker is a
    `</think>`, as a thinking-disabled template renders); a leading `<think>` in the output is dropped."""

    name = "deepseek_r1"

    def starts_in_reasoning(self, prompt_text: str) -> bool:
        return self.last_prompt_marker(prompt_text) != self.end_marker
