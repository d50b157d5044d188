"""The error a pipeline raises when a stage, or the link between two stages, fails."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

__all__ = ["PipelineError", "collective_errors"]


class PipelineError(RuntimeError):
    """A failure inside the pipeline, naming the stage that saw it (and the peer, when one is involved)."""

    def __init__(self, stage: int, message: str) -> None:
        super().__init__(f"[pipeline stage {stage}] {message}")
        self.stage = stage


@contextlib.contextmanager
def collective_errors(stage: int, what: str) -> Iterator[None]:
    """Turn the failure of a collective into a :class:`PipelineError` that names ``stage`` and ``what`` it was doing.

    A collective fails at once (gloo reports a closed connection) when another rank of the group died; the error is
    then only a consequence, and the message says where to look for the cause.
    """
    try:
        yield
    except PipelineError:
        raise
    except RuntimeError as error:
        raise PipelineError(
            stage,
            f"{what} failed: {error}. Another rank of the job probably failed first: look for its error above",
        ) from error
