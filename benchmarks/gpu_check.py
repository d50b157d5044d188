"""``make gpu-check``: everything one CUDA device can verify about the engine and the strategy, one line per check.

Usage: ``python -m benchmarks.gpu_check [--only NAME ...]``. Each check runs in a fresh process (its own CUDA context,
peak-memory counters and process group) and prints ``NAME: ok (details)`` or ``NAME: FAILED (reason)``; the command
exits 1 when any check failed. On a machine without CUDA every check prints ``NAME: no CUDA device: skipped`` and the
command exits 0, so the target is safe to run anywhere. The whole list takes a few minutes on one GPU.
"""

from __future__ import annotations

import argparse
import copy
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from benchmarks.trainer import quiet_trainer
from tools.launch import run_command

__all__ = ["CHECKS", "main"]

CHECK_TIMEOUT = 300  # seconds per check; the gpu-marker tests are the longest
TOLERANCE = {"32-true": 1e-4, "bf16-mixed": 3e-2, "16-mixed": 1e-2}  # max abs difference of the trained weights
WIDTH, STEPS, OVERFLOW_STEP = 32, 4, 1
PLAN_MEMORY_TARGET = 0.10  # the planner's worst relative error of predicted peak memory (issue 16's target)
DEVICE = "cuda"  # what every check runs on; a test sets "cpu" to dry-run a check's code on a machine without CUDA


def _mlp(depth: int = 4, width: int = WIDTH) -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(width, 2))


def _loader(samples: int = 64, batch_size: int = 16) -> Any:
    from torch.utils.data import DataLoader, TensorDataset

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(samples, WIDTH, generator=generator)
    return DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=batch_size)


def _module(precision: str, meta: bool = False) -> Any:
    import lightning as L
    import torch.nn.functional as F

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.layers: nn.Module | None = None if meta else _mlp()

        def configure_model(self) -> None:
            if self.layers is None:  # under GPipeStrategy this runs on the meta device, then materializes
                torch.manual_seed(0)
                self.layers = _mlp()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            assert self.layers is not None
            return F.cross_entropy(self.layers(x), y)

        def on_after_backward(self) -> None:
            if precision == "16-mixed" and self.global_step == OVERFLOW_STEP:
                first = next(p for p in self.parameters() if p.grad is not None)
                first.grad[0, 0] = float("inf")  # the scaler must skip this step, then halve its scale

        def configure_optimizers(self) -> torch.optim.Optimizer:
            # A fused optimizer under 16-mixed: Lightning does not call unscale_, the scaler's own check decides.
            # SGD, not Adam: Adam's normalization would blow 16-bit rounding up to whole steps on tiny gradients.
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9, fused=precision == "16-mixed" or None)

    return Net()


def _fit(strategy: Any, precision: str, meta: bool = False) -> tuple[dict[str, torch.Tensor], float | None]:
    module = _module(precision, meta)
    trainer = quiet_trainer(
        accelerator=DEVICE,
        devices=1,
        strategy=strategy,
        precision=precision,
        max_steps=STEPS,
        use_distributed_sampler=False,  # one device: the plain loader's order for both strategies
    )
    trainer.fit(module, _loader())
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    weights = {key: value.detach().float().cpu() for key, value in module.state_dict().items()}
    return weights, scaler.get_scale() if scaler is not None else None


def _largest_difference(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    assert actual.keys() == expected.keys(), (sorted(actual), sorted(expected))
    return max((actual[key] - expected[key]).abs().max().item() for key in expected)


def _strategy_against_auto(precision: str) -> str:
    from lightning_gpipe import GPipeStrategy

    reference, reference_scale = _fit("auto", precision)
    ours, scale = _fit(GPipeStrategy(pipe_size=1, chunks=2), precision)
    difference = _largest_difference(ours, reference)
    if difference > TOLERANCE[precision]:
        raise AssertionError(f"weights differ from strategy='auto' by {difference:.2e} > {TOLERANCE[precision]}")
    if scale != reference_scale:
        raise AssertionError(f"loss scale {scale} after the injected overflow, strategy='auto' has {reference_scale}")
    scale_note = f", loss scale {scale} after an injected overflow" if scale is not None else ""
    return f"max abs weight difference {difference:.1e}{scale_note}"


def check_gpu_tests(folders: tuple[str, ...] = ("tests/tests_gpipe", "tests/tests_zoo")) -> str:
    """The test suite's ``gpu`` marker tests (the engine's and the zoo's folders: the notebook and API-reference tests,
    which need only the dev tools, hold none)."""
    command = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", *folders]
    result = run_command(command, timeout=CHECK_TIMEOUT)
    lines = result.stdout.strip().splitlines()
    summary = lines[-1] if lines else result.stderr.strip()[-300:]
    if result.returncode != 0:
        # A collection error (a test module importing a package this machine lacks) reads "N errors" alone: name it.
        causes = [line.removeprefix("E").strip() for line in lines if line.startswith("E   ")]
        raise AssertionError(f"{summary}; first error: {causes[0]}" if causes else summary)
    return summary.strip("= ")


def check_k1_fp32() -> str:
    """GPipeStrategy with K=1, M=2 trains like ``strategy="auto"`` in 32-bit."""
    return _strategy_against_auto("32-true")


def check_k1_bf16() -> str:
    """The same in ``bf16-mixed``."""
    return _strategy_against_auto("bf16-mixed")


def check_k1_fp16_overflow() -> str:
    """The same in ``16-mixed`` with a fused SGD and an injected inf: both skip the step and halve the scale."""
    return _strategy_against_auto("16-mixed")


def check_k1_compiled_bf16() -> str:
    """``GPipeStrategy(compile=True)``, K=1, M=2, trains like ``strategy="auto"`` in ``bf16-mixed``; its layers compiled
    (inductor on CUDA)."""
    from torch._dynamo.utils import counters

    from lightning_gpipe import GPipeStrategy

    reference, _ = _fit("auto", "bf16-mixed")
    counters.clear()
    ours, _ = _fit(GPipeStrategy(pipe_size=1, chunks=2, compile=True), "bf16-mixed")
    graphs = counters["stats"]["unique_graphs"]
    if graphs == 0:
        raise AssertionError("compile=True compiled no graph")
    difference = _largest_difference(ours, reference)
    if difference > TOLERANCE["bf16-mixed"]:
        raise AssertionError(f"weights differ from strategy='auto' by {difference:.2e} > {TOLERANCE['bf16-mixed']}")
    return f"{graphs} graphs compiled, max abs weight difference {difference:.1e}"


def check_threaded_engine() -> str:
    """``run_in_threads`` with two CUDA stages computes the single-device gradients."""
    import torch.nn.functional as F

    from lightning_gpipe import run_in_threads

    device = torch.device(DEVICE)
    torch.manual_seed(0)
    model = _mlp().to(device)
    reference = copy.deepcopy(model)
    x, y = next(iter(_loader()))
    x, y = x.to(device), y.to(device)
    F.cross_entropy(reference(x), y).backward()
    cells = [model[:4], model[4:]]
    run_in_threads(cells, (x, y), lambda output, batch: F.cross_entropy(output, batch[1]), chunks=4)
    difference = max(
        (p.grad - r.grad).abs().max().item()  # type: ignore[operator]
        for p, r in zip(model.parameters(), reference.parameters(), strict=True)
    )
    if difference > 1e-5:
        raise AssertionError(f"gradients differ from a single-device step by {difference:.2e}")
    return f"max abs gradient difference {difference:.1e}"


def check_compiled_split_backward() -> str:
    """Under ``"zero_bubble"`` and ``"zbv"``, layers compiled by inductor train like plain autograd, and the weight pass
    runs none of their compiled backwards again (the input pass keeps the weight gradients they computed)."""
    import torch.nn.functional as F
    from torch.autograd.graph import Node

    from lightning_gpipe import run_in_threads
    from lightning_gpipe.engine.split import input_pass
    from lightning_gpipe.partition.compile import compile_layers

    device = torch.device(DEVICE)

    def layers(count: int) -> list[nn.Module]:
        torch.manual_seed(0)
        return [nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True).to(device) for _ in range(count)]

    x, y = torch.randn(8, 16, 64, device=device), torch.randn(8, 16, 64, device=device)
    cell, reference = nn.Sequential(*layers(2)), nn.Sequential(*layers(2))
    compile_layers(list(cell), {"dynamic": False})
    leaf = x.clone().requires_grad_()  # a stage whose input takes a gradient: its input pass runs every layer
    output = cell(leaf)
    nodes, stack, seen = [], [output.grad_fn], set()
    while stack:  # the compiled regions' backward nodes
        node = stack.pop()
        if node is not None and node not in seen:
            seen.add(node)
            nodes += [node] if node.name() == "CompiledFunctionBackward" else []
            stack += [child for child, _ in node.next_functions]
    runs: list[Node] = []
    for node in nodes:
        node.register_prehook(lambda grads, node=node: runs.append(node))
    input_pass([output], [torch.ones_like(output)], [leaf])[1].run()
    if not nodes or len(runs) != len(nodes):
        raise AssertionError(f"{len(runs)} runs of {len(nodes)} compiled backwards in the input and weight passes")
    reference(x).sum().backward()
    differences = []
    for schedule, count in (("zero_bubble", 2), ("zbv", 4)):
        compiled, plain = layers(count), nn.Sequential(*layers(count))
        compile_layers(compiled, {"dynamic": False})
        loss = lambda out, batch: F.mse_loss(out, batch[1])  # noqa: E731
        run_in_threads(compiled, (x, y), loss, chunks=4, checkpoint="never", schedule=schedule)
        F.mse_loss(plain(x), y).backward()
        got = [p.grad for layer in compiled for p in layer.parameters()]
        differences.append(max((g - p.grad).abs().max().item() for g, p in zip(got, plain.parameters(), strict=True)))  # type: ignore[operator]
    if max(differences) > 1e-4:
        raise AssertionError(f"gradients differ from plain autograd by {max(differences):.2e} (zero_bubble, zbv)")
    return (
        f"{len(nodes)} compiled backwards run once each; zero_bubble / zbv gradients within "
        f"{differences[0]:.1e} / {differences[1]:.1e} of plain autograd"
    )


def check_meta_init() -> str:
    """A model built in ``configure_model`` (on the meta device) materializes on the GPU and trains."""
    from lightning_gpipe import GPipeStrategy

    weights, _ = _fit(GPipeStrategy(pipe_size=1, chunks=2), "32-true", meta=True)
    if not all(torch.isfinite(value).all() for value in weights.values()):
        raise AssertionError("non-finite weights after training a meta-initialized model")
    return f"{len(weights)} tensors materialized on the GPU and trained {STEPS} steps"


def check_rematerialization_memory() -> str:
    """Peak CUDA memory (``torch.cuda.max_memory_allocated``) of a step: ``checkpoint="always"`` below ``"never"``."""
    import torch.nn.functional as F

    from lightning_gpipe import run_in_threads

    device = torch.device("cuda")
    peaks = {}
    for mode in ("never", "always"):
        torch.manual_seed(0)
        model = _mlp(depth=32, width=1024).to(device)
        x = torch.randn(4096, 1024, device=device)
        y = torch.zeros(4096, dtype=torch.long, device=device)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        run_in_threads([model], (x, y), lambda out, batch: F.cross_entropy(out, batch[1]), chunks=4, checkpoint=mode)
        torch.cuda.synchronize()
        peaks[mode] = torch.cuda.max_memory_allocated(device) - start
        del model, x, y
        torch.cuda.empty_cache()
    ratio = peaks["always"] / peaks["never"]
    if ratio >= 1:
        raise AssertionError(f"re-materialization did not lower the peak: always/never = {ratio:.2f}")
    mib = {mode: peak / 2**20 for mode, peak in peaks.items()}
    return f"peak growth never {mib['never']:.0f} MiB, always {mib['always']:.0f} MiB, ratio {ratio:.2f}"


def check_zoo_bf16() -> str:
    """A tiny zoo Transformer trains two steps at K=1 in bf16-mixed on the GPU with a finite loss."""
    import lightning as L

    import zoo
    from lightning_gpipe import GPipeStrategy

    model = zoo.create_model(
        "transformer_lm",
        num_layers=2, ff_dim=64, num_heads=2, d_model=32, vocab_size=50, dropout=0.0, warmup_steps=0, lr=3e-3,
    )  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(4, 50, (32, 9), generator=generator)
    tokens[:, 0], tokens[:, -1] = 1, 2
    from torch.utils.data import DataLoader

    trainer = quiet_trainer(
        accelerator=DEVICE,
        devices=1,
        strategy=GPipeStrategy(pipe_size=1, chunks=2),
        precision="bf16-mixed",
        max_steps=2,
    )
    trained_on = set()

    class RecordDevices(L.Callback):  # Lightning's teardown moves the model back to the CPU: look during training
        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            trained_on.update(p.device.type for p in module.parameters())

    trainer.callbacks.append(RecordDevices())
    trainer.fit(model, DataLoader(list(tokens), batch_size=8))
    parameters = list(model.parameters())
    if trained_on != {DEVICE}:
        raise AssertionError(f"the zoo model trained with weights on {sorted(trained_on)}, expected only {DEVICE}")
    if not all(torch.isfinite(p).all() for p in parameters):
        raise AssertionError("the zoo model's weights are not finite after training")
    return f"{trainer.global_step} steps, {sum(p.numel() for p in parameters)} parameters on {DEVICE}"


def check_plan_calibration() -> str:
    """The planner's predictions on CUDA against measurement (K = 1, as one GPU allows): the quick calibration, whose
    memory error must stay within the CPU's target."""
    command = [sys.executable, "-m", "benchmarks.plan_calibration.run", "--device", "cuda", "--quick", "--no-docs"]
    result = run_command(command, timeout=CHECK_TIMEOUT)
    headlines = dict(line.split("=", 1) for line in result.stdout.splitlines() if line.startswith("plan_"))
    if result.returncode != 0 or "plan_memory_error" not in headlines:
        raise AssertionError(f"exit {result.returncode}: {' '.join(result.stderr.strip().splitlines()[-3:])[-300:]}")
    summary = ", ".join(f"{key} {value}" for key, value in headlines.items())
    if float(headlines["plan_memory_error"]) > PLAN_MEMORY_TARGET:
        raise AssertionError(f"{summary}: memory above the target {PLAN_MEMORY_TARGET}")
    return summary


def check_gpu_speed_quick() -> str:
    """``make bench-gpu``'s short form (``--quick``): ``auto`` against gpipe K=1 M=4 on a small Transformer-L, which
    must finish and print its table."""
    from benchmarks.gpu_speed.report import read_table

    tiny = ["--device", "cpu", "--tiny"] if DEVICE == "cpu" else []  # the dry run of the same code on a CPU
    command = [sys.executable, "-m", "benchmarks.gpu_speed.run", "--quick", "--no-docs", *tiny]
    result = run_command(command, timeout=CHECK_TIMEOUT)
    rows = read_table(result.stdout)
    if result.returncode != 0 or len(rows) != 2:
        tail = " ".join((result.stdout + result.stderr).strip().splitlines()[-3:])[-300:]
        raise AssertionError(f"exit {result.returncode}, {len(rows)} table rows of 2: {tail}")
    missing = [label for label, row in rows.items() if row["vs auto"] == "-"]
    if missing:
        raise AssertionError(f"no step time for {', '.join(missing)}: {' '.join(rows[missing[0]].values())}")
    return ", ".join(f"{label} {row['ms']} ms ({row['vs auto']} of auto)" for label, row in rows.items())


CHECKS: dict[str, Callable[[], str]] = {
    "gpu-marker tests": check_gpu_tests,
    "K=1 vs auto, 32-true": check_k1_fp32,
    "K=1 vs auto, bf16-mixed": check_k1_bf16,
    "K=1 vs auto, 16-mixed with overflow": check_k1_fp16_overflow,
    "K=1 compile=True vs auto, bf16-mixed": check_k1_compiled_bf16,
    "threaded engine vs single device": check_threaded_engine,
    "compiled layers under a split backward": check_compiled_split_backward,
    "meta init on CUDA": check_meta_init,
    "re-materialization peak memory": check_rematerialization_memory,
    "zoo transformer_lm K=1 bf16": check_zoo_bf16,
    "planner on CUDA, K=1": check_plan_calibration,
    "bench-gpu --quick": check_gpu_speed_quick,
}


def _run_one(name: str) -> int:
    try:
        detail = CHECKS[name]()
    except Exception as error:  # reported as the check's line; the parent counts the failure
        message = " ".join(f"{type(error).__name__}: {error}".split())
        print(f"RESULT FAILED ({message[:400]})")
        return 1
    print(f"RESULT ok ({detail})")
    return 0


def _run_isolated(name: str) -> tuple[bool, str]:
    command = [sys.executable, "-m", "benchmarks.gpu_check", "--in-process", name]
    try:
        result = run_command(command, timeout=CHECK_TIMEOUT + 60)
    except subprocess.TimeoutExpired:
        return False, f"FAILED (no result in {CHECK_TIMEOUT + 60} s)"
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        tail = " ".join(result.stderr.strip().splitlines()[-3:])[-400:]
        return False, f"FAILED (exit {result.returncode}: {tail})"
    outcome = lines[-1].removeprefix("RESULT ")
    return outcome.startswith("ok"), outcome


def main(argv: list[str] | None = None) -> int:
    """Run the checks (all, or those named with ``--only``); print one line each; 1 if any failed, else 0."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=sorted(CHECKS), help="run these checks only")
    parser.add_argument("--in-process", choices=sorted(CHECKS), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.in_process:
        return _run_one(args.in_process)
    names = args.only or list(CHECKS)
    if not torch.cuda.is_available():
        for name in names:
            print(f"{name}: no CUDA device: skipped", flush=True)
        return 0
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    failed = 0
    for name in names:
        start = time.perf_counter()
        passed, outcome = _run_isolated(name)
        failed += not passed
        print(f"{name}: {outcome} [{time.perf_counter() - start:.0f} s]", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "4")
    sys.exit(main())
