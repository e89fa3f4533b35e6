"""The md5 hash cache: same digests as uncached hashing and as DVC, no bytes read on a hit,
re-hashing on any change of the stat key, and a cache file that survives corruption and
two writers at once."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

from rlhf_core.tracking import lineage
from rlhf_core.tracking.lineage import HashCache, dvc_md5, file_md5

AGED_NS = 60 * 10**9  # files are back-dated a minute: younger ones are never cached ("racy" mtimes)


def _age(path: Path) -> None:
    t = time.time_ns() - AGED_NS
    os.utime(path, ns=(t, t))


def _model_dir(root: Path) -> Path:
    """A small model-shaped directory, every file back-dated; one shard is above MIN_CACHED_BYTES."""
    model = root / "model"
    (model / "tokenizer").mkdir(parents=True)
    (model / ".dvc").mkdir()  # skipped by DVC's directory hash
    files = {"model-00001-of-00002.safetensors": os.urandom(1_200_000), "model-00002-of-00002.safetensors":
             os.urandom(200_000), "config.json": b'{"hidden_size": 32}\n', "tokenizer/vocab.json": b'{"a": 0}\n',
             ".dvc/ignored": b"x"}
    for rel, data in files.items():
        (model / rel).write_bytes(data)
        _age(model / rel)
    return model


def test_cached_digests_equal_uncached_and_dvc(tmp_path):
    model = _model_dir(tmp_path)
    cache_file = tmp_path / "cache.json"
    uncached = dvc_md5(model, cache=False)
    cold = HashCache(cache_file, min_bytes=0)
    assert dvc_md5(model, cache=cold) == uncached
    cold.save()
    warm = HashCache(cache_file, min_bytes=0)
    assert dvc_md5(model, cache=warm) == uncached
    assert warm.hashed_bytes == 0
    single = model / "config.json"
    assert dvc_md5(single, cache=warm) == file_md5(single)

    # ... and all of them equal what DVC itself records
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run([sys.executable, "-m", "dvc", "init", "-q"], cwd=tmp_path, check=True)
    (model / ".dvc" / "ignored").unlink()
    (model / ".dvc").rmdir()  # `dvc add` refuses a folder holding a .dvc directory
    subprocess.run([sys.executable, "-m", "dvc", "add", "-q", "model"], cwd=tmp_path, check=True)
    recorded = yaml.safe_load((tmp_path / "model.dvc").read_text())["outs"][0]["md5"]
    assert recorded == uncached == dvc_md5(model, cache=HashCache(cache_file, min_bytes=0))


def test_second_hash_of_an_unchanged_directory_reads_no_bytes(tmp_path):
    """Proof by the documented trade-off: a shard rewritten in place with the same size, mtime and
    inode keeps its cached md5, so the second hash cannot have read it."""
    model = _model_dir(tmp_path)
    cache_file = tmp_path / "cache.json"
    first = HashCache(cache_file, min_bytes=0)
    before = dvc_md5(model, cache=first)
    first.save()
    assert first.hashed_bytes == sum(f.stat().st_size for f in model.rglob("*") if f.is_file()
                                     and ".dvc" not in f.parts)

    shard = model / "model-00001-of-00002.safetensors"
    st = shard.stat()
    old_shard_md5 = file_md5(shard)
    with shard.open("r+b") as fh:  # same inode, same size
        fh.write(b"\0" * st.st_size)
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert file_md5(shard) != old_shard_md5

    second = HashCache(cache_file, min_bytes=0)
    assert dvc_md5(model, cache=second) == before
    assert second.hashed_bytes == 0
    assert dvc_md5(model, cache=False) != before  # the uncached hash sees the new bytes


def test_a_changed_file_is_rehashed(tmp_path):
    model = _model_dir(tmp_path)
    cache_file = tmp_path / "cache.json"
    cache = HashCache(cache_file, min_bytes=0)
    dvc_md5(model, cache=cache)
    cache.save()
    config = model / "config.json"

    # new size (content changed, then back-dated: only the size tells)
    config.write_bytes(b'{"hidden_size": 64, "layers": 2}\n')
    _age(config)
    cache = HashCache(cache_file, min_bytes=0)
    assert dvc_md5(config, cache=cache) == file_md5(config)
    assert cache.hashed_bytes == config.stat().st_size

    # new mtime only: re-read (same digest)
    cache.save()
    t = time.time_ns() - AGED_NS // 2
    os.utime(config, ns=(t, t))
    cache = HashCache(cache_file, min_bytes=0)
    assert dvc_md5(config, cache=cache) == file_md5(config)
    assert cache.hashed_bytes == config.stat().st_size

    # same size, same mtime, new inode (replaced by rename, as save_pretrained writers do)
    cache.save()
    st = config.stat()
    fresh = tmp_path / "fresh.json"
    fresh.write_bytes(b"X" * st.st_size)
    os.replace(fresh, config)
    os.utime(config, ns=(st.st_atime_ns, st.st_mtime_ns))
    cache = HashCache(cache_file, min_bytes=0)
    assert dvc_md5(config, cache=cache) == file_md5(config)
    assert cache.hashed_bytes == st.st_size


def test_a_just_written_file_is_not_cached(tmp_path):
    """A file modified within the mtime granularity of the hash could change again unseen."""
    path = tmp_path / "new.bin"
    path.write_bytes(b"fresh")
    cache = HashCache(tmp_path / "cache.json", min_bytes=0)
    assert dvc_md5(path, cache=cache) == file_md5(path)
    cache.save()
    assert not (tmp_path / "cache.json").exists()  # nothing cacheable, nothing written
    _age(path)
    dvc_md5(path, cache=cache)
    cache.save()
    assert str(path) in json.loads((tmp_path / "cache.json").read_text())["entries"]


def test_corrupt_cache_is_ignored_with_a_warning(tmp_path, caplog):
    model = _model_dir(tmp_path)
    cache_file = tmp_path / "cache.json"
    cache_file.write_text('{"version": 1, "entries": {"/x": [1, 2')
    with caplog.at_level(logging.WARNING, logger="rlhf_core.tracking.lineage"):
        cache = HashCache(cache_file, min_bytes=0)
    assert "unreadable" in caplog.text and str(cache_file) in caplog.text
    assert dvc_md5(model, cache=cache) == dvc_md5(model, cache=False)
    cache.save()  # replaced by a valid cache
    assert len(json.loads(cache_file.read_text())["entries"]) == 4
    cache_file.write_text('["not", "a", "cache"]')
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rlhf_core.tracking.lineage"):
        assert HashCache(cache_file, min_bytes=0).md5(model / "config.json") == file_md5(model / "config.json")
    assert "unknown layout" in caplog.text


def test_config_setting_and_default_location(tmp_path, monkeypatch):
    """``tracking.hash_cache``: empty for the project's file, a path elsewhere, off (or YAML's bare off) for none."""
    from rlhf_core.config import TrackingConfig, build_config

    model = _model_dir(tmp_path)
    monkeypatch.setenv("ALIGNFLOW_HOME", str(tmp_path / "project"))
    monkeypatch.setattr(lineage, "_hash_cache_setting", "")
    lineage.use_hash_cache(TrackingConfig().hash_cache)
    default = tmp_path / "project" / ".alignflow" / "hash-cache.json"
    assert HashCache.default().path == default
    expected = dvc_md5(model, cache=False)
    assert dvc_md5(model) == expected and default.exists()

    lineage.use_hash_cache(str(tmp_path / "elsewhere.json"))
    assert dvc_md5(model) == expected and (tmp_path / "elsewhere.json").exists()

    default.unlink()
    off = build_config(TrackingConfig, "tracking", {"hash_cache": False})  # what YAML makes of a bare off
    assert off.hash_cache == "off"
    lineage.use_hash_cache(off.hash_cache)
    assert HashCache.default().path is None
    assert dvc_md5(model) == expected and not default.exists()


def test_save_drops_vanished_files_and_caps_entries(tmp_path, monkeypatch):
    files = []
    for i in range(5):
        files.append(tmp_path / f"f{i}.bin")
        files[-1].write_bytes(bytes([i]) * 10)
        _age(files[-1])
    cache_file = tmp_path / "cache.json"
    cache = HashCache(cache_file, min_bytes=0)
    for f in files:
        cache.md5(f)
    files[0].unlink()
    cache.save()
    assert sorted(json.loads(cache_file.read_text())["entries"]) == sorted(str(f) for f in files[1:])

    monkeypatch.setattr(lineage, "MAX_CACHE_ENTRIES", 2)
    cache = HashCache(cache_file, min_bytes=0)
    cache.md5(files[1])  # cached: not new, stays where it is
    newer = tmp_path / "newer.bin"
    newer.write_bytes(b"n" * 10)
    _age(newer)
    cache.md5(newer)
    cache.save()
    # the two most recently hashed survive: f4 (last of the first save) and the new file
    assert list(json.loads(cache_file.read_text())["entries"]) == [str(files[4]), str(newer)]


_WRITER = """
import os, sys, time
from pathlib import Path
from rlhf_core.tracking.lineage import HashCache
root, cache_file = Path(sys.argv[1]), sys.argv[2]
t = time.time_ns() - 60 * 10**9
for i in range(100):
    f = root / f"{i}.bin"
    f.write_bytes(root.name.encode() * (i + 1))
    os.utime(f, ns=(t, t))
    cache = HashCache(cache_file, min_bytes=0)
    cache.md5(f)
    cache.save()
"""


def test_two_processes_saving_at_once_lose_no_entries(tmp_path):
    cache_file = tmp_path / "cache.json"
    roots = [tmp_path / "a", tmp_path / "b"]
    for r in roots:
        r.mkdir()
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(r), str(cache_file)]) for r in roots]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    entries = json.loads(cache_file.read_text())["entries"]
    assert sorted(entries) == sorted(str(r / f"{i}.bin") for r in roots for i in range(100))
    assert all(v[3] == file_md5(k) for k, v in entries.items())
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_small_files_are_hashed_every_time(tmp_path):
    """Only files of at least MIN_CACHED_BYTES are cached: the cache is for weight shards."""
    model = _model_dir(tmp_path)
    cache = HashCache(tmp_path / "cache.json")
    dvc_md5(model, cache=cache)
    cache.save()
    assert list(json.loads((tmp_path / "cache.json").read_text())["entries"]) == [
        str(model / "model-00001-of-00002.safetensors")]
    again = HashCache(tmp_path / "cache.json")
    dvc_md5(model, cache=again)
    assert again.hashed_bytes == sum(f.stat().st_size for f in model.rglob("*") if f.is_file()
                                     and ".dvc" not in f.parts and f.stat().st_size < lineage.MIN_CACHED_BYTES)
