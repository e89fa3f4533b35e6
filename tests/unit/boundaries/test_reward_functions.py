"""The reward-function boundary: a ``file.py:name`` spec (:func:`rlhf_core.rewards.sources.load_function`) and what
the function returns (:func:`rlhf_core.rewards.sources.validate_rewards`).

Any spec string, whatever its file holds (nothing, a directory, bytes, a syntax error, a name that is not
callable), either loads a callable or is refused with a :class:`rlhf_core.rewards.sources.RewardError` that quotes
the spec; any return value (wrong length, None, strings, bools, NaN, infinities, integers past float's range
or past ``str``'s digit limit, numpy arrays, torch tensors) either becomes one finite float per sample or is
refused with a RewardError naming the reward function. Nothing else is raised.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from hypothesis import example, given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from rlhf_core.rewards.sources import RewardError, load_function, validate_rewards

WHERE = "reward function score in /r/reward.py"
SOURCES = {"callable": b"def score(p, c, y):\n    return [1.0] * len(p)\n", "not_callable": b"score = 3\n",
           "syntax": b"def score(:\n", "nul": b"def score(p, c, y):\x00\n", "binary": b"\xff\xfe\x00\x01",
           "raises": b"raise ValueError('boom at import')\n", "empty": b""}


@st.composite
def specs(draw, root):
    """A spec of a file made under ``root`` (any kind above, a directory, or nothing) or arbitrary text."""
    kind = draw(st.sampled_from([*SOURCES, "directory", "missing", "text"]))
    if kind == "text":
        return draw(st.text(max_size=40))
    name = draw(st.sampled_from(["r.py", "r.txt", "r", "dir.py", "~nouser_pconf/r.py", "a\x00.py", "x" * 300 + ".py"]))
    path = root / name
    if kind in SOURCES and "\x00" not in name and "~" not in name and len(name) < 255:
        path.write_bytes(SOURCES[kind])
    elif kind == "directory" and "\x00" not in name and "~" not in name and len(name) < 255:
        path.mkdir(exist_ok=True)
    function = draw(st.sampled_from(["score", "missing", "", "__name__", "a:b"]) | st.text(max_size=6))
    return f"{name if name.startswith('~') else path}{draw(st.sampled_from([':', '', '::']))}{function}"


@given(data=st.data())
@example(data=None).via("a NUL byte ('a\\x00.py:f'): ValueError from Path.exists")
def test_a_spec_loads_a_callable_or_is_refused_quoting_it(tmp_path_factory, data):
    if data is None:
        specs_to_try = ["a\x00.py:f", "~nouser_pconf/r.py:f", "x" * 5000 + ".py:f"]  # the 2nd: RuntimeError,
    else:  # the 3rd: OSError (file name too long)
        specs_to_try = [data.draw(specs(tmp_path_factory.mktemp("rewards")))]
    for spec in specs_to_try:
        try:
            path, name, function = load_function(spec)
        except RewardError as exc:
            assert str(exc).startswith(f"reward function {spec!r}: ")
            continue
        assert callable(function) and spec.endswith(f":{name}") and path.suffix == ".py"


finite = st.floats(allow_nan=False, allow_infinity=False)
reward_items = st.one_of(finite, st.floats(), st.integers(), st.integers(min_value=10 ** 300, max_value=10 ** 320),
                         st.booleans(), st.none(), st.text(max_size=5), st.lists(finite, max_size=2),
                         st.just(5000).map(lambda digits: -10 ** digits),  # built lazily: hypothesis's repr
                         # of a strategy that holds an int past str()'s digit limit raises ValueError
                         st.sampled_from([10 ** 400, np.float32(1.5), np.int64(3), np.float64("nan"),
                                          torch.tensor(1.0), object()]))
returns = st.one_of(st.lists(reward_items, max_size=5), st.tuples(reward_items, reward_items), st.none(),
                    st.text(max_size=5), st.binary(max_size=5), st.dictionaries(st.text(max_size=2), finite, max_size=2),
                    finite, arrays(np.float64, st.integers(0, 5)), arrays(np.float32, (2, 2), elements=st.floats(width=32)),
                    st.lists(finite, max_size=5).map(torch.tensor))


@given(values=returns, n=st.integers(0, 5))
@example(values=[10 ** 400], n=1).via("past float's range")
@example(values=[-10 ** 5000], n=1).via("past str()'s digit limit: ValueError quoting it")
@example(values=np.array([1.0, np.inf]), n=2)
def test_a_return_value_is_n_finite_floats_or_refused_naming_the_function(values, n):
    try:
        out = validate_rewards(values, n, WHERE)
    except RewardError as exc:
        assert str(exc).startswith(f"{WHERE}: ")
        return
    assert len(out) == n and all(type(v) is float and math.isfinite(v) for v in out)
