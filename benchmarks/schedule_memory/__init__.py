"""Peak activation memory per stage of the 1F1B schedule against GPipe's fill-drain as M grows."""

__all__: list[str] = []
