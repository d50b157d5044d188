"""The planner's predictions of peak memory per stage and step time against measurement on this machine."""

__all__: list[str] = []
