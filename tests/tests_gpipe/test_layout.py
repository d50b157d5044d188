"""Process layout: stages, replicas and groups of every rank."""

import pytest

from lightning_gpipe.engine.layout import ProcessLayout


def test_two_stages_two_replicas() -> None:
    layouts = [ProcessLayout(4, 2, rank) for rank in range(4)]
    assert [(lay.replica, lay.stage) for lay in layouts] == [(0, 1), (0, 0), (1, 1), (1, 0)]
    assert layouts[0].pipeline_ranks() == [1, 0]  # stage 0 on rank 1, the last stage on rank 0
    assert layouts[2].pipeline_ranks() == [3, 2]
    assert layouts[1].replica_ranks() == [1, 3]
    assert layouts[0].replica_ranks() == [0, 2]
    assert layouts[3].last_stage_rank == 2
    assert layouts[0].num_replicas == 2


def test_every_rank_has_exactly_one_place() -> None:
    for world, pipe in [(1, 1), (4, 4), (8, 2), (6, 3)]:
        places = {(ProcessLayout(world, pipe, r).replica, ProcessLayout(world, pipe, r).stage) for r in range(world)}
        assert len(places) == world


def test_world_not_divisible_by_pipe_size() -> None:
    with pytest.raises(ValueError, match=r"world_size=6 .* not divisible by pipe_size=4.*\(1, 2, 3, 6\)"):
        ProcessLayout(6, 4, 0)


@pytest.mark.parametrize("pipe_size", [0, -1, True, 2.0])
def test_pipe_size_must_be_a_positive_int(pipe_size: object) -> None:
    with pytest.raises(ValueError, match="must be a positive int"):
        ProcessLayout(4, pipe_size, 0)  # type: ignore[arg-type]
