"""The dataset readers' input boundary: ``iter_records`` / ``read_records`` of rlhf_core/data/io.py on
JSON Lines, ``.json`` arrays, parquet, ``save_to_disk`` folders and Hub-layout folders. The contract
is that every input, valid or hostile (arbitrary JSON, integers past Python's digit limit, 10**400,
NaN tokens, deep nesting, bytes that are not UTF-8, lone surrogates, BOMs, CRLF, empty lines and
files, damaged ``state.json`` / ``dataset_dict.json``, README cards with broken or misshapen YAML),
is either read whole or refused with a ``DataError`` whose message starts with the file or folder
(and its line where one applies); no other exception escapes, no partial list comes back, the run
ends within the test's time limit, and the input's bytes are the same afterwards.
"""

from __future__ import annotations

import hashlib
import io
import json
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import event, example, given, settings
from hypothesis import strategies as st

from rlhf_core.data.io import DataError, Record, read_records

# A hang fails the test instead of stalling the suite: 0.6 s an example over the whole run (120 s for the
# default profile's 200, 1200 s for the long profile's 2000; no per-example deadline, CI's timing varies).
pytestmark = pytest.mark.timeout(0.6 * settings.default.max_examples)

# ------------------------------------------------------------------------------------------
# Strategies
# ------------------------------------------------------------------------------------------

SCALARS = (st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8)
           | st.sampled_from([10**400, -(10**30), "\ud800", "\ufeff", "", " ", "\r\n"]))
JSON_VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=6)
MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "bot", 5]),
                                           "content": st.text(max_size=6) | st.integers()}), max_size=3)
FIELDS = ["prompt", "completion", "chosen", "rejected", "label", "margin", "desirable", "messages"]
RECORDS = st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=4),
                          st.text(max_size=8) | MESSAGES | JSON_VALUES, max_size=5)
"""Records of every dataset kind's fields (and others), with values right, wrong or hostile."""

HOSTILE_LINES = st.sampled_from([
    b'{"prompt": ' + b"1" * 4301 + b"}",  # past Python's int-string digit limit
    b'{"prompt": "a", "margin": 1' + b"0" * 400 + b"}",
    b'{"prompt": NaN, "margin": Infinity, "label": -Infinity}',
    b"[" * 100_000,  # RecursionError in the decoder
    b'{"prompt": "' + b"[" * 10 + b'"}',
    b'{"prompt": "\xff\xfe"}',  # not UTF-8
    b'{"prompt": "\\ud800"}',  # a lone surrogate
    b'{"\\udfff": "x"}',
    b'{"prompt": "\\ud83d\\ude00"}',  # a surrogate pair: an emoji, valid
    b"\xef\xbb\xbf" + b'{"prompt": "a"}',  # a BOM
    b'{"prompt": "a"}\r', b"", b"   ", b"5", b"[]", b'"text"', b"null", b'{"prompt": ', b"}{",
])


def _json_line(record: dict, ascii_only: bool) -> bytes:
    return json.dumps(record, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")


JSONL_LINES = st.lists(st.one_of(st.builds(_json_line, RECORDS, st.booleans()), HOSTILE_LINES,
                                 st.binary(max_size=12)), max_size=6)
NEWLINES = st.sampled_from([b"\n", b"\r\n"])


# ------------------------------------------------------------------------------------------
# The contract
# ------------------------------------------------------------------------------------------


def _fingerprint(path: Path) -> str:
    """A digest of a file, or of a folder's every file name and bytes."""
    h = hashlib.sha256()
    for p in sorted([path] if path.is_file() else path.rglob("*")):
        h.update(str(p.relative_to(path.parent)).encode())
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


def read_or_refuse(path: Path) -> list[Record] | DataError:
    """``read_records(path)`` under the contract: the records, or the DataError naming ``path``; the
    input unchanged either way. Any other exception propagates and fails the test."""
    before = _fingerprint(path)
    try:
        out: list[Record] | DataError = read_records(path)
    except DataError as exc:
        assert str(exc).startswith(str(path)), exc  # the file, the folder or a shard inside it
        assert exc.line >= 0
        str(exc).encode("utf-8")  # printable as it is logged
        event("refused")
        out = exc
    else:
        assert all(isinstance(r, Record) and isinstance(r.data, dict) and r.line >= 1 for r in out)
        sources = {r.source for r in out}
        for source in sources:  # each file's lines count up
            lines = [r.line for r in out if r.source == source]
            assert lines == sorted(set(lines)), lines
        event("read, no records" if not out else "read, records")
    assert _fingerprint(path) == before
    return out


# ------------------------------------------------------------------------------------------
# Files
# ------------------------------------------------------------------------------------------


@given(lines=JSONL_LINES, newline=NEWLINES, suffix=st.sampled_from([".jsonl", ".ndjson"]))
@example(lines=[b'{"prompt": ' + b"1" * 4301 + b"}"], newline=b"\n", suffix=".jsonl")
@example(lines=[b"[" * 100_000], newline=b"\n", suffix=".jsonl")
@example(lines=[b'{"prompt": "\\ud800"}'], newline=b"\n", suffix=".jsonl")
@example(lines=[b"\n\x00"], newline=b"\n", suffix=".jsonl")  # a generated line holding a newline is two lines
def test_json_lines_are_read_or_refused_naming_the_line(lines, newline, suffix):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"data{suffix}"
        content = newline.join(lines)
        path.write_bytes(content)
        out = read_or_refuse(path)
        if isinstance(out, DataError) and out.line:
            assert out.line <= content.count(b"\n") + 1


def _json_array(records: list[dict], splice: bytes | None, bom: bool) -> bytes:
    """A ``.json`` array of ``records``, with ``splice`` (raw bytes) as one more element."""
    items = [_json_line(r, True) for r in records] + ([splice] if splice is not None else [])
    return (b"\xef\xbb\xbf" if bom else b"") + b"[\n" + b",\n".join(items) + b"\n]"


JSON_ARRAYS = st.builds(_json_array, st.lists(RECORDS, max_size=4),
                        st.none() | HOSTILE_LINES | st.binary(max_size=8), st.booleans())


@given(content=JSON_ARRAYS | st.builds(_json_line, JSON_VALUES, st.booleans()) | st.binary(max_size=16))
@example(content=b'[{"prompt": "a\xff"}]')
@example(content=b"[" * 100_000)
@example(content=b'[{"n": ' + b"9" * 4301 + b"}]")
@example(content=b'[{"prompt": "ok"}, {"prompt": "\\ud800"}]')
@example(content=b"")
def test_json_arrays_are_read_or_refused(content):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "data.json"
        path.write_bytes(content)
        read_or_refuse(path)


def _string_column(values: list[bytes]) -> pa.Array:
    """A parquet ``string`` column holding ``values`` as they are, valid UTF-8 or not."""
    offsets, data = [0], b""
    for v in values:
        data += v
        offsets.append(len(data))
    return pa.Array.from_buffers(pa.string(), len(values),
                                 [None, pa.py_buffer(pa.array(offsets, pa.int32()).buffers()[1]), pa.py_buffer(data)])


def _parquet(columns: dict[str, list[bytes]], mangle: int | None) -> bytes:
    """A parquet file of string columns (rows: the shortest column), its bytes cut at ``mangle`` if given."""
    n = min((len(v) for v in columns.values()), default=0)
    table = pa.table({k: _string_column(v[:n]) for k, v in columns.items()}) if columns else pa.table({"x": []})
    sink = io.BytesIO()
    pq.write_table(table, sink)
    data = sink.getvalue()
    return data if mangle is None else data[:mangle % max(len(data), 1)]


PARQUETS = st.builds(_parquet, st.dictionaries(st.sampled_from(FIELDS[:5]), st.lists(
    st.text(max_size=6).map(str.encode) | st.binary(max_size=4), max_size=4), max_size=3),
    st.none() | st.integers(min_value=0))


@given(content=PARQUETS | st.binary(max_size=32), suffix=st.sampled_from([".parquet", ".pq"]))
@example(content=_parquet({"prompt": [b"ok", b"\xff\xfe"]}, None), suffix=".parquet")
def test_parquet_files_are_read_or_refused(content, suffix):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"data{suffix}"
        path.write_bytes(content)
        read_or_refuse(path)


def test_parquet_with_invalid_utf8_is_a_data_error_naming_the_file(tmp_path):
    path = tmp_path / "bad.parquet"
    path.write_bytes(_parquet({"prompt": [b"ok", b"\xff"]}, None))
    with pytest.raises(DataError, match=r"bad\.parquet: not a readable parquet file .*decode byte 0xff"):
        read_records(path)


# ------------------------------------------------------------------------------------------
# Folders
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    """Real ``save_to_disk`` folders: a Dataset of two rows, an empty one, a DatasetDict with a train split."""
    import datasets

    root = tmp_path_factory.mktemp("saved")
    datasets.disable_progress_bars()
    rows = datasets.Dataset.from_dict({"prompt": ["a", "b"], "completion": ["c", "d"]})
    rows.save_to_disk(str(root / "rows"))
    datasets.Dataset.from_dict({"prompt": []}).save_to_disk(str(root / "empty"))
    datasets.DatasetDict({"train": rows, "test": rows}).save_to_disk(str(root / "dict"))
    return {p.name: p for p in root.iterdir()}


SAVED_DAMAGE = st.sampled_from([b"{}", b"[]", b"", b"null", b"\xff", b"[" * 100_000, b'{"_data_files": []}',
                                b'{"_data_files": 5}', b'{"_data_files": [{"filename": "../x.arrow"}]}',
                                b'{"splits": ["train"]}', b'{"splits": 5}', b'{"n": ' + b"7" * 4301 + b"}"])


@given(base=st.sampled_from(["rows", "empty", "dict", None]),
       damage=st.lists(st.tuples(st.sampled_from(["state.json", "dataset_dict.json", "dataset_info.json",
                                                  "data-00000-of-00001.arrow", "train/state.json",
                                                  "train/data-00000-of-00001.arrow"]),
                                 SAVED_DAMAGE | st.builds(_json_line, JSON_VALUES, st.booleans())
                                 | st.binary(max_size=16)), max_size=2))
@example(base=None, damage=[("state.json", b"{}")])
@example(base=None, damage=[("dataset_dict.json", b"{}")])
@example(base="empty", damage=[])
def test_saved_dataset_folders_are_read_or_refused(saved, base, damage):
    import shutil

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ds"
        if base is None:
            path.mkdir()
        else:
            shutil.copytree(saved[base], path)
        for name, content in damage:
            (path / name).parent.mkdir(exist_ok=True)
            (path / name).write_bytes(content)
        out = read_or_refuse(path)
        if base == "empty" and not damage:
            assert out == []  # a saved dataset of no rows reads as no records


CARDS = st.sampled_from([
    None, "# no YAML block\n", "---\nlicense: mit\n---\n", "---\nconfigs: [\n---\n", "---\nconfigs:\n- 5\n---\n",
    "---\nconfigs: 5\n---\n", "---\nconfigs:\n- config_name: default\n  data_files: train.jsonl\n---\n",
    "---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n    path: data/*.parquet\n---\n",
    "---\nconfigs:\n- config_name: a\n  data_files: x.jsonl\n- config_name: b\n  data_files: y.jsonl\n---\n",
    "---\nconfigs:\n- data_files: 5\n---\n", "---\nconfigs:\n- config_name: [1]\n---\n",
    "---\nconfigs:\n- config_name: default\n  data_files: ../outside.jsonl\n---\n",
    "---\n: : :\n---\n", "---\n\tbad: indent\n---\n", "---\nconfigs: !!python/object:os.system x\n---\n",
]) | st.builds(lambda body: f"---\n{body}\n---\n", st.text(max_size=30))
SHARD_NAMES = st.sampled_from(["train.jsonl", "train.json", "data/train-00000-of-00001.parquet",
                               "data/test-00000-of-00001.parquet", "x.jsonl", "train.csv", "loader.py", "README.md"])
SHARD_BYTES = (st.builds(lambda lines, nl: nl.join(lines), JSONL_LINES, NEWLINES) | JSON_ARRAYS | PARQUETS)


@given(card=CARDS, shards=st.dictionaries(SHARD_NAMES, SHARD_BYTES, max_size=2))
@example(card="---\nconfigs: [\n---\n", shards={"train.jsonl": b'{"prompt": "a"}'})
@example(card="---\nconfigs:\n- 5\n---\n", shards={"train.jsonl": b'{"prompt": "a"}'})
@example(card=None, shards={})
def test_hub_layout_folders_are_read_or_refused(card, shards):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "hub"
        path.mkdir()
        if card is not None:
            (path / "README.md").write_text(card, encoding="utf-8", errors="surrogatepass")
        for name, content in shards.items():
            (path / name).parent.mkdir(exist_ok=True)
            (path / name).write_bytes(content)
        read_or_refuse(path)


# ------------------------------------------------------------------------------------------
# Each refusal's message
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix,content,message", [
    (".jsonl", b'{"p": 1}\n{"n": ' + b"1" * 4301 + b"}\n", r"data\.jsonl:2: not readable JSON \(Exceeds the limit"),
    (".jsonl", b"[" * 100_000, r"data\.jsonl:1: not readable JSON \(nested deeper than Python's recursion limit"),
    (".json", b"[" * 100_000, r"data\.json: not readable JSON \(nested deeper"),
    (".json", b'[{"p": 1},\n{"p": "\xff"}]', r"data\.json:2: not UTF-8 text \(byte 0xff\)"),
    (".jsonl", b'{"p": 1}\n{"prompt": ["\\ud800"]}\n', r"data\.jsonl:2: field 'prompt': a lone surrogate"),
    (".json", b'[{"p": 1}, {"\\udc80": 2}]', r"data\.json:2: field '\\udc80': a lone surrogate"),
])
def test_a_refused_file_is_named_with_its_line_and_field(tmp_path, suffix, content, message):
    path = tmp_path / f"data{suffix}"
    path.write_bytes(content)
    with pytest.raises(DataError, match=message):
        read_records(path)


def test_a_surrogate_pair_is_one_character_and_read(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text('{"prompt": "\\ud83d\\ude00"}\n')
    assert read_records(path)[0]["prompt"] == "\U0001F600"


@pytest.mark.parametrize("name,content,message", [
    ("state.json", "{}", "neither a `Dataset` directory nor a `DatasetDict` directory"),
    ("dataset_dict.json", "{}", r"no 'splits' entry"),
])
def test_a_damaged_saved_folder_is_named(tmp_path, name, content, message):
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / name).write_text(content)
    with pytest.raises(DataError, match=rf"ds: not a readable datasets folder \(.*{message}"):
        read_records(tmp_path / "ds")


def test_an_empty_saved_dataset_has_no_records(saved):
    assert read_records(saved["empty"]) == []


@pytest.mark.parametrize("card", ["---\nconfigs: [\n---\n", "---\nconfigs:\n- 5\n---\n"])
def test_a_card_with_broken_or_misshapen_configs_is_named(tmp_path, card):
    (tmp_path / "hub").mkdir()
    (tmp_path / "hub" / "README.md").write_text(card)
    (tmp_path / "hub" / "train.jsonl").write_text('{"prompt": "a"}\n')
    with pytest.raises(DataError, match=r"hub: not a readable dataset folder \(.*\)$"):  # no config hint
        read_records(tmp_path / "hub")
