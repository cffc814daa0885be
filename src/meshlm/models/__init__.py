"""Plain single-device PyTorch models; parallelism is applied to them as transforms (meshlm.parallel).

`meshlm.models.stats` (exact parameter counts and FLOPs of these models) is arithmetic on the config alone
and imports no torch, so the planner can use it on a machine without torch: the torch classes below are
imported on first use (PEP 562), not when the package is.
"""

import importlib

_HOMES = {"MoE": "meshlm.models.moe", "KVCache": "meshlm.models.transformer",
          "Transformer": "meshlm.models.transformer", "build_model": "meshlm.models.transformer",
          "init_weights": "meshlm.models.transformer"}

__all__ = ["KVCache", "MoE", "Transformer", "build_model", "init_weights"]


def __getattr__(name: str):
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'meshlm.models' has no attribute {name!r}")
