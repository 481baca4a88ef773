"""`LLM.generate` submits a call's prompts in one message: the engine never steps with only some of them queued,
however slowly the caller prepares them (the race behind step-gated tests that flaked on a busy machine: with one
`add_requests` per prompt the loop could step between them)."""

from __future__ import annotations

from typing import Any

from kvflow import LLM, SamplingParams
from kvflow.engine.core import EngineCore
from kvflow.testing.hash_model import reference_tokens


def test_every_prompt_is_queued_before_the_first_step() -> None:
    """One submission carries all six prompts (no `add_requests` per prompt, between which the loop could step),
    and the first step that has work sees all of them."""
    llm = LLM("hash", max_num_seqs=8, max_model_len=128, num_kv_blocks=96, block_size=4)
    try:
        client = llm.engine_core_client
        submissions: list[str] = []
        for method in ("add_requests", "add_request_groups"):
            original = getattr(client, method)

            def spy(*args: Any, _name: str = method, _original: Any = original) -> Any:
                submissions.append(_name)
                return _original(*args)

            setattr(client, method, spy)
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
        assert submissions == ["add_request_groups"]
        first = next(count for count in queued_at_steps if count > 0)
        assert first == len(prompts), queued_at_steps[:10]
    finally:
        llm.shutdown()
