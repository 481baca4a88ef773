"""Checking streamed `RequestOutput`s in a way that does not depend on timing.

`AsyncLLM.generate` coalesces: a consumer that falls behind gets one output for everything that arrived meanwhile
(deltas concatenated, cumulative outputs replaced; `kvflow.engine.output_stream`). How many outputs a stream has
therefore depends on how busy the machine is; what the outputs add up to does not. Tests compare `fold_outputs`
of streams and check `check_stream_shape`, never the number of outputs.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from kvflow.engine.output_stream import merge_outputs
from kvflow.outputs import RequestOutput


def fold_outputs(outputs: Sequence[RequestOutput], output_kind: str) -> RequestOutput:
    """The one output a consumer that took nothing until the stream ended would have seen: every "delta" output
    concatenated per completion index, or the last cumulative / final output."""
    assert outputs, "a stream has at least one output"
    folded = outputs[0]
    for output in outputs[1:]:
        folded = merge_outputs(folded, output, output_kind == "delta")
    return folded


def check_stream_shape(outputs: Sequence[RequestOutput], output_kind: str) -> None:
    """What holds however the outputs were coalesced: only the last is finished; each cumulative output extends
    the previous one (per completion); each delta carries something (a token, text or a finish reason); a
    "final_only" stream is its one finished output."""
    assert outputs, "a stream has at least one output"
    assert [output.finished for output in outputs] == [False] * (len(outputs) - 1) + [True]
    if output_kind == "final_only":
        assert len(outputs) == 1
    for previous, output in itertools.pairwise(outputs):
        if output_kind == "cumulative":
            before = {completion.index: completion for completion in previous.outputs}
            for completion in output.outputs:
                earlier = before.get(completion.index)
                if earlier is not None:
                    tokens = list(completion.token_ids)
                    assert tokens[: len(earlier.token_ids)] == list(earlier.token_ids)
                    assert completion.text.startswith(earlier.text)
    if output_kind == "delta":
        for output in outputs:
            assert all(
                completion.token_ids or completion.text or completion.finish_reason
                for completion in output.outputs
            ), f"an empty delta output: {output}"
