"""The build layer: one rank's stage made from the user's module (balance, cut, tied weights, checkpoint names).

It imports the engine only; the planner and the strategy build on it.
"""

__all__: list[str] = []  # nothing re-exported: import from the modules
