"""`LLM.generate` submits a call's prompts in one message: the engine never steps with only some of them queued,
however slowly the caller prepares them (the race behind step-gated tests that flaked on a busy machine)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from kvflow import LLM, SamplingParams
from kvflow.engine.core import EngineCore
from kvflow.testing.hash_model import reference_tokens


def test_every_prompt_is_queued_before_the_first_step(monkeypatch: pytest.MonkeyPatch) -> None:
    make_requests = LLM._make_requests

    def slow_make_requests(self: LLM, *args: Any, **kwargs: Any) -> Any:
        requests = make_requests(self, *args, **kwargs)
        time.sleep(0.02)  # a caller slower than the engine's steps
        return requests

    monkeypatch.setattr(LLM, "_make_requests", slow_make_requests)
    llm = LLM("hash", max_num_seqs=8, max_model_len=128, num_kv_blocks=96, block_size=4)
    try:
        queued_at_steps: list[int] = []

        def record(core: EngineCore) -> None:
            step = core.step

            def recording_step() -> Any:
                queued_at_steps.append(core.scheduler.get_num_unfinished_requests())
                return step()

            core.step = recording_step  # type: ignore[method-assign]

        llm.run_in_engine(record)
        prompts = [[7 * i + j for j in range(1, 6)] for i in range(6)]
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
            use_tqdm=False,
        )
        assert [list(o.outputs[0].token_ids) for o in outputs] == [
            reference_tokens(p, 8) for p in prompts
        ]
        first = next(count for count in queued_at_steps if count > 0)
        assert first == len(prompts), queued_at_steps[:10]
    finally:
        llm.shutdown()
