"""Read user datasets (JSONL, JSON, parquet, a saved ``datasets`` folder) with provenance.

Every record carries the 1-based line (JSONL) or row (parquet, datasets) it came from in
``Record.line``, so every later error — a broken JSON line, a missing field, a failed
expectation — can name the file, the line and the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping


class DataError(ValueError):
    """A dataset problem located at ``path:line`` (line 0 = the whole file), optionally a field."""

    def __init__(self, path: str | Path, line: int, message: str, field: str | None = None):
        self.path, self.line, self.field, self.message = str(path), line, field, message
        where = f"{path}:{line}" if line else f"{path}"
        what = f" field '{field}':" if field else ""
        super().__init__(f"{where}:{what} {message}")


@dataclass(frozen=True)
class Record:
    """One example and where it came from."""

    data: Mapping[str, Any]
    line: int

    def __getitem__(self, key: str) -> Any:
        return self.data[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.data.get(key, default)


def _iter_jsonl(path: Path) -> Iterator[Record]:
    with path.open("rb") as fh:  # decoded per line, so a bad byte is reported with its line
        for lineno, raw_bytes in enumerate(fh, start=1):
            try:
                raw = raw_bytes.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(path, lineno, f"not UTF-8 text (byte 0x{raw_bytes[exc.start]:02x} at column "
                                              f"{exc.start + 1})") from None
            text = raw.strip()
            if not text:
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as exc:
                raise DataError(path, lineno, f"not valid JSON ({exc.msg} at column {exc.colno})") from None
            if not isinstance(obj, dict):
                raise DataError(path, lineno, f"expected a JSON object, got {type(obj).__name__}")
            yield Record(obj, lineno)


def _iter_json_array(path: Path) -> Iterator[Record]:
    try:
        rows = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise DataError(path, exc.lineno, f"not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(rows, list):
        raise DataError(path, 0, "a .json dataset must be an array of objects")
    for i, obj in enumerate(rows, start=1):
        if not isinstance(obj, dict):
            raise DataError(path, i, f"expected a JSON object, got {type(obj).__name__}")
        yield Record(obj, i)


def _iter_parquet(path: Path) -> Iterator[Record]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises several types for corrupt files
        raise DataError(path, 0, f"not a readable parquet file ({exc})") from None
    for i, obj in enumerate(table.to_pylist(), start=1):
        yield Record(obj, i)


def _iter_datasets_dir(path: Path) -> Iterator[Record]:
    import datasets

    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise DataError(path, 0, f"DatasetDict without a 'train' split (has {list(ds)})")
        ds = ds["train"]
    for i, obj in enumerate(ds, start=1):
        yield Record(obj, i)


def iter_records(path: str | Path) -> Iterator[Record]:
    """Yield records of a dataset file or folder, by suffix: .jsonl, .json, .parquet, folder."""
    path = Path(path)
    if not path.exists():
        raise DataError(path, 0, "file not found")
    if path.is_dir():
        return _iter_datasets_dir(path)
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".ndjson"):
        return _iter_jsonl(path)
    if suffix == ".json":
        return _iter_json_array(path)
    if suffix in (".parquet", ".pq"):
        return _iter_parquet(path)
    raise DataError(path, 0, f"unsupported dataset format {suffix!r} (use .jsonl, .json, .parquet or a datasets folder)")


def read_records(path: str | Path, limit: int | None = None) -> list[Record]:
    """All records of a dataset (or the first ``limit``)."""
    out: list[Record] = []
    for rec in iter_records(path):
        out.append(rec)
        if limit is not None and len(out) >= limit:
            break
    return out


def require_str(rec: Record, field: str, path: str | Path) -> str:
    """A non-empty string field of a record, or a DataError naming file, line and field."""
    if field not in rec.data:
        raise DataError(path, rec.line, "missing", field)
    value = rec.data[field]
    if not isinstance(value, str):
        raise DataError(path, rec.line, f"expected a string, got {type(value).__name__}", field)
    if not value.strip():
        raise DataError(path, rec.line, "empty string", field)
    return value
