"""Checkpoint IO of a partitioned model: each rank saves, checks and reads only its own stage's part.

A checkpoint holds the whole model, keyed as the unpartitioned module's ``state_dict`` and optimizer state are
(:mod:`lightning_gpipe.partition.state_dict`), so it loads into any number of stages, or none. Two formats, as
Lightning's ``FSDPStrategy(state_dict_type=...)`` names them:

- ``"full"``: one ``torch.save`` file, written by global rank 0 as each stage's tensors arrive
  (:mod:`lightning_gpipe.full_checkpoint`); read back memory-mapped, each rank copying only its own tensors
  (:class:`~lightning_gpipe.torch_file.TensorFile`).
- ``"sharded"``: a ``torch.distributed.checkpoint`` directory that every rank writes its part of
  (:mod:`lightning_gpipe.sharded_checkpoint`).

Either is loaded whatever the strategy's setting. Stages sharded over their replicas (``data_parallel="fsdp"``) write
their shards into a sharded directory as they are, each replica its own rows; a full file gets each stage gathered
whole from its replicas first. Reading, a sharded stage takes only its own rows of each tensor, in either format.

Every save is atomic (:mod:`lightning_gpipe.checkpoint_paths`): a crash during a save leaves the previous checkpoint
loadable. A checkpoint that does not fit (another model's, a sharded directory where a file is expected or the
reverse, a lost or truncated shard) is refused before anything is written or loaded, on every rank alike. Each rank's
random generators travel in the checkpoint too (:mod:`lightning_gpipe.random_states`).
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
from lightning.pytorch import LightningModule
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor

from lightning_gpipe.checkpoint_paths import (
    format_conflict,
    is_remote,
    missing,
    not_a_checkpoint_directory,
    read_whole,
    remove,
    replace_directory,
    replacing_file,
    save_atomically,
    sibling,
)
from lightning_gpipe.compat import optimizers_to_device
from lightning_gpipe.config import StrategyConfig
from lightning_gpipe.engine.collectives import portable, receive_tensors, send_tensors
from lightning_gpipe.engine.errors import collective_errors
from lightning_gpipe.engine.layout import ProcessLayout
from lightning_gpipe.engine.sharding import held_part, local_shard, shard_like, sharded_target, whole
from lightning_gpipe.engine.sharding import is_sharded as is_sharded_tensor
from lightning_gpipe.engine.tree import map_tensors
from lightning_gpipe.full_checkpoint import WholeCheckpoint, stage_part, stage_specs
from lightning_gpipe.partition.state_dict import (
    ModelNames,
    check_loadable,
    local_optimizer_state,
    merge_optimizer_states,
    optimizer_state_by_name,
    parameter_names,
    state_by_name,
)
from lightning_gpipe.random_states import RANDOM_STATES_KEY, random_states, restore_random_states
from lightning_gpipe.sharded_checkpoint import (
    META_FILE,
    ShardedDirectory,
    is_sharded,
    optimizer_indices,
    optimizer_key,
    write_sharded,
)
from lightning_gpipe.torch_file import TensorFile, tensor_leaves

__all__ = ["StageCheckpoints"]

_SAVE_ARRIVAL_TIMEOUT = datetime.timedelta(seconds=30)  # how long saving waits for every rank to arrive


class StageCheckpoints:
    """One rank's side of saving and loading checkpoints.

    Args:
        layout: which stage of which replica this process runs.
        names: the whole module's state-dict keys, shapes and parameter order (recorded before it was cut).
        object_group: the pipeline's group for objects and stage tensors (gloo: they stay in host memory).
        control_group: a gloo group over every rank (on which a barrier can give up after a while).
        config: the strategy's settings: its ``timeout`` (the save barrier waits at most this) and
            ``state_dict_type`` (how :meth:`save` writes).
        device: this rank's device (for its random generators).
        module: the LightningModule, cut to this rank's stage; ``None`` before it is (a checkpoint is then read whole).
    """

    def __init__(
        self,
        layout: ProcessLayout,
        names: ModelNames,
        object_group: dist.ProcessGroup | None,
        control_group: dist.ProcessGroup | None,
        config: StrategyConfig,
        device: torch.device,
        module: LightningModule | None = None,
    ) -> None:
        self.layout = layout
        self.names = names
        self.object_group = object_group
        self.control_group = control_group
        self.timeout = config.timeout
        self.state_dict_type = config.state_dict_type
        self.device = device
        self.module = module
        self.distributed = dist.is_available() and dist.is_initialized()

    @property
    def _module(self) -> LightningModule:
        if self.module is None:
            raise RuntimeError(
                "the module is not cut into stages (before setup, or after gather_module()): save during fit, or "
                "before gather_module()"
            )
        return self.module

    # ------------------------------------------------------------------ collectives

    def gather(self, part: Any) -> list[Any] | None:
        """Every stage's ``part`` on its pipeline's last-stage rank (global rank 0 for the first pipeline)."""
        if self.layout.pipe_size == 1:
            return [part]
        dst = self.layout.last_stage_rank
        parts: list[Any] | None = [None] * self.layout.pipe_size if self.layout.rank == dst else None
        with collective_errors(self.layout.stage, f"gathering the stages' parts on global rank {dst}"):
            dist.gather_object(portable(part), parts, dst=dst, group=self.object_group)
        return parts

    def _all_gather(self, part: Any) -> list[Any]:
        """Every stage's ``part`` (small objects) on every rank of the pipeline, in the group's order (the same on
        every rank)."""
        if self.layout.pipe_size == 1:
            return [part]
        parts: list[Any] = [None] * self.layout.pipe_size
        with collective_errors(self.layout.stage, "exchanging the optimizers' parameter groups with the other stages"):
            dist.all_gather_object(parts, part, group=self.object_group)
        return parts

    def _from_rank_zero(self, value: Any) -> Any:
        """Global rank 0's ``value`` on every rank."""
        if not self.distributed:
            return value
        box = [value]
        with collective_errors(self.layout.stage, "receiving global rank 0's verdict on the checkpoint path"):
            dist.broadcast_object_list(box, src=0, group=self.control_group)
        return box[0]

    def check_every_rank_saves(self) -> None:
        """Fail at once, with the fix, when ``trainer.save_checkpoint`` runs on some ranks only.

        Under DDP ``if trainer.is_global_zero: trainer.save_checkpoint(...)`` works, since rank 0 holds the whole
        model; here each stage holds its own part, so saving is a collective. The ranks meet in a barrier that gives
        up after a short wait and names the ranks that did not come, instead of a hang until ``timeout``.
        """
        if self.layout.world_size == 1 or self.control_group is None:
            return
        wait = min(self.timeout, _SAVE_ARRIVAL_TIMEOUT)
        try:
            dist.monitored_barrier(self.control_group, timeout=wait, wait_all_ranks=True)
        except RuntimeError as error:
            raise RuntimeError(
                f"trainer.save_checkpoint was called on global rank {self.layout.rank}, but not on every rank "
                f"within {wait.total_seconds():.0f} s: call it on every rank (no is_global_zero guard)"
            ) from error

    # ------------------------------------------------------------------ saving

    def module_state(self) -> dict[str, Any]:
        """This stage's part of the module's state dict (:meth:`save` puts the parts together); see
        :meth:`_as_saved`."""
        self.check_every_rank_saves()
        return self._as_saved({key: value.detach() for key, value in self._module.state_dict().items()})

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """This stage's part of the optimizer's state, keyed by parameter name; see :meth:`_as_saved`."""
        return self._as_saved(optimizer_state_by_name(optimizer, self._module, self.names.aliases))

    def _as_saved(self, state: Any) -> Any:
        """``state`` as this rank saves it: sharded tensors as they are for a sharded directory (each replica writes
        its own rows), gathered whole for a full file (a collective over the replicas, which Lightning's saving runs
        on every rank in the same order)."""
        return state if self.state_dict_type == "sharded" else map_tensors(whole, state)

    def save(self, checkpoint: dict[str, Any], filepath: Any, io: CheckpointIO, storage_options: Any = None) -> None:
        """Write ``checkpoint`` (this rank's, holding its stage's part) at ``filepath``: a collective of every rank."""
        path = None if is_remote(filepath) else Path(filepath)
        sharded = self.state_dict_type == "sharded"
        conflict = format_conflict(path, sharded) if path is not None and self.layout.rank == 0 else None
        refusal = self._from_rank_zero(conflict)  # rank 0 decides, for ranks on file systems of their own
        if refusal is not None:
            raise ValueError(refusal)
        states = self._gather_random_states()
        if states is not None:
            checkpoint[RANDOM_STATES_KEY] = states
        if sharded:
            if path is None:
                raise ValueError(
                    f"state_dict_type='sharded' cannot write to the remote path {filepath!r}: use a local or mounted "
                    "one, or state_dict_type='full'"
                )
            self._save_sharded(checkpoint, path)
        else:
            self._save_full(checkpoint, filepath, io, storage_options)

    def _gather_random_states(self) -> dict[str, Any] | None:
        """Every rank's generators on global rank 0 (``None`` elsewhere)."""
        mine = random_states(self.device)
        ranks: list[Any] | None = [mine]
        if self.distributed:
            ranks = [None] * self.layout.world_size if self.layout.rank == 0 else None
            with collective_errors(self.layout.stage, "gathering every rank's random generators on global rank 0"):
                dist.gather_object(mine, ranks, dst=0, group=self.control_group)
        if ranks is None:
            return None
        return {"world_size": self.layout.world_size, "pipe_size": self.layout.pipe_size, "ranks": ranks}

    def _pipeline_ranks(self) -> list[int]:
        """This pipeline's global ranks in its groups' order (the order of a gather's results)."""
        return sorted(self.layout.pipeline_ranks(self.layout.replica))

    def _save_full(self, checkpoint: dict[str, Any], filepath: Any, io: CheckpointIO, storage_options: Any) -> None:
        if self.layout.replica != 0:
            return  # the first pipeline holds every stage already
        ranks = self._pipeline_ranks()
        position = ranks.index(self.layout.rank)
        parts: list[Any] | None = [None]
        if len(ranks) > 1:
            parts = [None] * len(ranks) if position == 0 else None
            with collective_errors(self.layout.stage, "sending this stage's tensor shapes to global rank 0"):
                dist.gather_object(stage_specs(checkpoint), parts, dst=ranks[0], group=self.object_group)
        if parts is None:
            with collective_errors(self.layout.stage, "sending this stage's tensors to global rank 0"):
                send_tensors(tensor_leaves(stage_part(checkpoint)), ranks[0], self.object_group)
            return
        whole = WholeCheckpoint(checkpoint, parts, position, self.names)

        def receive(process: int, specs: Any) -> Any:
            with collective_errors(self.layout.stage, f"receiving the tensors of global rank {ranks[process]}"):
                yield from receive_tensors(specs, ranks[process], self.object_group)

        if type(io) is TorchCheckpointIO and not is_remote(filepath):
            with replacing_file(Path(filepath)) as temporary:
                whole.write(temporary, receive)
        else:  # a plugin writes what it is given: the whole checkpoint in memory, received stage by stage
            save_atomically(io, whole.materialize(receive), filepath, storage_options)

    def _save_sharded(self, checkpoint: dict[str, Any], path: Path) -> None:
        state = {"model": checkpoint.pop("state_dict")}
        optimizers = checkpoint.pop("optimizer_states", [])
        # DCP keeps one rank's copy of a value that is not a tensor: each group lists the whole model's names.
        stages = self._all_gather([(optimizer["param_groups"], bool(optimizer["state"])) for optimizer in optimizers])
        for index, optimizer in enumerate(optimizers):
            parts = [{"state": {}, "param_groups": stage[index][0]} for stage in stages]
            groups = merge_optimizer_states(parts, self.names.parameter_order)["param_groups"]
            entry = {"state": optimizer["state"], "param_groups": groups}
            if any(stage[index][1] for stage in stages):
                state[optimizer_key(index)] = entry
            else:  # no tensor on any stage: DCP would write nothing, not even the parameter groups
                checkpoint[optimizer_key(index)] = entry
        temporary = sibling(path, "partial")
        if self.layout.rank == 0:
            remove(temporary)
        self._barrier("clearing the temporary directory of the checkpoint")
        write_sharded(state, checkpoint if self.layout.rank == 0 else None, temporary, self.control_group)
        if self.layout.rank == 0:
            replace_directory(temporary, path)

    def _barrier(self, what: str) -> None:
        if self.distributed:
            with collective_errors(self.layout.stage, what):
                dist.barrier(group=self.control_group)

    # ------------------------------------------------------------------ loading

    def load(self, filepath: Any, optimizers: Sequence[Any], io: CheckpointIO) -> dict[str, Any]:
        """The checkpoint at ``filepath`` (a file or a sharded directory) with this rank's part read: its keys of the
        model and, for each of ``optimizers``, its parameters' state; checked against the whole model first.

        A file's other tensors stay memory-mapped and unread; a sharded directory's are not read at all (its
        ``state_dict`` and optimizer states then hold this rank's part only). Before the module is cut into stages
        the checkpoint is read whole, by ``io``. Restores this rank's random generators when the checkpoint was written
        by the same world and pipe size. ``optimizers`` are read while fitting only (the weights alone otherwise).
        """
        if self.module is None or self.module.trainer.state.fn != TrainerFn.FITTING:
            optimizers = []
        if self.module is None or is_remote(filepath):
            checkpoint = io.load_checkpoint(filepath, weights_only=True)
            if self.module is not None:
                self._check(filepath, checkpoint, optimizers)
        else:
            path = Path(filepath)
            if is_sharded(path):
                checkpoint = self._read_sharded(path, optimizers)
            elif path.is_dir():
                raise ValueError(not_a_checkpoint_directory(path))
            elif path.is_file():
                checkpoint = self._read_full(path, optimizers)
            else:
                raise FileNotFoundError(missing(path))
        restore_random_states(
            checkpoint.get(RANDOM_STATES_KEY), self.layout.world_size, self.layout.pipe_size, self.layout.rank,
            self.device,
        )  # fmt: skip
        return checkpoint

    def _check(self, path: Any, checkpoint: Any, optimizers: Sequence[Any]) -> None:
        """Refuse a checkpoint this stage cannot take, before anything is read into it: the model's names and shapes,
        and the optimizer states' groups (``checkpoint`` may hold meta tensors and optimizer states without state)."""
        if not isinstance(checkpoint, Mapping) or "state_dict" not in checkpoint:
            held = ", ".join(map(str, list(checkpoint)[:6])) if isinstance(checkpoint, Mapping) else type(checkpoint)
            raise ValueError(
                f"{path} holds no 'state_dict' ({held}): not a trainer.save_checkpoint file; pass a sharded one's "
                f"directory, {Path(str(path)).parent}"
            )
        check_loadable(checkpoint["state_dict"], self.names.keys, self.names.shapes, self._module.strict_loading, path)
        saved = checkpoint.get("optimizer_states")
        if not optimizers or saved is None:
            return
        if len(saved) != len(optimizers):
            raise ValueError(
                f"{path} holds the state of {len(saved)} optimizer(s) and configure_optimizers returned "
                f"{len(optimizers)}: use the same optimizers, or load only the weights"
            )
        order, aliases = self.names.parameter_order, self.names.aliases
        for optimizer, state in zip(optimizers, saved, strict=True):
            try:
                local_optimizer_state(state, optimizer, self._module, order, aliases)
            except ValueError as error:
                raise ValueError(f"{path}: {error}") from error

    def _local_parameters(self) -> dict[str, Tensor]:
        """This stage's parameters by the name their optimizer state is saved under."""
        names = parameter_names(self._module, self.names.aliases)
        return {names[id(parameter)]: parameter for parameter in self._module.parameters()}

    def _read_full(self, path: Path, optimizers: Sequence[Any]) -> dict[str, Any]:
        try:
            file = TensorFile(path)
        except Exception:  # not a zip file torch maps (an old format, a cut file, not a checkpoint): read it whole
            checkpoint = read_whole(path)
            self._check(path, checkpoint, optimizers)
            return checkpoint
        with file:
            checkpoint = file.value
            self._check(path, checkpoint, optimizers)
            own = self._module.state_dict()  # read straight into: the stage holds no second copy of its weights
            state = checkpoint["state_dict"]
            checkpoint["state_dict"] = {key: _read(file, t, own[key]) if key in own else t for key, t in state.items()}
            if optimizers and "optimizer_states" in checkpoint:
                parameters = self._local_parameters()
                checkpoint["optimizer_states"] = [
                    _read_state(state_by_name(saved, self.names.parameter_order), parameters, file)
                    for saved in checkpoint["optimizer_states"]
                ]
        return checkpoint

    def _read_sharded(self, path: Path, optimizers: Sequence[Any]) -> dict[str, Any]:
        directory = ShardedDirectory(path)
        checkpoint = torch.load(path / META_FILE, weights_only=True, map_location="cpu")
        # An optimizer without tensor state was written whole into meta.pt (see sharded_checkpoint).
        saved = sorted(directory.optimizers() | optimizer_indices(checkpoint))
        groups = directory.param_groups(saved, self.control_group) if optimizers else {}
        entries = {
            i: checkpoint.pop(optimizer_key(i), None) or {"state": {}, "param_groups": groups.get(i)} for i in saved
        }
        shapes = {"state_dict": directory.model_shapes()}
        self._check(path, {**shapes, "optimizer_states": list(entries.values()) if saved else None}, optimizers)
        parameters = [self._local_parameters()] * len(optimizers)
        part = directory.read(self._module.state_dict(), parameters, self.control_group)
        checkpoint["state_dict"] = part.get("model", {})
        if optimizers and saved:
            read = [part.get(optimizer_key(i), entries[i]) for i in saved]
            checkpoint["optimizer_states"] = [{"state": {}, **entry} for entry in read]
        return checkpoint

    def load_module_state(self, saved: Mapping[str, Any], strict: bool) -> None:
        """Load this stage's part of ``saved`` (a state dict of the whole module, checked by :meth:`load`); a sharded
        tensor takes its rows of a whole one (what a checkpoint read whole holds)."""
        own = self._module.state_dict()
        local = {key: _held(saved[key], own[key]) for key in own if key in saved}
        self._module.load_state_dict(local, strict=strict)

    def load_optimizer_states(self, optimizers: list[Any], saved: list[Any]) -> None:
        """Load this stage's parameters' part of each optimizer state in ``saved`` (checked by :meth:`load`)."""
        order, aliases = self.names.parameter_order, self.names.aliases
        parameters = self._local_parameters()
        for optimizer, state in zip(optimizers, saved, strict=True):
            local = local_optimizer_state(state, optimizer, self._module, order, aliases)
            held = {
                name: {k: _held(v, parameters[name]) for k, v in entry.items()}
                for name, entry in local["state"].items()
            }
            optimizer.load_state_dict({**local, "state": held})
            optimizers_to_device([optimizer], self.device)


def _held(value: Any, like: Any) -> Any:
    """``value`` as this stage holds it: this rank's rows where it is a whole tensor of the sharded tensor ``like``."""
    return shard_like(value, like) if isinstance(value, Tensor) and isinstance(like, Tensor) else value


def _read(file: TensorFile, saved: Tensor, into: Tensor | None = None) -> Tensor:
    """``saved`` (one of ``file``'s tensors) read from the file: into ``into`` where it fits (else into fresh memory),
    and when ``into`` is sharded only the rows of its shard, into that shard, returning ``into``."""
    if into is None or not is_sharded_tensor(into):
        return file.read(saved, into)
    shard = local_shard(into)
    read = file.read(held_part(saved, into), shard)
    if read.data_ptr() != shard.data_ptr():  # not read in place: a device tensor
        shard.copy_(read)
    return into


def _read_state(saved: Mapping[str, Any], parameters: Mapping[str, Tensor], file: TensorFile) -> dict[str, Any]:
    """``saved`` (a name-keyed optimizer state) with the state of ``parameters`` read from ``file``: the rows of a
    sharded parameter's shard into a tensor sharded alike, for the tensors of its shape (Adam's moments)."""

    def read(value: Any, parameter: Tensor) -> Any:
        if not isinstance(value, Tensor):
            return value
        return _read(file, value, sharded_target(value.shape, value.dtype, parameter))

    state = {
        name: {key: read(value, parameters[name]) for key, value in entry.items()} if name in parameters else entry
        for name, entry in saved["state"].items()
    }
    return {**saved, "state": state}
