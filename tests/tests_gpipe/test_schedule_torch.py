"""Our generated schedules against the orders torch.distributed.pipelining builds for the same K, M and v.

torch builds each rank's order in ``_calculate_single_rank_operations`` (private, read on a stand-in for the schedule
object, since a real one needs stages and a process group); ``None`` entries are its idle slots. ZB-H1 is torch's
``ScheduleInterleavedZeroBubble`` with one stage per rank.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from torch.distributed.pipelining import schedules

from lightning_gpipe.engine.schedule import process_actions

TORCH = {
    "interleaved": schedules.ScheduleInterleaved1F1B,
    "zero_bubble": schedules.ScheduleInterleavedZeroBubble,
    "zbv": schedules.ScheduleZBVZeroBubble,
}
pytestmark = pytest.mark.skipif(
    not all(hasattr(cls, "_calculate_single_rank_operations") for cls in TORCH.values()),
    reason="this torch builds its schedules' orders differently",
)


def torch_orders(schedule: str, K: int, M: int, v: int) -> list[list[str]]:
    rounds = max(1, M // K)
    state = SimpleNamespace(
        n_local_stages=v, microbatches_per_round=M // rounds, pp_group_size=K, _n_microbatches=M, num_stages=K * v
    )
    build = TORCH[schedule]._calculate_single_rank_operations
    return [[str(action) for action in build(state, r) if action is not None] for r in range(K)]


def our_orders(schedule: str, K: int, M: int, v: int) -> list[list[str]]:
    # torch prints stage, computation, micro-batch: "2F0", "1I3"; a full backward is "B".
    return [
        [
            f"{a.stage}{str(a)[0]}{a.microbatch}"
            for a in process_actions(schedule, r, K, M, v if v > 1 and schedule == "interleaved" else 1)
        ]
        for r in range(K)
    ]


@pytest.mark.parametrize(("schedule", "v"), [("interleaved", 2), ("interleaved", 3), ("zero_bubble", 1), ("zbv", 2)])
@pytest.mark.parametrize("K", range(1, 9))
def test_our_orders_are_torchs(schedule: str, v: int, K: int) -> None:
    for M in range(1, 25):
        if schedule != "zbv" and M % max(1, M // K):
            continue  # torch refuses these chunks too
        assert our_orders(schedule, K, M, v) == torch_orders(schedule, K, M, v), f"K={K}, M={M}"
