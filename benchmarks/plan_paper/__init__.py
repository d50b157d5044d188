"""The GPipe paper's Tables 1 and 2 replayed by the planner's simulator from profiles of the paper-sized models."""

__all__: list[str] = []
