"""The Trainer every benchmark measures with: it trains and nothing else (no logger, checkpoints, bar or summary)."""

from __future__ import annotations

from typing import Any

__all__ = ["quiet_trainer"]


def quiet_trainer(**settings: Any) -> Any:
    """A ``lightning.Trainer`` with ``settings`` and none of the work around training that would be measured too."""
    import lightning as L  # imported on use: benchmarks that only plan or simulate never load Lightning

    return L.Trainer(
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **settings
    )
