"""Training jobs that fail on purpose, resume, repeat themselves and run long, for the reliability tests.

``python -m helpers.jobs helpers.reliability_job CONFIG.json`` runs the fits listed in the config, one after the other,
in every rank (started by ``run_job`` like torchrun, or by Lightning's own launcher through ``launch``). A run is a
``helpers.lightning_job`` run plus:

- ``fault``: ``{"rank": r, "step": s, "microbatch": i, "how": h}``: on global rank ``r``, at global step ``s``, in the
  step's call for micro-batch ``i``: ``"sigkill"`` (the process kills itself), ``"raise"``, ``"nan_input"`` (a NaN in
  the input of that micro-batch) or ``"nan_target"`` (a NaN in its target, so only the loss is affected). With
  ``"phase": "backward"`` a ``"sigkill"`` comes instead where the step's backward passes begin (``on_before_backward``,
  after every forward and the loss's broadcast), and the other ranks wait there until the killed process is gone: the
  first thing to reach it is then a send of gradients; with ``"phase": "collective"`` it is the strategy's ``reduce``
  (what ``self.log(..., sync_dist=True)`` runs), with ``"phase": "clip"`` the norm of ``gradient_clip_val``, with
  ``"phase": "gather"`` the module's own ``self.all_gather``;
- ``skip_sequence``: a ``training_step`` that never calls the pipelined sequence;
- ``rank_data``: ``{rank: seed}``, ranks that read another dataset (as a sampler per stage would);
- ``checkpoints``: a folder where ``ModelCheckpoint`` keeps every epoch's checkpoint and ``last.ckpt``;
- ``expect_error``: catch the fit's error, write it to ``error-{index}-rank{r}.txt`` and go on with the next run;
- ``probe``: record every ``probe`` steps this rank's resident memory and step time, and its listening sockets.

What rank 0 sees after each fit (the whole model's state dict) is written to ``result-{index}.pt``; an error that
ends the job is written to ``failure-rank{r}.txt`` before it propagates.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import time
import traceback
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.fabric.strategies.launchers import subprocess_script
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader

from helpers.lightning_job import SequentialModule, dataset, trainer_for
from helpers.whole import whole_module

__all__ = ["FaultyModule", "MemoryProbe", "listening_sockets", "main", "resident_bytes"]

SAMPLES, BATCH = 64, 16
OBSERVER_GRACE = 10.0  # seconds the surviving rank 0 has to report its error before Lightning's watcher kills it


class FaultyModule(SequentialModule):
    """``SequentialModule`` with the faults of one run injected into its ``training_step``."""

    def __init__(self, run: dict[str, Any]) -> None:
        super().__init__(run.get("model", "mlp"))
        self.fault: dict[str, Any] = run.get("fault") or {}
        self.skip_sequence = bool(run.get("skip_sequence", False))
        self._step_calls = (-1, 0)  # (global step, calls so far in it): the micro-batch index of the next call

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        step, calls = self._step_calls
        microbatch = calls if step == self.global_step else 0
        self._step_calls = (self.global_step, microbatch + 1)
        x, y = batch
        if self.skip_sequence:
            return F.mse_loss(x[:, : y.shape[1]], y)
        fault = self.fault
        if (
            fault
            and fault["rank"] == self.global_rank
            and fault["step"] == self.global_step
            and fault.get("microbatch", 0) == microbatch
        ):
            how = fault["how"]
            if how == "sigkill" and fault.get("phase", "forward") == "forward":
                self._kill()
            if how == "raise":
                raise RuntimeError(f"deliberate failure on rank {self.global_rank}")
            if how == "nan_input":
                x = x.clone()
                x[0, 0] = float("nan")
            if how == "nan_target":
                y = y.clone()
                y[0, 0] = float("nan")
        loss = F.mse_loss(self.layers(x), y)
        self.log("train_loss", loss)
        return loss

    def on_before_backward(self, loss: torch.Tensor) -> None:
        fault = self.fault
        phase = fault.get("phase") if fault else None
        if phase not in ("backward", "collective", "clip", "gather") or fault["step"] != self.global_step:
            return
        store = dist.distributed_c10d._get_default_store()
        if fault["rank"] == self.global_rank:
            store.set("killed pid", str(os.getpid()))
            self._kill()
        store.wait(["killed pid"], datetime.timedelta(seconds=60))
        _wait_for_exit(int(store.get("killed pid")))
        if fault["phase"] == "collective":  # a Lightning collective reaches the dead rank first: self.log's sync_dist
            self.trainer.strategy.reduce(torch.ones((), device=self.device), reduce_op="sum")
        if fault["phase"] == "clip":  # gradient_clip_val's norm over the stages reaches it first
            self.trainer.strategy.precision_plugin.clip_grad_by_norm(self.trainer.optimizers[0], 1.0)
        if fault["phase"] == "gather":  # a user's all_gather (as in a validation step) reaches it first
            self.all_gather(torch.ones((), device=self.device))

    def _kill(self) -> None:
        print(f"rank {self.global_rank} kills itself in step {self.global_step} at {time.time():.3f}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


def _wait_for_exit(pid: int, timeout: float = 60.0) -> None:
    """Return once process ``pid`` has ended (gone, or a zombie its parent has not reaped yet)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            break
        if state == "Z":
            break
        time.sleep(0.05)
    else:
        raise TimeoutError(f"process {pid} was still running {timeout:g} s after it was to kill itself")
    time.sleep(0.5)  # for gloo's event loop to see the connection close, so that the next send fails in isend itself


def resident_bytes() -> int:
    """This process's resident set size (``/proc/self/statm``; psutil is not a dependency)."""
    resident_pages = int(Path("/proc/self/statm").read_text().split()[1])
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


def listening_sockets() -> list[str]:
    """``address:port`` of every TCP socket this process listens on, from ``/proc/net/tcp`` and ``tcp6``."""
    own = set()
    for fd in Path("/proc/self/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            own.add(target[len("socket:[") : -1])
    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in own:  # 0A: LISTEN
                address, port = fields[1].split(":")
                found.append(f"{_address(address)}:{int(port, 16)}")
    return found


def _address(hexadecimal: str) -> str:
    raw = bytes.fromhex(hexadecimal)
    if len(raw) == 4:
        return ".".join(str(b) for b in reversed(raw))
    words = [raw[i : i + 4][::-1] for i in range(0, 16, 4)]  # /proc stores each 32-bit word in host order
    return ":".join(b.hex() for b in words)


class MemoryProbe(Callback):
    """Every ``every`` steps: this rank's resident memory and the mean wall time of the steps since the last probe."""

    def __init__(self, every: int, path: Path) -> None:
        self.every = every
        self.path = path
        self.records: list[dict[str, float]] = []
        self._since = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        step = trainer.global_step
        if step % self.every:
            return
        now = time.perf_counter()
        self.records.append({"step": step, "rss": resident_bytes(), "step_seconds": (now - self._since) / self.every})
        self._since = now

    def on_train_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.path.write_text(json.dumps({"records": self.records, "listening": listening_sockets()}))


def fit(run: dict[str, Any], root: Path, index: int) -> FaultyModule:
    L.seed_everything(0, verbose=False)
    module = FaultyModule(run)
    callbacks: list[Callback] = []
    if run.get("checkpoints"):
        callbacks.append(ModelCheckpoint(dirpath=run["checkpoints"], save_top_k=-1, save_last=True,
                                         filename="{epoch}", every_n_epochs=1))  # fmt: skip
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    if run.get("probe"):
        callbacks.append(MemoryProbe(run["probe"], root / f"probe-{index}-rank{rank}.json"))
    trainer = trainer_for(run, root, callbacks=callbacks, enable_checkpointing=bool(callbacks))
    seed = {int(key): value for key, value in run.get("rank_data", {}).items()}.get(rank)
    data = dataset(run.get("samples", SAMPLES)) if seed is None else _other_dataset(run.get("samples", SAMPLES), seed)
    loader = DataLoader(data, batch_size=run.get("batch", BATCH), shuffle=False)
    trainer.fit(module, loader, ckpt_path=run.get("resume"))
    return module


def _other_dataset(samples: int, seed: int) -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    reference = dataset(samples)
    x = torch.randn(reference.tensors[0].shape, generator=generator)
    return torch.utils.data.TensorDataset(x, reference.tensors[1])


class _ReportingFirstObserver(subprocess_script._ChildProcessObserver):
    """Lightning's watcher of rank 0's children, which SIGKILLs rank 0 when a child dies, after a grace period.

    Without it the watcher, polling every 5 s, may kill the surviving rank 0 before it has reported the error the test
    reads: a race that failed the SIGKILL tests about once in ten runs under load.
    """

    def _terminate_all(self) -> None:
        time.sleep(OBSERVER_GRACE)
        super()._terminate_all()


def main(config_path: str) -> None:
    """Every run of the config; a failure's traceback also goes to ``failure-rank{LOCAL_RANK}.txt`` beside it."""
    subprocess_script._ChildProcessObserver = _ReportingFirstObserver
    try:
        _run_all(config_path)
    except BaseException:
        rank = os.environ.get("LOCAL_RANK", "0")
        (Path(config_path).parent / f"failure-rank{rank}.txt").write_text(traceback.format_exc())
        raise


def _run_all(config_path: str) -> None:
    config = json.loads(Path(config_path).read_text())
    root = Path(config_path).parent
    for index, run in enumerate(config["runs"]):
        try:
            module = fit(run, root, index)
        except Exception as error:
            if not run.get("expect_error"):
                raise
            rank = int(os.environ.get("LOCAL_RANK", "0"))
            (root / f"error-{index}-rank{rank}.txt").write_text(f"{type(error).__name__}: {error}")
            continue
        whole = whole_module(module)
        if whole is not None:
            torch.save(whole.state_dict(), root / f"result-{index}.pt")
