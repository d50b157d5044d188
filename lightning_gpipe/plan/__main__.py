"""``python -m lightning_gpipe.plan``: plan a model for a device count and a memory budget, as ``plan="auto"`` would.

The model is your own, given as ``module:attribute`` (a LightningModule or any module holding the ``nn.Sequential``
to pipeline, its class, or a factory that returns one, called with the ``--model-arg`` values), or a zoo model's name
(built on the meta device). Examples::

    python -m lightning_gpipe.plan my_project.models:Net --devices 4 --memory 16GB --batch-size 32
    python -m lightning_gpipe.plan transformer_lm --model-arg num_layers=24 --sample-shape 1,1024 \
        --sample-dtype long --devices 8 --memory 16GB --batch-size 32

``--batch-size`` is what each pipeline reads per step (the DataLoader's ``batch_size``), as ``plan="auto"`` takes it.
``--data-parallel`` says how the replicas of a stage may share it: ``auto`` (default) keeps them whole unless nothing
fits whole, then shards them (``data_parallel="fsdp"``); ``ddp`` or ``fsdp`` plans for that one.
Prints the ``GPipeStrategy(...)`` that carries the plan out, the same line as ``plan="auto"`` logs, then the plan's
table; exits with status 2 and the planner's answer when nothing fits.
"""

from __future__ import annotations

import argparse
import ast
import functools
import importlib
import sys
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from lightning_gpipe.engine.schedule import SCHEDULES
from lightning_gpipe.engine.tree import map_tensors
from lightning_gpipe.partition.discovery import find_sequence
from lightning_gpipe.plan import DEFAULT_VIRTUAL_STAGES, InfeasiblePlanError, plan
from lightning_gpipe.plan.sharding import DATA_PARALLEL_CHOICES

__all__ = ["build_model", "main"]

ZOO = "zoo"  # the package whose create_model builds a model given by its bare name


def _value(text: str) -> object:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def build_model(spec: str, kwargs: dict[str, Any]) -> nn.Module:
    """The model ``spec`` names: ``module:attribute`` (a module, a class or a factory), else a zoo model's name.

    A class or factory is called with ``kwargs``; a LightningModule's ``configure_model`` then runs on the meta device,
    as under the strategy. A zoo model is built on the meta device, and ``zoo`` is imported only then.

    Raises:
        ValueError: the module or attribute cannot be found, or does not give an ``nn.Module``.
    """
    if ":" not in spec:
        registry = importlib.import_module(ZOO)  # by name: the library never imports the zoo
        with torch.device("meta"):
            model: nn.Module = registry.create_model(spec, **kwargs)
        return model
    path, _, attribute = spec.partition(":")
    try:
        found: Any = functools.reduce(getattr, attribute.split("."), importlib.import_module(path))
    except (ImportError, AttributeError) as error:
        raise ValueError(
            f"cannot load the model {spec!r}: {error}; give module:attribute, importable from here (PYTHONPATH)"
        ) from error
    if isinstance(found, nn.Module):
        if kwargs:
            raise ValueError(f"{spec!r} is a built module, which takes no --model-arg; name its class or a factory")
        model = found
    elif callable(found):
        model = found(**kwargs)
    else:
        raise ValueError(f"{spec!r} is a {type(found).__name__}; name a module, its class, or a factory of one")
    if not isinstance(model, nn.Module):
        raise ValueError(f"{spec!r} gave a {type(model).__name__}, not a torch.nn.Module (a LightningModule)")
    configure = getattr(model, "configure_model", None)
    if callable(configure):
        with torch.device("meta"):  # as GPipeStrategy runs it: each rank later builds only its stage's layers
            configure()
    return model


def _sample_of(model: nn.Module, args: argparse.Namespace, device: str) -> Any:
    """The input of the first layer: ``--sample-shape``, else the model's ``example_input_array`` on ``device``."""
    if args.sample_shape:
        shape = tuple(int(size) for size in args.sample_shape.split(","))
        dtype = torch.long if args.sample_dtype == "long" else torch.float
        return _placed(torch.empty(shape, dtype=dtype, device="meta"), device)
    example = getattr(model, "example_input_array", None)
    if example is None:
        raise ValueError(
            f"{args.model!r} has no example_input_array: pass --sample-shape (e.g. 2,3,224,224; --sample-dtype "
            "long for token ids)"
        )
    return map_tensors(lambda value: _placed(value, device), example)


def _placed(tensor: Tensor, device: str) -> Tensor:
    if device == "meta":
        return tensor.to("meta")
    if not tensor.is_meta:
        return tensor.to(device)
    if tensor.is_floating_point():
        return torch.randn(tensor.shape, dtype=tensor.dtype, device=device)
    return torch.zeros(tensor.shape, dtype=tensor.dtype, device=device)  # token 0 is valid in any vocabulary


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_gpipe.plan",
        description=(__doc__ or "").split("\n\n")[0].replace("``", ""),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "model",
        help="your model as module:attribute (a LightningModule, its class, or a factory of one), or a zoo model name",
    )
    parser.add_argument(
        "--model-arg", action="append", default=[], metavar="KEY=VALUE", help="an argument of the class or factory"
    )
    parser.add_argument(
        "--module-name", help="attribute of the nn.Sequential to pipeline (GPipeStrategy's module_name)"
    )
    parser.add_argument(
        "--sample-shape",
        help="one input of the first layer, e.g. 1,3,224,224; default: the model's example_input_array",
    )
    parser.add_argument("--sample-dtype", default="float", choices=["float", "long"])
    parser.add_argument("--devices", type=int, required=True, help="processes of the job (Trainer devices x num_nodes)")
    parser.add_argument("--memory", required=True, help="memory per device, e.g. 16GB")
    parser.add_argument(
        "--batch-size",
        type=int,
        required=True,
        help="samples each pipeline reads per step: the DataLoader's batch_size, as GPipeStrategy(plan='auto') takes "
        "it (per pipeline, not per step of the job: with devices / K data-parallel pipelines a step trains on that "
        "many times more)",
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="where to profile")
    parser.add_argument("--optimizer-slots", type=float, default=2.0, help="2 for Adam, 1 for RMSProp or momentum SGD")
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=SCHEDULES)
    parser.add_argument(
        "--virtual-stages",
        type=int,
        nargs="+",
        default=list(DEFAULT_VIRTUAL_STAGES),
        help="the stages per process to weigh for schedule 'interleaved'",
    )
    parser.add_argument(
        "--data-parallel",
        default="auto",
        choices=DATA_PARALLEL_CHOICES,
        help="how the replicas of a stage share it: whole (ddp), sharded (fsdp), or whole unless nothing fits whole "
        "(auto, the default)",
    )
    parser.add_argument("--flops-per-second", type=float, help="time layers from FLOPs instead of measuring them")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the command line, plan, print; the exit status is 0, or 2 when nothing fits."""
    parser = _parser()
    args = parser.parse_args(argv)
    kwargs = {}
    for item in args.model_arg:
        key, sep, text = item.partition("=")
        if not sep:
            parser.error(f"--model-arg {item!r} must be KEY=VALUE")
        kwargs[key] = _value(text)
    device = "meta" if args.flops_per_second else args.device
    try:
        model = build_model(args.model, kwargs)
        plain = isinstance(model, nn.Sequential) and args.module_name is None
        layers = model if plain else find_sequence(model, args.module_name)[1]
        sample = _sample_of(model, args, device)
    except (ValueError, TypeError) as error:
        parser.error(str(error))
    layers.train()
    try:
        result = plan(
            layers,
            sample,
            devices=args.devices,
            memory_per_device=args.memory,
            batch_size=args.batch_size,
            device=device,
            optimizer_slots=args.optimizer_slots,
            schedules=args.schedules,
            virtual_stages=args.virtual_stages,
            flops_per_second=args.flops_per_second,
            per_pipeline_batch=True,
            data_parallel=args.data_parallel,
        )
    except InfeasiblePlanError as error:
        print(error, file=sys.stderr)
        return 2
    print(f"GPipe plan for {args.devices} device(s); to train with it: {result.strategy_code()}")
    print(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
