"""Read user datasets (JSONL, JSON, parquet, a folder) with provenance.

Every record carries the 1-based line (JSONL) or row (parquet, datasets) it came from in
``Record.line``, so every later error — a broken JSON line, a missing field, a failed
expectation — can name the file, the line and the field.

A folder is either a ``datasets`` folder written by ``save_to_disk`` (read with
``datasets.load_from_disk``) or a folder in the Hugging Face Hub's dataset layout: a dataset
card (``README.md``) and parquet / JSON Lines shards, e.g. ``data/train-00000-of-00002.parquet``
or ``train.jsonl``. The train split's shards are found the way ``datasets.load_dataset(folder)``
finds them (the card's ``configs:`` and the split naming patterns), then read here, shard by
shard, so an error names the shard and its line (``Record.source``). Loading scripts are
refused: they run arbitrary code, and ``datasets`` 4 dropped them.
"""

from __future__ import annotations

import json
import logging
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from rlhf_core.config import MAX_LINE_BYTES  # re-exported: the readers' default, a config default too


def json_problem(exc: json.JSONDecodeError) -> str:
    """``Unterminated string starting at column 7``: the decoder's message with its column, read as one
    phrase (some messages already end in "at")."""
    joiner = " " if exc.msg.endswith(" at") else " at "
    return f"{exc.msg}{joiner}column {exc.colno}"


class DataError(ValueError):
    """A dataset problem located at ``path:line`` (line 0 = the whole file), optionally a field."""

    def __init__(self, path: str | Path, line: int, message: str, field: str | None = None):
        self.path, self.line, self.field, self.message = str(path), line, field, message
        where = f"{path}:{line}" if line else f"{path}"
        what = f" field '{field}':" if field else ""
        super().__init__(f"{where}:{what} {message}")


@dataclass(frozen=True)
class Record:
    """One example and where it came from: ``line`` in ``source``, the shard of a Hub-layout
    folder (``None``: the file or ``datasets`` folder the caller opened)."""

    data: Mapping[str, Any]
    line: int
    source: str | None = None

    def where(self, path: str | Path) -> str:
        """The file to name in an error about this record: its shard, else ``path``."""
        return self.source or str(path)

    def __getitem__(self, key: str) -> Any:
        return self.data[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.data.get(key, default)


def _open(path: Path) -> BinaryIO:
    """``path`` opened for reading, or a DataError naming the file and why it cannot be read."""
    try:
        return path.open("rb")
    except OSError as exc:  # permission denied, a directory, a vanished file
        raise DataError(path, 0, f"cannot be read ({(exc.strerror or type(exc).__name__).lower()})") from None


def _iter_jsonl(path: Path, max_line_bytes: int = MAX_LINE_BYTES) -> Iterator[Record]:
    with _open(path) as fh:  # decoded per line, so a bad byte is reported with its line
        lineno = 0
        # At most max_line_bytes + 1 bytes per read: an endless line is refused, never held whole.
        while raw_bytes := fh.readline(max_line_bytes + 1):
            lineno += 1
            if len(raw_bytes) > max_line_bytes and not raw_bytes.endswith(b"\n"):
                raise DataError(path, lineno, f"line longer than {max_line_bytes} bytes, refused before parsing "
                                              "(the max_line_bytes setting)")
            try:
                raw = raw_bytes.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(path, lineno, f"not UTF-8 text (byte 0x{raw_bytes[exc.start]:02x} at column "
                                              f"{exc.start + 1})") from None
            text = raw.strip()
            if not text:
                continue
            obj = _parse_json(text, path, lineno)
            if not isinstance(obj, dict):
                raise DataError(path, lineno, f"expected a JSON object, got {type(obj).__name__}")
            _refuse_lone_surrogates(obj, text, path, lineno)
            yield Record(obj, lineno)


def _iter_json_array(path: Path) -> Iterator[Record]:
    with _open(path) as fh:  # one JSON document: parsed whole
        data = fh.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise DataError(path, line, f"not UTF-8 text (byte 0x{data[exc.start]:02x})") from None
    rows = _parse_json(text, path, 0)
    if not isinstance(rows, list):
        raise DataError(path, 0, "a .json dataset must be an array of objects")
    for i, obj in enumerate(rows, start=1):
        if not isinstance(obj, dict):
            raise DataError(path, i, f"expected a JSON object, got {type(obj).__name__}")
        _refuse_lone_surrogates(obj, text, path, i)
        yield Record(obj, i)


def _parse_json(text: str, path: Path, line: int) -> Any:
    """``text`` parsed, or a DataError naming the file and ``line`` (0: the decoder's line, where it
    gives one): broken JSON, an integer longer than Python converts (``sys.get_int_max_str_digits``),
    nesting deeper than the recursion limit."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise DataError(path, line or exc.lineno, f"not valid JSON ({json_problem(exc)})") from None
    except RecursionError:
        raise DataError(path, line, "not readable JSON (nested deeper than Python's recursion limit)") from None
    except ValueError as exc:  # the integer-string conversion limit
        raise DataError(path, line, f"not readable JSON ({str(exc).split(';')[0]})") from None


def _refuse_lone_surrogates(obj: dict, text: str, path: Path, line: int) -> None:
    """A DataError naming file, line and field when a string of ``obj`` (a key or a value, at any depth)
    holds a lone surrogate: JSON's ``\\ud800`` escape decodes to one, UTF-8 cannot encode it, so
    every later write of the text would fail. Only a ``\\u`` escape in ``text`` can make one."""
    if "\\u" not in text:
        return
    for key, value in obj.items():
        stack = [key, value]
        while stack:  # iterative: the decoder's nesting may be near the recursion limit
            item = stack.pop()
            if isinstance(item, dict):
                stack += [*item.keys(), *item.values()]
            elif isinstance(item, list):
                stack += item
            elif isinstance(item, str) and not item.isascii():
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError as exc:
                    raise DataError(path, line, f"a lone surrogate ({item[exc.start]!a}) is not Unicode text",
                                    key.encode("utf-8", "backslashreplace").decode("utf-8")) from None


def _iter_parquet(path: Path) -> Iterator[Record]:
    import pyarrow.parquet as pq  # lazy: pyarrow (parquet inputs only)

    line = 0
    with _open(path) as fh:  # an unreadable file is named as such, not as a corrupt one
        try:  # batch by batch: a large file is never one table in memory
            for batch in pq.ParquetFile(fh).iter_batches(batch_size=PARQUET_BATCH_ROWS):
                for obj in batch.to_pylist():
                    line += 1
                    yield Record(obj, line)
        except Exception as exc:  # pyarrow raises several types for corrupt files
            raise DataError(path, 0, f"not a readable parquet file ({exc})") from None


PARQUET_BATCH_ROWS = 8192
"""Rows decoded at a time from a parquet file."""


def _iter_datasets_dir(path: Path) -> Iterator[Record]:
    import datasets  # lazy: datasets (Arrow folders only)

    if _saved_empty(path):
        return
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as exc:  # a damaged folder: missing, corrupt or unreadable files, arrow errors
        reason = f"no {exc} entry" if isinstance(exc, KeyError) else " ".join(str(exc).split())
        raise DataError(path, 0, f"not a readable datasets folder ({reason})") from None
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise DataError(path, 0, f"DatasetDict without a 'train' split (has {list(ds)})")
        ds = ds["train"]
    for i, obj in enumerate(ds, start=1):
        yield Record(obj, i)


def _saved_empty(path: Path) -> bool:
    """Whether ``path`` holds a ``Dataset.save_to_disk`` of no rows: its ``state.json`` lists no data
    files, and ``datasets.load_from_disk`` cannot load such a folder back."""
    try:
        state = json.loads((path / "state.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):  # absent or damaged: load_from_disk reports it
        return False
    return isinstance(state, dict) and state.get("_data_files") == []


def is_saved_dataset(path: Path) -> bool:
    """Whether ``path`` is a folder ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk`` wrote."""
    return (path / "state.json").is_file() or (path / "dataset_dict.json").is_file()


def hub_train_files(path: str | Path) -> list[Path]:
    """The train split's data files of a folder in the Hub's dataset layout, as
    ``datasets.load_dataset(path)`` resolves them (README ``configs:``, split name patterns)."""
    import datasets  # lazy: datasets (Arrow folders only)

    path = Path(path)
    scripts = sorted(p.relative_to(path).as_posix() for p in path.rglob("*.py"))
    if scripts:
        raise DataError(path, 0, f"holds a dataset loading script ({', '.join(scripts)}): scripts run code and are "
                                 "not supported; keep only the data files (parquet or JSON Lines) and the README.md")
    # A card without a YAML block is fine here; huggingface_hub warns about it on stderr.
    logging.getLogger("huggingface_hub.repocard").setLevel(logging.ERROR)
    # The builder only resolves file patterns, but it takes a lock in its cache folder: use a throwaway one.
    with tempfile.TemporaryDirectory(prefix="alignflow-hub-") as cache:
        try:
            builder = datasets.load_dataset_builder(str(path), cache_dir=cache)
        except Exception as exc:  # missing or unreadable files; a card whose YAML is broken or of another shape
            reason = " ".join(str(exc).split())
            hint = "; mark one config of the README `default: true`" if isinstance(exc, ValueError) and \
                "config" in reason.lower() else ""
            raise DataError(path, 0, f"not a readable dataset folder ({reason}){hint}") from None
    data_files = builder.config.data_files or {}
    if not data_files.get("train"):
        splits = sorted(str(s) for s in data_files)
        raise DataError(path, 0, f"no 'train' split in this dataset folder (has {splits or 'no data files'})")
    root = path.resolve()
    # Name shards under the folder the user gave (the builder returns absolute paths).
    return [path / Path(f).relative_to(root) if Path(f).is_relative_to(root) else Path(f)
            for f in data_files["train"]]


def _iter_hub_dir(path: Path, max_line_bytes: int) -> Iterator[Record]:
    for shard in hub_train_files(path):
        suffix = shard.suffix.lower()
        if suffix not in SHARD_SUFFIXES:
            raise DataError(shard, 0, f"unsupported shard format {suffix!r} (use parquet or JSON Lines shards)")
        for rec in _iter_file(shard, max_line_bytes, sniff_json=True):
            yield Record(rec.data, rec.line, str(shard))


def _iter_file(path: Path, max_line_bytes: int, sniff_json: bool = False) -> Iterator[Record]:
    suffix = path.suffix.lower()
    if suffix == ".json" and sniff_json:
        # The Hub's json loader reads .json shards as JSON Lines or as one array: tell them apart.
        with _open(path) as fh:
            head = fh.read(4096).lstrip()
        return _iter_json_array(path) if head.startswith(b"[") else _iter_jsonl(path, max_line_bytes)
    if suffix in (".jsonl", ".ndjson"):
        return _iter_jsonl(path, max_line_bytes)
    if suffix == ".json":
        return _iter_json_array(path)
    if suffix in (".parquet", ".pq"):
        return _iter_parquet(path)
    raise DataError(path, 0, f"unsupported dataset format {suffix!r} (use .jsonl, .json, .parquet or a folder)")


SHARD_SUFFIXES = (".jsonl", ".ndjson", ".json", ".parquet")


def iter_records(path: str | Path, max_line_bytes: int = MAX_LINE_BYTES) -> Iterator[Record]:
    """Yield records of a dataset file or folder, by suffix: .jsonl, .json, .parquet; a folder saved by
    ``datasets`` or in the Hub's dataset layout. A JSON Lines line over ``max_line_bytes`` is refused
    unparsed (:class:`DataError` naming file and line)."""
    path = Path(path)
    if not path.exists():
        raise DataError(path, 0, "file not found")
    if path.is_dir():
        return _iter_datasets_dir(path) if is_saved_dataset(path) else _iter_hub_dir(path, max_line_bytes)
    if not path.is_file():
        raise DataError(path, 0, "not a regular file or a dataset folder")
    return _iter_file(path, max_line_bytes)


def read_records(path: str | Path, limit: int | None = None,
                 max_line_bytes: int = MAX_LINE_BYTES) -> list[Record]:
    """All records of a dataset (or the first ``limit``), in memory: for files that are small by design
    (eval sets, a preview); the gate streams instead (:func:`iter_records`)."""
    out: list[Record] = []
    for rec in iter_records(path, max_line_bytes):
        out.append(rec)
        if limit is not None and len(out) >= limit:
            break
    return out


def require_str(rec: Record, field: str, path: str | Path) -> str:
    """A non-empty string field of a record, or a DataError naming file, line and field."""
    if field not in rec.data:
        raise DataError(rec.where(path), rec.line, "missing", field)
    value = rec.data[field]
    if not isinstance(value, str):
        raise DataError(rec.where(path), rec.line, f"expected a string, got {type(value).__name__}", field)
    if not value.strip():
        raise DataError(rec.where(path), rec.line, "empty string", field)
    return value
