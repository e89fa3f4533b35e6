"""A wall-clock bound on a block of Python code, in whichever thread runs it.

``signal.alarm`` and ``setitimer`` interrupt only the main thread, and Ray workers and Prefect tasks run
code in other threads; so the bound is a trace function (``sys.settrace``: the current thread's own,
other threads untouched) that reads the clock at every call and generator resume, and at every line of
the frames whose code ``lines_of`` selects, and raises :class:`TimeLimitExceeded` there once the time is
up. That bounds loops and recursion written in Python (a Jinja template compiles to Python). It does not
interrupt one long operation inside C (a huge integer power): that runs to its end before the next check.
The trace function that was set before (a debugger's, coverage's) is put back on exit; inside the block it
is suspended.
"""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from types import CodeType
from typing import Any, Callable, Iterator


class TimeLimitExceeded(Exception):
    """The block ran past its time limit (raised inside it, at the next check)."""


def _all_code(code: CodeType) -> bool:
    del code
    return True


@contextmanager
def time_limit(seconds: float, lines_of: Callable[[CodeType], bool] = _all_code) -> Iterator[None]:
    """Raise :class:`TimeLimitExceeded` inside the block once it has run ``seconds`` (wall clock).

    ``lines_of(code)`` picks the frames whose every line is a check (a loop that calls nothing is caught
    only there); every other frame is checked at its calls only, which keeps tracing cheap."""
    deadline = time.monotonic() + seconds

    def check() -> None:
        if time.monotonic() > deadline:
            raise TimeLimitExceeded(f"still running after {seconds:g} s")

    def local(frame: Any, event: str, arg: Any) -> Any:
        del frame, arg
        if event == "line":
            check()
        return local

    def on_call(frame: Any, event: str, arg: Any) -> Any:
        del event, arg
        check()
        return local if lines_of(frame.f_code) else None

    previous = sys.gettrace()
    sys.settrace(on_call)
    try:
        yield
    finally:
        sys.settrace(previous)
