"""Deprecated: ``lightning_gpipe.build`` is now :mod:`lightning_gpipe.partition` and :mod:`lightning_gpipe.profile`.

Its module paths keep working for one release, with a :class:`DeprecationWarning`.
"""

import importlib
import sys
import warnings

_MOVED = {
    **{name: f"lightning_gpipe.partition.{name}" for name in (
        "assembly", "balance", "compile", "config", "sequence", "state_dict", "tied"
    )},
    **{name: f"lightning_gpipe.profile.{name}" for name in ("cost", "layer_run", "tensor_bytes", "timing")},
    "profile": "lightning_gpipe.profile.layer_profile",
}  # fmt: skip

warnings.warn(
    "lightning_gpipe.build is deprecated: import from lightning_gpipe.partition (cutting the model) or "
    "lightning_gpipe.profile (measuring layers)",
    DeprecationWarning,
    stacklevel=2,
)
for _old, _new in _MOVED.items():
    sys.modules[f"{__name__}.{_old}"] = importlib.import_module(_new)

__all__: list[str] = []
