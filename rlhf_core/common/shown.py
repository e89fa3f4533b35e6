"""How an error message quotes a value it was handed: :func:`shown`, a bounded ``repr`` that never raises.

``str``, ``repr`` and :mod:`reprlib` all raise ``ValueError`` on an integer past Python's 4300-digit
conversion limit, and a user's object may raise from its own ``__repr__``; a message that quotes such a value
must still be written. :mod:`reprlib` is the library here: it clips strings, containers and deep nesting.
This module imports nothing from ``rlhf_core``.
"""

from __future__ import annotations

import reprlib
from typing import Any


def shown(value: Any, limit: int = 80) -> str:
    """``repr(value)`` clipped to about ``limit`` characters by :mod:`reprlib` (containers to a few items and
    levels); a value no ``repr`` can print is named by its type."""
    clip = reprlib.Repr()
    clip.maxstring = clip.maxother = limit
    try:
        return clip.repr(value)
    except ValueError:  # an int past Python's digit limit for str(), at any depth
        return f"<{type(value).__name__} too large to show>"
    except Exception as exc:  # noqa: BLE001 - a value's own __repr__ may raise anything
        return f"<a {type(value).__name__} whose repr() raised {type(exc).__name__}>"


def shown_error(exc: BaseException, limit: int = 300) -> str:
    """``Type: text`` of an exception, its text clipped to ``limit`` characters; where ``str(exc)`` raises (an
    argument past the digit limit, a broken ``__str__``), its arguments as :func:`shown` quotes them."""
    try:
        text = str(exc)[:limit]
    except Exception:  # noqa: BLE001 - any exception a user's code raised
        text = shown(exc.args, limit)
    return f"{type(exc).__name__}: {text}"
