"""Profiling: what each layer of a sequence costs in time and bytes, measured for the balance and the planner.

It imports the engine only.
"""

from lightning_gpipe.profile.cost import layer_costs
from lightning_gpipe.profile.layer_profile import LayerProfile, ModelProfile, profile_layers

__all__ = ["LayerProfile", "ModelProfile", "layer_costs", "profile_layers"]
