"""The planner: K, M, balance, re-materialization, schedule and data parallelism for a model, a device count and a
memory budget.

:func:`plan` (:mod:`~lightning_gpipe.plan.search`) profiles the model's layers, weighs every configuration the devices
allow (:func:`evaluate`: each process's peak memory, :mod:`~lightning_gpipe.plan.memory`, and the step time,
:mod:`~lightning_gpipe.plan.simulate`; whole or sharded replicas, :mod:`~lightning_gpipe.plan.sharding`) and keeps the
fastest that fits. The :class:`Plan`
(:mod:`~lightning_gpipe.plan.result`) says what to set, what to expect and why; a request that nothing fits raises
:class:`InfeasiblePlanError` naming the smallest device count and the smallest memory per device that would work.
``GPipeStrategy(plan="auto")`` runs it at setup (:mod:`~lightning_gpipe.plan.auto`).
"""

from lightning_gpipe.plan.evaluate import (
    DEFAULT_BANDWIDTH,
    DEFAULT_BOUNDARY_OVERHEAD,
    DEFAULT_LATENCY,
    DEFAULT_MICROBATCH_OVERHEAD,
    DEFAULT_REMATERIALIZATION_OVERHEAD,
    evaluate,
)
from lightning_gpipe.plan.memory import StageMemory, stage_memory
from lightning_gpipe.plan.result import Candidate, InfeasiblePlanError, Plan, parse_bytes
from lightning_gpipe.plan.search import DEFAULT_VIRTUAL_STAGES, plan
from lightning_gpipe.profile.layer_profile import LayerProfile, ModelProfile, profile_layers

from lightning_gpipe.plan.auto import AutoPlan  # isort: skip  (it imports the planner's modules above)

__all__ = [
    "DEFAULT_BANDWIDTH",
    "DEFAULT_BOUNDARY_OVERHEAD",
    "DEFAULT_LATENCY",
    "DEFAULT_MICROBATCH_OVERHEAD",
    "DEFAULT_REMATERIALIZATION_OVERHEAD",
    "DEFAULT_VIRTUAL_STAGES",
    "AutoPlan",
    "Candidate",
    "InfeasiblePlanError",
    "LayerProfile",
    "ModelProfile",
    "Plan",
    "StageMemory",
    "evaluate",
    "parse_bytes",
    "plan",
    "profile_layers",
    "stage_memory",
]
