"""Bounded-memory pieces of the dataset gate (:mod:`rlhf_core.data.validate`).

The gate streams a file in chunks of rows: each chunk becomes one pandas frame, validated by the
same Great Expectations suite, and the failures are merged across chunks. Memory then depends on
the chunk size, not the file size, with one exception kept small on purpose: the rows' keys seen so
far, as 16-byte digests (:class:`SeenRows`), so a duplicate is found even chunks apart.

Here: :func:`chunks` (records in lists of ``size``), :class:`SeenRows` (the duplicate index) and
:class:`SuiteRunner` (one GX context and suite, reused for every chunk). Imports GX and pandas
only where used; nothing here reads files.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from itertools import islice
from typing import Any, TypeVar

T = TypeVar("T")

CHUNK_ROWS = 20_000
"""Rows per validated frame: large enough that GX's per-batch overhead is small next to the
work, small enough that a frame of long rows stays far below the memory budget."""


def chunks(items: Iterable[T], size: int) -> Iterator[list[T]]:
    """``items`` in consecutive lists of ``size`` (the last one shorter)."""
    if size < 1:
        raise ValueError(f"chunk size must be >= 1, got {size}")
    it = iter(items)
    while chunk := list(islice(it, size)):
        yield chunk


class SeenRows:
    """Which rows repeat an earlier row's key values, keeping a 16-byte blake2b digest per distinct
    key rather than the rows, so duplicates are found across any number of chunks.

    A row whose key values are all missing is never a duplicate (GX's uniqueness expectations
    ignore such rows too)."""

    def __init__(self) -> None:
        self._seen: set[bytes] = set()

    def __len__(self) -> int:
        return len(self._seen)

    def unique_flags(self, keys: Sequence[tuple[Any, ...]]) -> list[bool]:
        """One flag per row of a chunk, in order: False where the row's key values repeat another row
        of this chunk (every copy, as GX's whole-frame check flags them) or a row of an earlier chunk
        (that copy alone: the earlier chunk is already reported)."""
        digests = [None if all(v is None for v in key) else _digest(key) for key in keys]
        counts = Counter(d for d in digests if d is not None)
        flags = [d is None or (counts[d] == 1 and d not in self._seen) for d in digests]
        self._seen.update(counts)
        return flags


def _digest(key: tuple[Any, ...]) -> bytes:
    # repr tells None from "None" and escapes lone surrogates, which UTF-8 would refuse to encode.
    return hashlib.blake2b(repr(key).encode("utf-8"), digest_size=16).digest()


class SuiteRunner:
    """A Great Expectations suite, set up once (ephemeral context, pandas source, suite) and run on
    one frame per chunk. ``items`` are ``(expectation, field, message)`` as the gate's suites give them."""

    def __init__(self, gx: Any, name: str, items: Sequence[tuple[Any, str, str]]):
        from great_expectations.data_context.types.base import (  # lazy: great_expectations (light CLI start)
            ProgressBarsConfig)

        context = gx.get_context(mode="ephemeral")
        # GX's per-metric progress bars would bury the report on stderr.
        context.variables.progress_bars = ProgressBarsConfig(globally=False)
        asset = context.data_sources.add_pandas(name="alignflow").add_dataframe_asset(name=name)
        self._definition = asset.add_batch_definition_whole_dataframe("all")
        self._suite = gx.ExpectationSuite(name=f"alignflow-{name}")
        for expectation, _, _ in items:
            self._suite.add_expectation(expectation)

    def run(self, df: Any) -> list[Any]:
        """GX results of the suite on ``df``, in the suite's order."""
        batch = self._definition.get_batch(batch_parameters={"dataframe": df})
        result = batch.validate(self._suite, result_format={"result_format": "COMPLETE"})
        return _ordered(result, self._suite)


def _ordered(result: Any, suite: Any) -> list[Any]:
    """Results in the suite's order, matched on expectation type and arguments."""
    def key(cfg: Any) -> tuple[str, str]:
        kwargs = {k: v for k, v in cfg.kwargs.items() if k in ("column", "column_list", "value_set")}
        return cfg.type, repr(sorted(kwargs.items()))

    by_key = {key(r.expectation_config): r for r in result.results}
    return [by_key[key(e.configuration)] for e in suite.expectations]
