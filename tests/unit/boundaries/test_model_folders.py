"""Boundary: a model folder as ``rlhf_core.models.loading`` loads it (``load_tokenizer``, ``attn_implementation``,
``load_causal_lm``).

One file of a real micro model folder at a time is replaced: ``config.json``, ``generation_config.json``,
``tokenizer_config.json`` or ``tokenizer.json`` by bytes, by another JSON value, or by the file with one field
given a value of another type, and ``model.safetensors`` by a prefix of itself or bytes; or the file is removed.
The contract: the folder loads, or the loader raises ``ModelLoadError`` naming the folder and that file (never
an exception of transformers, tokenizers, json or safetensors), and the folder's bytes are the same afterwards.
"""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from rlhf_core.models.loading import ModelLoadError, attn_implementation, load_causal_lm, load_tokenizer

JSON_NAMES = ("config.json", "generation_config.json", "tokenizer_config.json", "tokenizer.json")
json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                           lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3),
                           max_leaves=6)


@pytest.fixture(scope="module")
def folder(llama_chat_model, tmp_path_factory):
    """A copy of the Llama micro model folder, mutated one file per example and put back after each."""
    out = tmp_path_factory.mktemp("folder") / "llama"
    shutil.copytree(llama_chat_model, out)
    return out


def _digest(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@st.composite
def mutations(draw, folder_files):
    """``(file name, new bytes or None to remove it)``."""
    name = draw(st.sampled_from(sorted(folder_files)))
    original = folder_files[name]
    if name.endswith(".json"):
        data = json.loads(original)
        kind = draw(st.sampled_from(["bytes", "value", "field", "prefix", "deep", "remove"]))
        if kind == "field" and isinstance(data, dict) and data:
            data[draw(st.sampled_from(sorted(data)))] = draw(json_values)
            return name, json.dumps(data).encode()
        if kind == "value":
            return name, json.dumps(draw(json_values)).encode()
        if kind == "deep":
            return name, b"[" * draw(st.integers(1, 100000))
    else:
        kind = draw(st.sampled_from(["bytes", "prefix", "remove"]))
    if kind == "remove":
        return name, None
    if kind == "prefix":
        return name, original[:draw(st.integers(0, len(original) - 1))]
    return name, draw(st.binary(max_size=64))


def _check(load, folder, name, new):
    target = folder / name
    saved = target.read_bytes()
    try:
        if new is None:
            target.unlink()
        else:
            target.write_bytes(new)
        before = _digest(folder)
        try:
            load(folder)
        except ModelLoadError as exc:
            assert str(folder) in str(exc) and (new is None or name in str(exc)), exc
        assert _digest(folder) == before
    finally:
        target.write_bytes(saved)


@given(data=st.data())
@example(data=None)
def test_a_tokenizer_folder_loads_or_is_refused(folder, data):
    files = {n: (folder / n).read_bytes() for n in ("tokenizer_config.json", "tokenizer.json")}
    name, new = (("tokenizer_config.json", b"[]") if data is None  # was AttributeError from transformers
                 else data.draw(mutations(files)))
    _check(load_tokenizer, folder, name, new)


@given(data=st.data())
@example(data=None)
def test_a_model_folder_loads_or_is_refused(folder, data):
    files = {n: (folder / n).read_bytes() for n in ("config.json", "generation_config.json", "model.safetensors")}
    name, new = (("model.safetensors", b"") if data is None  # was safetensors' SafetensorError
                 else data.draw(mutations(files)))

    def load(path):
        attn_implementation(path, torch.device("cpu"))
        load_causal_lm(path, torch.device("cpu"))

    _check(load, folder, name, new)


@pytest.mark.parametrize("name, new, why", [
    ("config.json", b"null", "expected a JSON object"),
    ("config.json", b"[" * 100000, "RecursionError"),
    ("config.json", json.dumps({"model_type": "llama", "hidden_size": "x"}).encode(), "config.json"),
    ("tokenizer_config.json", b"\xff", "UnicodeDecodeError"),
    ("tokenizer_config.json", json.dumps({"tokenizer_class": 5}).encode(), "tokenizer_config.json"),
    ("generation_config.json", b"[]", "expected a JSON object"),
])
def test_regressions_are_refused_naming_the_file(folder, name, new, why):
    target, saved = folder / name, (folder / name).read_bytes()
    target.write_bytes(new)
    try:
        with pytest.raises(ModelLoadError, match=why) as caught:
            load_tokenizer(folder) if name.startswith("tokenizer") else load_causal_lm(folder, torch.device("cpu"))
        assert name in str(caught.value)
    finally:
        target.write_bytes(saved)
