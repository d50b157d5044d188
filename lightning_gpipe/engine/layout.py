"""Process layout: which global rank runs which stage of which pipeline replica.

``pipe_size`` (K) consecutive ranks form one pipeline; ``world_size / K`` pipelines are data-parallel replicas. Within a
pipeline the stages run in reverse rank order: the last stage, which computes the loss and the metrics, sits on the
pipeline's lowest rank. Global rank 0, where Lightning draws the progress bar, writes logs and saves checkpoints,
therefore holds the real loss and torchmetrics state instead of mirrored copies.

Example, 4 ranks with K = 2::

    rank      0  1  2  3
    replica   0  0  1  1
    stage     1  0  1  0

Besides the pipeline and data-parallel groups, every link between adjacent stages (j, j+1) of every pipeline gets a
2-rank group of its own, which carries only that link's point-to-point messages. NCCL runs all operations of one group
in issue order on one stream: on a group shared with collectives, a collective issued after a posted receive would
wait for that receive (a deadlock when the peer sends only after the same collective), and a middle stage's sends
would queue behind the receives it posted from the previous stage.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import NamedTuple

import torch.distributed as dist

__all__ = ["ProcessLayout", "StageGroups", "new_stage_groups"]


@dataclass(frozen=True)
class ProcessLayout:
    """The place of ``rank`` in a job of ``world_size`` processes cut into pipelines of ``pipe_size`` stages."""

    world_size: int
    pipe_size: int
    rank: int

    def __post_init__(self) -> None:
        if isinstance(self.pipe_size, bool) or not isinstance(self.pipe_size, int) or self.pipe_size < 1:
            raise ValueError(f"pipe_size={self.pipe_size!r} must be a positive int: the number of stages per pipeline")
        if self.world_size % self.pipe_size:
            raise ValueError(
                f"world_size={self.world_size} (devices x num_nodes) is not divisible by pipe_size={self.pipe_size}: "
                "every pipeline needs exactly pipe_size processes. Use a pipe_size that divides the world size "
                f"({', '.join(str(k) for k in range(1, self.world_size + 1) if self.world_size % k == 0)}) or change "
                "devices / num_nodes."
            )
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside a world of {self.world_size} processes")

    @property
    def num_replicas(self) -> int:
        """How many data-parallel pipelines the job has."""
        return self.world_size // self.pipe_size

    @property
    def replica(self) -> int:
        """This rank's pipeline (its data-parallel rank)."""
        return self.rank // self.pipe_size

    @property
    def stage(self) -> int:
        """This rank's stage within its pipeline."""
        return self.pipe_size - 1 - self.rank % self.pipe_size

    def pipeline_ranks(self, replica: int | None = None) -> list[int]:
        """Global ranks of a pipeline's stages, in stage order (stage 0 first)."""
        first = (self.replica if replica is None else replica) * self.pipe_size
        return [first + self.pipe_size - 1 - stage for stage in range(self.pipe_size)]

    def replica_ranks(self, stage: int | None = None) -> list[int]:
        """Global ranks that run the same stage in every replica (its data-parallel group)."""
        stage = self.stage if stage is None else stage
        return [replica * self.pipe_size + self.pipe_size - 1 - stage for replica in range(self.num_replicas)]

    @property
    def last_stage_rank(self) -> int:
        """Global rank of this pipeline's last stage."""
        return self.pipeline_ranks()[-1]

    def new_groups(
        self, timeout: datetime.timedelta
    ) -> tuple[dist.ProcessGroup, dist.ProcessGroup, list[dist.ProcessGroup]]:
        """Create (this rank's pipeline group, its data-parallel group, its pipeline's link groups).

        The link groups are in stage order: entry ``j`` holds stages ``j`` and ``j + 1`` of this rank's pipeline. Every
        group waits ``timeout`` for its peers, as the world group does. Every rank must call this, in the same order,
        because ``new_group`` is collective over the world: each rank creates every group, also those it is not in.
        """
        pipeline_group = replica_group = None
        links: list[dist.ProcessGroup] = []
        for replica in range(self.num_replicas):
            group = dist.new_group(self.pipeline_ranks(replica), timeout=timeout)
            if replica == self.replica:
                pipeline_group = group
        for stage in range(self.pipe_size):
            group = dist.new_group(self.replica_ranks(stage), timeout=timeout)
            if stage == self.stage:
                replica_group = group
        for replica in range(self.num_replicas):
            ranks = self.pipeline_ranks(replica)
            for stage in range(self.pipe_size - 1):
                group = dist.new_group([ranks[stage], ranks[stage + 1]], timeout=timeout)
                if replica == self.replica:
                    links.append(group)
        assert pipeline_group is not None
        assert replica_group is not None
        return pipeline_group, replica_group, links


class StageGroups(NamedTuple):
    """The process groups of one rank: its pipeline, its stage's replicas, its pipeline's links, objects, control."""

    pipeline: dist.ProcessGroup
    replicas: dist.ProcessGroup
    links: list[dist.ProcessGroup]
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
