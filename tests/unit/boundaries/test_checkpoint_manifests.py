"""Boundary: what resuming reads from a checkpoint folder: ``manifest.json`` (``rlhf_core.tracking.manifest``),
``trainer_state.pt`` and ``finished.json`` (``rlhf_core.tracking.checkpoint.Checkpointer``).

Each file is replaced by arbitrary bytes, another JSON value, or a well-formed one with fields of any value
(entry paths that leave the folder included). The contract: ``read_manifest`` returns the manifest or raises
ValueError naming ``manifest.json`` (and the entry), ``verify_manifest`` returns None or what differs, never
raises; ``Checkpointer.latest`` and ``Checkpointer.finished`` return a checkpoint / record or None (a warning
naming the file), never raise; no file under the folder changes.
"""

from __future__ import annotations

import hashlib
import json

import torch
from hypothesis import example, given
from hypothesis import strategies as st

from rlhf_core.tracking.checkpoint import FINISHED_FILE, FORMAT_VERSION, STATE_FILE, Checkpointer
from rlhf_core.tracking.manifest import MANIFEST_FILE, read_manifest, verify_manifest, write_manifest

FINGERPRINT = "f" * 64
HEADER = {"format": FORMAT_VERSION, "step": 3, "fingerprint": FINGERPRINT}
json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                           lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3),
                           max_leaves=6)
paths = st.sampled_from(["model.safetensors", "../outside.txt", "/etc/hostname", "", "a/../../x", "missing", "a\0b"])
entries = st.fixed_dictionaries({}, optional={"path": paths | json_values, "size": st.integers(-1, 10**30) | json_values,
                                              "sha256": st.text(max_size=4) | json_values})
manifests = st.one_of(
    st.binary(max_size=64), json_values.map(lambda v: json.dumps(v).encode()),
    st.lists(entries, max_size=3).map(lambda files: json.dumps({**HEADER, "files": files}).encode()),
    st.integers(1, 100000).map(lambda n: b'{"files": ' + b"[" * n),
)


def _tree(root):
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _checkpoint(root):
    step = root / "step-0000003"
    step.mkdir(parents=True, exist_ok=True)
    (step / "model.safetensors").write_bytes(b"weights")
    torch.save({**HEADER, "rng": {}}, step / STATE_FILE)
    (root / "outside.txt").write_text("not the checkpoint's")
    write_manifest(step, HEADER)
    return step


@given(data=manifests)
@example(data=b'{"files": [1]}')  # verify_manifest: TypeError (int is not subscriptable)
@example(data=b"[]")  # read_manifest: TypeError (list indices)
@example(data=b'{"files": ' + b"[" * 100000)  # read_manifest: RecursionError
@example(data=json.dumps({**HEADER, "files": [{"path": "../outside.txt", "size": 21, "sha256": "x"}]}).encode())
def test_a_manifest_is_read_or_refused_naming_it(tmp_path_factory, data):
    root = tmp_path_factory.mktemp("ckpt")
    step = _checkpoint(root)
    (step / MANIFEST_FILE).write_bytes(data)
    before = _tree(root)
    try:
        manifest = read_manifest(step)
    except ValueError as exc:
        assert MANIFEST_FILE in str(exc)
    else:
        problem = verify_manifest(step, manifest)
        assert problem is None or isinstance(problem, str)
        assert all(".." not in e["path"].split("/") and not e["path"].startswith("/") for e in manifest["files"])
    found = Checkpointer(root, FINGERPRINT).latest()
    assert found is None or found.step == 3
    assert _tree(root) == before


states = st.one_of(st.binary(max_size=64).map(lambda b: ("raw", b)),
                   json_values.map(lambda v: ("saved", v)),
                   st.dictionaries(st.sampled_from(["format", "fingerprint", "step", "rng"]),
                                   json_values, max_size=4).map(lambda d: ("saved", {**HEADER, **d})))


@given(state=states)
@example(state=("saved", [1, 2]))  # _foreign: AttributeError ('list' object has no attribute 'get')
@example(state=("saved", {"format": FORMAT_VERSION, "fingerprint": FINGERPRINT}))  # no step: KeyError
def test_a_trainer_state_is_loaded_or_skipped(tmp_path_factory, state):
    root = tmp_path_factory.mktemp("ckpt")
    step = _checkpoint(root)
    kind, value = state
    if kind == "raw":
        (step / STATE_FILE).write_bytes(value)
    else:
        torch.save(value, step / STATE_FILE)
    write_manifest(step, HEADER)
    before = _tree(root)
    found = Checkpointer(root, FINGERPRINT).latest()
    assert found is None or (isinstance(found.step, int) and found.state is not None)
    assert _tree(root) == before


records = st.one_of(
    st.binary(max_size=64), json_values.map(lambda v: json.dumps(v).encode()),
    st.fixed_dictionaries({"format": st.just(FORMAT_VERSION), "fingerprint": st.just(FINGERPRINT)},
                          optional={"step": json_values | st.sampled_from([float("inf"), float("nan")]),
                                    "output_dir": st.just("no-such-output") | json_values,
                                    "output_md5": json_values, "outcome": json_values}).map(
        lambda d: json.dumps(d).encode()),
)


@given(data=records)
@example(data=json.dumps({"format": FORMAT_VERSION, "fingerprint": FINGERPRINT, "step": float("inf"),
                          "output_dir": "x", "output_md5": "y", "outcome": {}}).encode())  # int(inf): OverflowError
@example(data=b"[" * 100000)  # RecursionError
def test_a_finished_record_is_read_or_ignored(tmp_path_factory, data):
    root = tmp_path_factory.mktemp("ckpt")
    (root / FINISHED_FILE).write_bytes(data)
    before = _tree(root)
    assert Checkpointer(root, FINGERPRINT).finished() is None
    assert _tree(root) == before
