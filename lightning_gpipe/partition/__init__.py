"""Partitioning: one rank's stages cut from the user's module (balance, cut, tied weights, checkpoint names).

It imports the engine and the profile; the planner and the strategy build on it.
"""

from lightning_gpipe.partition.balance import balance_by_cost, split
from lightning_gpipe.profile.cost import layer_costs

__all__ = ["balance_by_cost", "layer_costs", "split"]
