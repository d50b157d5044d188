"""The error a pipeline raises when a stage, or the link between two stages, fails."""

from __future__ import annotations

__all__ = ["PipelineError"]


class PipelineError(RuntimeError):
    """A failure inside the pipeline, naming the stage that saw it (and the peer, when one is involved)."""

    def __init__(self, stage: int, message: str) -> None:
        super().__init__(f"[pipeline stage {stage}] {message}")
        self.stage = stage
