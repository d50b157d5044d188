"""Process layout: which global rank runs which stage of which pipeline replica.

``pipe_size`` (K) consecutive ranks form one pipeline; ``world_size / K`` pipelines are data-parallel replicas. Within a
pipeline the stages run in reverse rank order: the last stage, which computes the loss and the metrics, sits on the
pipeline's lowest rank. Global rank 0, where Lightning draws the progress bar, writes logs and saves checkpoints,
therefore holds the real loss and torchmetrics state instead of mirrored copies.

Example, 4 ranks with K = 2::

    rank      0  1  2  3
    replica   0  0  1  1
    stage     1  0  1  0

With several stages per process (``schedule="interleaved"`` or ``"zbv"``,
:func:`~lightning_gpipe.engine.schedule.stages_of`) a pipeline of K processes holds ``K·v`` stages: the process at
position ``r`` of its pipeline holds ``stages_of(schedule, r, K, v)``, and the one holding the last stage sits on the
pipeline's lowest rank, as above. Interleaved with v = 2, and ZB-V, whose V puts the first and the last stage on one
process, for K = 2::

    interleaved  rank      0     1          zbv  rank      0     1
                 position  1     0               position  0     1
                 stages    1, 3  0, 2            stages    0, 3  1, 2

Besides the pipeline and data-parallel groups, every link between adjacent stages (s, s+1) of every pipeline that sit
on two processes gets two 2-rank groups of its own (:class:`~lightning_gpipe.engine.transport.LinkGroups`), which
carry only that link's point-to-point messages, one direction each: ``down`` from s to s+1 (activations), ``up`` from
s+1 to s (gradients). NCCL runs all operations of one group in issue order on one stream, and a large send completes
only once its receive has started. On a group shared with collectives, a collective issued after a posted receive
would wait for that receive (a deadlock when the peer sends only after the same collective); on one group per
process pair, a middle stage's sends would queue behind the receives it posted from the previous stage; and on one
group per link, under 1F1B stage s's send of activation 1 would wait for the receive of it, queued on s+1 behind the
send of gradient 0, which waits for s's receive of it, queued behind the send of activation 1.

The same groups make the job's two-dimensional ``DeviceMesh`` (:meth:`ProcessLayout.device_mesh`), dimensions
``("pipe", "data")``: along ``"pipe"`` the processes of one pipeline, along ``"data"`` the replicas of one process,
whose slice ``mesh["data"]`` ``data_parallel="fsdp"`` shards a stage over. With 4 ranks and K = 2, ``mesh[p, r]`` is
the rank at offset ``p`` of pipeline ``r``::

    mesh      data 0  data 1
    pipe 0      0       2
    pipe 1      1       3
"""

from __future__ import annotations

import datetime
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from lightning_gpipe.engine.schedule import stage_table, stages_per_process
from lightning_gpipe.engine.transport import LinkGroups

__all__ = ["ProcessLayout", "StageGroups", "new_link_groups", "new_stage_groups"]


def new_link_groups(stage_ranks: Sequence[int], timeout: datetime.timedelta | None = None) -> list[LinkGroups | None]:
    """The groups of each link of a pipeline whose stage ``s`` runs on ``stage_ranks[s]``, in stage order.

    Entry ``s`` holds the two groups (one per direction) between stages ``s`` and ``s + 1``, or is ``None`` where one
    process holds both (its messages stay in the process). Each group waits ``timeout`` for its peer (``None``: the
    backend's default). Every rank of the world must call this, in the same order, because ``new_group`` is
    collective over the world; a rank outside a link gets torch's placeholders for its groups.
    """
    links: list[LinkGroups | None] = []
    for first, second in itertools.pairwise(stage_ranks):
        if first == second:
            links.append(None)
            continue
        down = dist.new_group([first, second], timeout=timeout)  # then up: every rank creates them in this order
        links.append(LinkGroups(down, dist.new_group([first, second], timeout=timeout)))
    return links


@dataclass(frozen=True)
class ProcessLayout:
    """The place of ``rank`` in a job of ``world_size`` processes cut into pipelines of ``pipe_size`` processes.

    ``schedule`` and ``virtual_stages`` say how many stages each process holds (one, but for ``"interleaved"`` and
    ``"zbv"``: :func:`~lightning_gpipe.engine.schedule.stages_of`, which checks them). Everything the layout says is
    worked out once, when it is made: reading it costs nothing per step.
    """

    world_size: int
    pipe_size: int
    rank: int
    schedule: str = "gpipe"
    virtual_stages: int = 1
    num_replicas: int = field(init=False, repr=False, compare=False)
    """How many data-parallel pipelines the job has."""
    replica: int = field(init=False, repr=False, compare=False)
    """This rank's pipeline (its data-parallel rank)."""
    stage: int = field(init=False, repr=False, compare=False)
    """This rank's position in its pipeline: its stage, where each process holds one (else see :attr:`stages`)."""
    stages: tuple[int, ...] = field(init=False, repr=False, compare=False)
    """The stages this rank holds, first to last in the model (``(stage,)`` with one stage per process)."""
    num_stages: int = field(init=False, repr=False, compare=False)
    """Stages per pipeline: ``pipe_size`` times the stages each process holds."""
    holds_last_stage: bool = field(init=False, repr=False, compare=False)
    """Whether this rank holds its pipeline's last stage (the loss, the metrics, the logs)."""
    last_stage_rank: int = field(init=False, repr=False, compare=False)
    """Global rank of this pipeline's last stage: the pipeline's first rank."""
    _held: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)  # the stages of each position
    _positions: tuple[int, ...] = field(init=False, repr=False, compare=False)  # the position of each local rank
    _stage_ranks: tuple[int, ...] = field(init=False, repr=False, compare=False)  # this pipeline's, by stage

    def __post_init__(self) -> None:
        if isinstance(self.pipe_size, bool) or not isinstance(self.pipe_size, int) or self.pipe_size < 1:
            raise ValueError(f"pipe_size={self.pipe_size!r} must be a positive int: the number of stages per pipeline")
        if self.world_size % self.pipe_size:
            divisors = ", ".join(str(k) for k in range(1, self.world_size + 1) if self.world_size % k == 0)
            raise ValueError(
                f"world_size={self.world_size} is not divisible by pipe_size={self.pipe_size}; use one of its "
                f"divisors: {divisors}"
            )
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside a world of {self.world_size} processes")
        K = self.pipe_size
        held = stage_table(self.schedule, K, stages_per_process(self.schedule, self.virtual_stages))
        num_stages = K * len(held[0])
        # The process holding the last stage sits on the pipeline's first rank (position K-1, or 0 under ZB-V).
        positions = tuple(range(K)) if num_stages - 1 in held[0] else tuple(reversed(range(K)))
        stage = positions[self.rank % K]
        derived = {
            "num_replicas": self.world_size // K,
            "replica": self.rank // K,
            "stage": stage,
            "stages": held[stage],
            "num_stages": num_stages,
            "holds_last_stage": num_stages - 1 in held[stage],
            "_held": held,
            "_positions": positions,
        }
        for name, value in derived.items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "_stage_ranks", tuple(self._ranks_by_stage(self.replica)))
        object.__setattr__(self, "last_stage_rank", self._stage_ranks[-1])

    def stages_at(self, position: int) -> tuple[int, ...]:
        """The stages the process at ``position`` of a pipeline holds."""
        return self._held[position]

    def position_of(self, stage: int) -> int:
        """The position in a pipeline of the process that holds ``stage``."""
        return next(position for position, held in enumerate(self._held) if stage in held)

    def pipeline_ranks(self, replica: int | None = None) -> list[int]:
        """Global ranks of a pipeline's processes by position (with one stage per process: in stage order)."""
        first = (self.replica if replica is None else replica) * self.pipe_size
        return [first + self._positions[position] for position in range(self.pipe_size)]  # the map is its own inverse

    def stage_ranks(self, replica: int | None = None) -> list[int]:
        """Global rank of every stage of a pipeline, in stage order (``num_stages`` entries)."""
        return list(self._stage_ranks) if replica is None else self._ranks_by_stage(replica)

    def _ranks_by_stage(self, replica: int) -> list[int]:
        ranks = self.pipeline_ranks(replica)
        by_stage = {stage: ranks[position] for position, held in enumerate(self._held) for stage in held}
        return [by_stage[stage] for stage in range(self.num_stages)]

    def replica_ranks(self, stage: int | None = None) -> list[int]:
        """Global ranks of the process at position ``stage`` (default: this rank's) in every replica: its
        data-parallel group, which holds the same stages."""
        position = self.stage if stage is None else stage
        return [ranks[position] for ranks in map(self.pipeline_ranks, range(self.num_replicas))]

    def device_mesh(
        self, device_type: str, pipeline_group: dist.ProcessGroup, replica_group: dist.ProcessGroup
    ) -> DeviceMesh:
        """The job's ``DeviceMesh`` of dimensions ``("pipe", "data")``, made of this rank's pipeline and replica groups
        (:meth:`new_groups`): no new process group. ``mesh["data"]`` is this rank's replica group."""
        ranks = torch.arange(self.world_size).reshape(self.num_replicas, self.pipe_size).T  # [offset, replica]
        return DeviceMesh.from_group(
            [pipeline_group, replica_group], device_type, mesh=ranks, mesh_dim_names=("pipe", "data")
        )

    def new_groups(
        self, timeout: datetime.timedelta
    ) -> tuple[dist.ProcessGroup, dist.ProcessGroup, list[LinkGroups | None]]:
        """Create (this rank's pipeline group, its data-parallel group, its pipeline's link groups).

        The link groups are in stage order (:func:`new_link_groups`): entry ``s`` joins stages ``s`` and ``s + 1`` of
        this rank's pipeline, or is ``None`` where one process holds both. Every group waits ``timeout`` for
        its peers, as the world group does. Every rank must call this, in the same order, because ``new_group`` is
        collective over the world: each rank creates every group, also those it is not in.
        """
        pipeline_group = replica_group = None
        links: list[LinkGroups | None] = []
        for replica in range(self.num_replicas):
            group = dist.new_group(self.pipeline_ranks(replica), timeout=timeout)
            if replica == self.replica:
                pipeline_group = group
        for position in range(self.pipe_size):
            group = dist.new_group(self.replica_ranks(position), timeout=timeout)
            if position == self.stage:
                replica_group = group
        for replica in range(self.num_replicas):
            replica_links = new_link_groups(self.stage_ranks(replica), timeout)
            if replica == self.replica:
                links = replica_links
        assert pipeline_group is not None
        assert replica_group is not None
        return pipeline_group, replica_group, links


class StageGroups(NamedTuple):
    """The process groups of one rank: its pipeline, its stage's replicas, its pipeline's links, objects, control."""

    pipeline: dist.ProcessGroup
    replicas: dist.ProcessGroup
    links: list[LinkGroups | None]
    objects: dist.ProcessGroup | None
    control: dist.ProcessGroup | None


def new_stage_groups(layout: ProcessLayout, backend: str | None, timeout: datetime.timedelta) -> StageGroups:
    """Create every group of :meth:`ProcessLayout.new_groups`, a gloo group per pipeline for objects and a gloo group
    over the world for checks that must give up after a while (``monitored_barrier``), whatever the backend.

    Objects (the step's logs and loss, checkpoint parts) are pickled to bytes; over NCCL those bytes are staged on the
    GPU, where gathering a checkpoint would hold K stages' parts at once on one device. Over gloo they stay in host
    memory. Every rank creates every group, in the same order (``new_group`` is collective over the world).
    """
    pipeline, replicas, links = layout.new_groups(timeout)
    if backend == "gloo":
        return StageGroups(pipeline, replicas, links, pipeline, dist.group.WORLD)
    objects = None
    for replica in range(layout.num_replicas):
        group = dist.new_group(layout.pipeline_ranks(replica), backend="gloo", timeout=timeout)
        if replica == layout.replica:
            objects = group
    return StageGroups(pipeline, replicas, links, objects, dist.new_group(backend="gloo", timeout=timeout))
