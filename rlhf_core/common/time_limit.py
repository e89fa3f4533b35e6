"""A wall-clock bound, and a bound on nesting, for a block of Python code, in whichever thread runs it.

``signal.alarm`` and ``setitimer`` interrupt only the main thread, and Ray workers and Prefect tasks run
code in other threads; so the bound is a trace function (``sys.settrace``: the current thread's own,
other threads untouched) that reads the clock at every call and generator resume, and at every line of
the frames whose code ``lines_of`` selects, and raises :class:`TimeLimitExceeded` there once the time is
up. That bounds loops and recursion written in Python (a Jinja template compiles to Python). Nesting of the
selected frames past ``max_depth`` is refused the same way, long before Python's own recursion limit: a
RecursionError deep in a thread's stack can also strike the clean-up code that runs there (a generator's
``close``, an unraisable-exception hook), where it cannot be caught. It does not
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
    """The block ran past its time limit or nested past its depth limit (raised inside it, at the next check)."""


def _all_code(code: CodeType) -> bool:
    del code
    return True


@contextmanager
def time_limit(seconds: float, lines_of: Callable[[CodeType], bool] = _all_code,
               max_depth: int = 10_000) -> Iterator[None]:
    """Raise :class:`TimeLimitExceeded` inside the block once it has run ``seconds`` (wall clock), or once
    more than ``max_depth`` frames that ``lines_of`` picks are active at once.

    ``lines_of(code)`` picks the frames whose every line is a check (a loop that calls nothing is caught
    only there); every other frame is checked at its calls only, which keeps tracing cheap."""
    deadline = time.monotonic() + seconds
    depth = 0

    def check() -> None:
        if time.monotonic() > deadline:
            raise TimeLimitExceeded(f"still running after {seconds:g} s")

    def local(frame: Any, event: str, arg: Any) -> Any:
        nonlocal depth
        del frame, arg
        if event == "line":
            check()
        elif event == "return":  # a return, a raise or a generator's yield leaves the frame
            depth -= 1
        return local

    def on_call(frame: Any, event: str, arg: Any) -> Any:  # a call, or a generator's resume
        nonlocal depth
        del event, arg
        check()
        if not lines_of(frame.f_code):
            return None
        if depth >= max_depth:
            raise TimeLimitExceeded(f"nested more than {max_depth} calls deep")
        depth += 1
        return local

    previous = sys.gettrace()
    sys.settrace(on_call)
    try:
        yield
    finally:
        sys.settrace(previous)
