"""Draw every schedule's simulated timeline into ``docs/img/schedules_<name>.png`` for the schedules page.

Each process takes 1 time unit per micro-batch forward and 2 per backward (1 for the input gradient I and 1 for the
weight gradient W where the schedule splits it), shared evenly by the stages it holds; transfers are free. The
charts are :func:`~lightning_gpipe.plan.simulate.simulate_step`'s spans, so they show exactly what the planner
predicts. Run ``python -m benchmarks.schedules_pictures [--out docs/img] [--processes 4] [--chunks 8]``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from lightning_gpipe.engine.schedule import Phase, stages_of
from lightning_gpipe.plan.simulate import SimulatedStep, simulate_step

# (schedule, virtual_stages, title) of every picture, in the page's order.
SCHEDULES = [
    ("gpipe", 1, "GPipe (fill-drain)"),
    ("1f1b", 1, "1F1B"),
    ("interleaved", 2, "Interleaved 1F1B, v = 2"),
    ("zero_bubble", 1, "Zero bubble ZB-H1"),
    ("zbv", 1, "ZB-V"),
]
COLOURS = {Phase.FORWARD: "#4C72B0", Phase.BACKWARD: "#DD8452", Phase.INPUT: "#C44E52", Phase.WEIGHT: "#55A868"}
NAMES = {
    Phase.FORWARD: "F forward",
    Phase.BACKWARD: "B backward",
    Phase.INPUT: "I input grad",
    Phase.WEIGHT: "W weight grad",
}


def simulate(schedule: str, v: int, K: int, M: int) -> SimulatedStep:
    """The step on K equal processes: forward 1, backward 2 (I 1, W 1) per micro-batch and process."""
    per = len(stages_of(schedule, 0, K, v))
    n = K * per
    return simulate_step(schedule, [1 / per] * n, [2 / per] * n, M, weight=[1 / per] * n, virtual_stages=v)


def draw(step: SimulatedStep, schedule: str, v: int, title: str, path: Path) -> Path:
    """One Gantt chart: a row per process, a bar per action labelled with its micro-batch; later stages hatched."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    K = step.num_stages
    figure = Figure(figsize=(12.0, 1.3 + 0.45 * K), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    phases: set[Phase] = set()
    for r, spans in enumerate(step.spans):
        held = stages_of(schedule, r, K, v)
        for span in spans:
            action = span.action
            phases.add(action.phase)
            hatch = "//" if len(held) > 1 and action.stage != held[0] else None
            axes.barh(r, span.end - span.start, left=span.start, height=0.8, color=COLOURS[action.phase],
                      edgecolor="white", lw=0.5, hatch=hatch)  # fmt: skip
            if span.end - span.start >= 0.3:
                axes.text((span.start + span.end) / 2, r, str(action.microbatch), ha="center", va="center",
                          fontsize=6, color="white")  # fmt: skip
    axes.set_yticks(range(K), [f"process {r}" for r in range(K)])
    axes.set_ylim(K - 0.5, -0.5)
    axes.set_xlim(0.0, step.makespan)
    axes.set_xlabel("time (one forward of one micro-batch on one process = 1)")
    axes.set_title(f"{title}: K = {K}, M = {step.num_microbatches}, bubble {step.bubble:.1%}", fontsize=10)
    handles = [Patch(color=COLOURS[p], label=NAMES[p]) for p in COLOURS if p in phases]
    if any(len(stages_of(schedule, r, K, v)) > 1 for r in range(K)):
        handles.append(Patch(facecolor="grey", hatch="//", edgecolor="white", label="the process's later stage"))
    axes.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=len(handles), frameon=False,
                fontsize=8)  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png", bbox_inches="tight")
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/img"))
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--chunks", type=int, default=8)
    args = parser.parse_args(argv)
    for schedule, v, title in SCHEDULES:
        step = simulate(schedule, v, args.processes, args.chunks)
        path = draw(step, schedule, v, title, args.out / f"schedules_{schedule}.png")
        print(f"{path}: bubble {step.bubble:.3f}, makespan {step.makespan:g}")


if __name__ == "__main__":
    main()
