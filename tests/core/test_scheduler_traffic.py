"""Steady decoding traffic: per-step messages do not grow with request history."""

from __future__ import annotations

import msgspec
import pytest
from sched_helpers import step

from kvflow.testing import make_request, make_scheduler

NUM_REQUESTS = 8


def decode_message_sizes(
    history_len: int, use_v2_model_runner: bool, num_steps: int = 5
) -> list[int]:
    scheduler = make_scheduler(
        max_model_len=4096,
        max_num_batched_tokens=32768,
        num_blocks=4096,
        use_v2_model_runner=use_v2_model_runner,
    )
    for i in range(NUM_REQUESTS):
        scheduler.add_request(make_request(str(i), [i + 1] * history_len, max_tokens=50))
    step(scheduler)  # prefill
    sizes = []
    for _ in range(num_steps):
        output, _ = step(scheduler)
        assert output.num_scheduled_tokens == dict.fromkeys(map(str, range(NUM_REQUESTS)), 1)
        sizes.append(len(msgspec.msgpack.encode(output)))
    return sizes


@pytest.mark.parametrize("use_v2_model_runner", [True, False])
def test_decode_message_size_does_not_grow_with_history(use_v2_model_runner):
    # Histories chosen so that no decode step in the window crosses a block boundary (block_size 16).
    short = decode_message_sizes(100, use_v2_model_runner)
    long = decode_message_sizes(1990, use_v2_model_runner)
    assert len(set(short)) == 1 and len(set(long)) == 1
    # Only the integer encodings of the counters may differ (a few bytes per request).
    assert abs(long[0] - short[0]) <= 4 * NUM_REQUESTS
