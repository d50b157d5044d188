"""Process layout: stages, replicas and groups of every rank."""

import datetime

import pytest
import torch.distributed as dist

from lightning_gpipe.engine import schedule as schedule_module
from lightning_gpipe.engine.layout import ProcessLayout
from lightning_gpipe.engine.transport import LinkGroups


def test_two_stages_two_replicas() -> None:
    layouts = [ProcessLayout(4, 2, rank) for rank in range(4)]
    assert [(lay.replica, lay.stage) for lay in layouts] == [(0, 1), (0, 0), (1, 1), (1, 0)]
    assert layouts[0].pipeline_ranks() == [1, 0]  # stage 0 on rank 1, the last stage on rank 0
    assert layouts[2].pipeline_ranks() == [3, 2]
    assert layouts[1].replica_ranks() == [1, 3]
    assert layouts[0].replica_ranks() == [0, 2]
    assert layouts[3].last_stage_rank == 2
    assert layouts[0].num_replicas == 2


@pytest.mark.parametrize(("name", "v"), [("gpipe", 1), ("1f1b", 1), ("zero_bubble", 1), ("interleaved", 2), ("zbv", 1)])
def test_reading_a_layout_checks_nothing(monkeypatch: pytest.MonkeyPatch, name: str, v: int) -> None:
    # Every read of stages, num_stages, holds_last_stage or last_stage_rank ran stages_of again, which checked the
    # schedule: about seven times per training step at K=2.
    checked: list[object] = []
    real = schedule_module.validate_schedule
    monkeypatch.setattr(schedule_module, "validate_schedule", lambda value: checked.append(value) or real(value))
    schedule_module.stage_table.cache_clear()
    layout = ProcessLayout(4, 2, 1, name, v)
    assert checked  # made: the schedule is checked there
    checked.clear()
    for _ in range(3):  # as steps read it
        assert layout.num_stages - 1 not in layout.stages
        assert not layout.holds_last_stage
        assert layout.last_stage_rank == layout.stage_ranks()[-1] == 0
        assert layout.position_of(layout.stages[0]) == layout.stage
        assert layout.stages_at(layout.stage) == layout.stages
    assert checked == []


def test_every_rank_has_exactly_one_place() -> None:
    for world, pipe in [(1, 1), (4, 4), (8, 2), (6, 3)]:
        places = {(ProcessLayout(world, pipe, r).replica, ProcessLayout(world, pipe, r).stage) for r in range(world)}
        assert len(places) == world


def test_world_not_divisible_by_pipe_size() -> None:
    with pytest.raises(
        ValueError, match=r"world_size=6 is not divisible by pipe_size=4; use one of its divisors: 1, 2, 3, 6$"
    ):
        ProcessLayout(6, 4, 0)


@pytest.mark.parametrize("pipe_size", [0, -1, True, 2.0])
def test_pipe_size_must_be_a_positive_int(pipe_size: object) -> None:
    with pytest.raises(ValueError, match="must be a positive int"):
        ProcessLayout(4, pipe_size, 0)  # type: ignore[arg-type]


def test_interleaved_ranks_hold_every_kth_stage_the_last_on_the_first_rank() -> None:
    layouts = [ProcessLayout(4, 2, rank, "interleaved", 2) for rank in range(4)]
    assert [lay.stages for lay in layouts] == [(1, 3), (0, 2), (1, 3), (0, 2)]
    assert layouts[1].stage_ranks() == [1, 0, 1, 0]
    assert layouts[3].stage_ranks() == [3, 2, 3, 2]
    assert layouts[0].holds_last_stage
    assert not layouts[1].holds_last_stage
    assert layouts[3].last_stage_rank == 2
    assert layouts[0].num_stages == 4
    assert layouts[1].replica_ranks() == [1, 3]  # the same stages in every replica


def test_zbv_puts_the_first_and_last_stage_on_the_first_rank() -> None:
    layouts = [ProcessLayout(8, 4, rank, "zbv") for rank in range(8)]
    assert [lay.stages for lay in layouts[:4]] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert layouts[5].stage_ranks() == [4, 5, 6, 7, 7, 6, 5, 4]
    assert layouts[4].last_stage_rank == 4
    assert layouts[4].holds_last_stage
    assert layouts[6].replica_ranks() == [2, 6]
    assert [lay.num_stages for lay in layouts] == [8] * 8


def test_one_stage_per_process_is_unchanged_by_the_schedule() -> None:
    for schedule in ("gpipe", "1f1b", "zero_bubble"):
        layouts = [ProcessLayout(4, 2, rank, schedule) for rank in range(4)]
        assert [lay.stages for lay in layouts] == [(1,), (0,), (1,), (0,)]
        assert layouts[2].stage_ranks() == layouts[2].pipeline_ranks() == [3, 2]


def test_virtual_stages_are_checked_with_the_schedule() -> None:
    with pytest.raises(ValueError, match=r"virtual_stages=2 applies to schedule='interleaved' only"):
        ProcessLayout(2, 2, 0, "1f1b", 2)
    with pytest.raises(ValueError, match=r"needs virtual_stages >= 2"):
        ProcessLayout(2, 2, 0, "interleaved", 1)


class _Groups:
    """Records dist.new_group's calls: the ranks of each group, in creation order."""

    def __init__(self) -> None:
        self.created: list[list[int]] = []

    def __call__(self, ranks: list[int], timeout: object = None) -> str:
        self.created.append(list(ranks))
        return f"group{ranks}"


def _both(pair: list[int]) -> LinkGroups:
    """A link's groups as _Groups names them: both directions over the same two ranks."""
    return LinkGroups(f"group{pair}", f"group{pair}")  # type: ignore[arg-type]


@pytest.mark.parametrize(("schedule", "v"), [("interleaved", 2), ("zbv", 1)])
def test_links_join_adjacent_stages_on_two_processes_only(
    monkeypatch: pytest.MonkeyPatch, schedule: str, v: int
) -> None:
    per_rank = []
    for rank in range(4):
        groups = _Groups()
        monkeypatch.setattr(dist, "new_group", groups)
        _, _, links = ProcessLayout(4, 2, rank, schedule, v).new_groups(datetime.timedelta(seconds=1))
        per_rank.append((groups.created, links))
    assert all(created == per_rank[0][0] for created, _ in per_rank)  # every rank, every group, the same order
    # Each link has a group per direction: under NCCL's stream order, one for both deadlocks 1F1B (test_transport).
    if schedule == "interleaved":  # stages 0..3 on ranks 1, 0, 1, 0: three links, each its own groups
        assert per_rank[0][1] == [_both([1, 0]), _both([0, 1]), _both([1, 0])]
    else:  # stages 0..3 on ranks 0, 1, 1, 0: stages 1 and 2 share rank 1, no group between them
        assert per_rank[2][1] == [_both([2, 3]), None, _both([3, 2])]
    across = sum(link is not None for link in per_rank[0][1])
    assert len(per_rank[0][0]) == 2 + 2 + 2 * across * 2  # 2 pipelines, 2 replica groups, both pipelines' links
