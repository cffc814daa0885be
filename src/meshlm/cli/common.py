"""What several commands share."""

from __future__ import annotations


def require_extra(extra: str, *modules: str) -> None:
    """Raise ValueError naming the pip extra that brings `modules` when one of them is missing."""
    import importlib.util

    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise ValueError(f"this command needs {', '.join(missing)} (the [{extra}] extra): "
                         f"pip install -e \".[{extra}]\" (or pip install meshlm[{extra}])")
