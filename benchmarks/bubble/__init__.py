"""The bubble of the GPipe schedule: measured idle fraction of real pipeline steps against (K-1)/(M+K-1)."""

__all__: list[str] = []
