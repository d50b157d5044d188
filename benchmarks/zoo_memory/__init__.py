"""Table 1 of the GPipe paper on the zoo's models: the largest model that fits a memory budget, per setting."""

__all__: list[str] = []
