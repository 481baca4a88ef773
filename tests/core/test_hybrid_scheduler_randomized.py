"""The randomized scheduler runs of `test_scheduler_randomized` (plain requests, streaming sessions, aborts, forced
resets, preemption, both runner protocols, sync and async) on a scheduler whose KV cache has a full-attention group
beside sliding-window groups. The simulated worker reads tokens back through the full group's block table, so hash
model outputs check that group; after every step the pool's accounting is checked across all groups: each held
block's reference count is its number of holders, and free plus held blocks are every usable block."""

from __future__ import annotations

import pytest
from sched_helpers import AsyncDriver
from test_scheduler_randomized import Harness

from kvflow.core.hybrid_kv_cache_manager import HybridKVCacheManager
from kvflow.testing.worker_slots import WorkerSlots


class HybridHarness(Harness):
    def __init__(
        self,
        seed: int,
        async_scheduling: bool,
        use_v2_model_runner: bool,
        group_windows: tuple[int | None, ...],
    ) -> None:
        super().__init__(seed, async_scheduling, use_v2_model_runner)
        plain = self.scheduler
        self.scheduler = type(plain)(
            plain.scheduler_config,
            plain.cache_config,
            use_v2_model_runner=use_v2_model_runner,
            kv_cache_group_windows=group_windows,
        )
        slots = WorkerSlots(self.max_num_seqs) if use_v2_model_runner else None
        self.driver = AsyncDriver(self.scheduler, slots)

    def check_scheduler_state(self) -> None:
        super().check_scheduler_state()
        manager = self.scheduler.kv_cache_manager
        assert isinstance(manager, HybridKVCacheManager)
        pool = manager.block_pool
        null_block = manager.null_block
        held: dict[int, int] = {}
        for groups in manager.req_to_group_blocks.values():
            assert len({len(group.blocks) for group in groups}) == 1  # positions aligned
            for group in groups:
                real = [block for block in group.blocks if block is not null_block]
                assert len(real) == len({block.block_id for block in real})
                for block in real:
                    held[block.block_id] = held.get(block.block_id, 0) + 1
        for block_id, num_holders in held.items():
            assert pool.blocks[block_id].ref_cnt == num_holders
        assert pool.get_num_free_blocks() + len(held) == pool.num_usable_blocks


# Full attention first: the simulated worker reads every position back through group 0's table (a sliding group's
# table keeps, on the worker, ids of blocks given back: only a window-masking model may read it).
@pytest.mark.parametrize("group_windows", [(None, 6), (None, 5, 5), (None, None, 9)])
@pytest.mark.parametrize("use_v2_model_runner", [True, False])
@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_randomized_mixed_traffic_with_kv_cache_groups(
    seed, async_scheduling, use_v2_model_runner, group_windows
):
    harness = HybridHarness(seed, async_scheduling, use_v2_model_runner, group_windows)
    harness.run(150)
    assert harness.num_chunks_checked > 10
