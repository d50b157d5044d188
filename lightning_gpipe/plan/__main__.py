"""``python -m lightning_gpipe.plan``: plan a zoo model (built on the meta device) for a device count and budget.

Example::

    python -m lightning_gpipe.plan transformer_lm --model-arg num_layers=24 --sample-shape 1,1024 \
        --sample-dtype long --devices 8 --memory 16GB --batch-size 32

Prints the plan's table; exits with status 2 and the planner's answer when nothing fits.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Sequence

import torch

from lightning_gpipe.plan import InfeasiblePlanError, plan

__all__ = ["main"]


def _value(text: str) -> object:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the command line, plan, print; the exit status is 0, or 2 when nothing fits."""
    parser = argparse.ArgumentParser(prog="python -m lightning_gpipe.plan", description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a zoo model name (zoo.list_models())")
    parser.add_argument("--model-arg", action="append", default=[], metavar="KEY=VALUE", help="a constructor argument")
    parser.add_argument("--sample-shape", required=True, help="one input of the first layer, e.g. 1,3,224,224")
    parser.add_argument("--sample-dtype", default="float", choices=["float", "long"])
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--memory", required=True, help="memory per device, e.g. 16GB")
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="where to profile")
    parser.add_argument("--optimizer-slots", type=float, default=2.0, help="2 for Adam, 1 for RMSProp or momentum SGD")
    parser.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b"])
    parser.add_argument("--flops-per-second", type=float, help="time layers from FLOPs instead of measuring them")
    args = parser.parse_args(argv)

    import zoo

    kwargs = {}
    for item in args.model_arg:
        key, sep, text = item.partition("=")
        if not sep:
            parser.error(f"--model-arg {item!r} must be KEY=VALUE")
        kwargs[key] = _value(text)
    with torch.device("meta"):
        model = zoo.create_model(args.model, **kwargs)
    model.train()
    shape = tuple(int(size) for size in args.sample_shape.split(","))
    device = "meta" if args.flops_per_second else args.device
    if args.sample_dtype == "long":
        sample = torch.zeros(shape, dtype=torch.long, device=device)  # token 0 is valid in any vocabulary
    else:
        sample = torch.randn(shape, device=device) if device != "meta" else torch.empty(shape, device="meta")
    try:
        result = plan(
            model,
            sample,
            devices=args.devices,
            memory_per_device=args.memory,
            batch_size=args.batch_size,
            device=device,
            optimizer_slots=args.optimizer_slots,
            schedules=args.schedules,
            flops_per_second=args.flops_per_second,
        )
    except InfeasiblePlanError as error:
        print(error, file=sys.stderr)
        return 2
    print(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
