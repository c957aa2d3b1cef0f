"""Value checks: one home for the small rules every config, flag and request shares.

Each raises :class:`~tinylm.core.errors.ConfigError` (or the error class a caller names)
with one line that says which value was wrong and what was expected. A bool is never
taken for a number (``True`` is an int to Python, never to a user): :func:`is_int` and
:func:`is_number` are that rule alone, for callers whose messages are their own (the
HTTP API's, say).
"""

from __future__ import annotations

import math
from typing import Any

from tinylm.core.errors import ConfigError, TinyLMError


def is_int(value: Any) -> bool:
    """Whether ``value`` is an integer (a bool is not)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any, *, finite: bool = False) -> bool:
    """Whether ``value`` is an int or a float (a bool is not); with ``finite``, not NaN
    or infinite either (every int is finite, however large)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    return ok and (not finite or isinstance(value, int) or math.isfinite(value))


def check_int(name: str, value: Any, minimum: int | None = 1, maximum: int | None = None, *,
              error: type[TinyLMError] = ConfigError, hint: str = "") -> int:
    """``value`` if it is an integer in [minimum, maximum] (either bound may be None)."""
    ok = is_int(value) and (minimum is None or value >= minimum)
    ok = ok and (maximum is None or value <= maximum)
    if not ok:
        if minimum is not None and maximum is not None:
            what = f"an integer in [{minimum}, {maximum}]"
        elif minimum is not None:
            what = f"an integer >= {minimum}"
        else:
            what = "an integer" if maximum is None else f"an integer <= {maximum}"
        raise error(f"{name} must be {what}, got {value!r}{'; ' + hint if hint else ''}")
    return value


def check_fraction(name: str, value: Any, *, low: float = 0.0, high: float = 1.0,
                   high_open: bool = True, low_open: bool = False,
                   error: type[TinyLMError] = ConfigError, hint: str = "") -> float:
    """``value`` if it is a number in [low, high) (or the bounds ``*_open`` asks for)."""
    ok = is_number(value) and not (isinstance(value, float) and math.isnan(value))
    ok = ok and (low < value if low_open else low <= value)
    ok = ok and (value < high if high_open else value <= high)
    if not ok:
        left, right = "(" if low_open else "[", ")" if high_open else "]"
        raise error(f"{name} must be a number in {left}{low}, {high}{right}, got {value!r}"
                    f"{'; ' + hint if hint else ''}")
    return value


def check_positive(name: str, value: Any, *, allow_zero: bool = False,
                   error: type[TinyLMError] = ConfigError) -> float:
    """``value`` if it is a finite number > 0 (>= 0 with ``allow_zero``)."""
    ok = is_number(value, finite=True)
    ok = ok and (value >= 0 if allow_zero else value > 0)
    if not ok:
        what = "a finite number >= 0" if allow_zero else "a finite number > 0"
        raise error(f"{name} must be {what}, got {value!r}")
    return value
