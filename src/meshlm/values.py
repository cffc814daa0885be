"""What counts as a number where a user passes one to a public entry point (`SamplingParams`, `LLM`, the planner's
`estimate` / `plan`, `ModelConfig.validate`): one definition, so that numpy's numbers are taken everywhere and a bool
nowhere (True is an int to Python, and `top_k=True` would quietly be 1).

Not responsible for: the ranges (each caller says what its value must be), or the HTTP API's JSON numbers
(`infer/requests.py`, where a JSON value has only Python's types).
"""

from __future__ import annotations

import math
import numbers


def is_integer(value) -> bool:
    """An integer (Python's or numpy's), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_whole_number(value) -> bool:
    """An integer, or a finite real that is one (3.0)."""
    return is_integer(value) or (is_finite_real(value) and float(value).is_integer())


def is_finite_real(value) -> bool:
    """A finite real number (an int or a float, Python's or numpy's), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
