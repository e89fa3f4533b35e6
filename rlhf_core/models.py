"""Load any Hugging Face causal-LM directory (the embedded model or a user's) the same way."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from rlhf_core.data.tokenize import ensure_chat_template


class ModelLoadError(ValueError):
    """A model directory that cannot be loaded, with the path and the reason."""


def pick_device() -> torch.device:
    """CUDA when present, else CPU."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def resolve_precision(precision: str, device: torch.device) -> torch.dtype | None:
    """Autocast dtype for ``precision`` on ``device`` (``None`` = full fp32).

    ``auto`` picks bf16 only on a GPU that supports it: CPUs without AMX run bf16 slower
    than fp32, and the tiny default model gains nothing from it.
    """
    if precision == "fp32":
        return None
    if precision == "bf16":
        return torch.bfloat16
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return None


def load_tokenizer(path: str | Path, padding_side: str = "right") -> Any:
    """Tokenizer of a model directory, with a pad token and a chat template guaranteed."""
    from transformers import AutoTokenizer

    path = Path(path)
    if not (path / "tokenizer_config.json").exists() and not (path / "tokenizer.json").exists():
        raise ModelLoadError(f"{path}: no tokenizer files (tokenizer.json / tokenizer_config.json)")
    tok = AutoTokenizer.from_pretrained(str(path))
    if tok.pad_token_id is None:
        if tok.eos_token_id is None:
            raise ModelLoadError(f"{path}: tokenizer has neither a pad nor an eos token")
        tok.pad_token = tok.eos_token
    tok.padding_side = padding_side
    return ensure_chat_template(tok)


def load_causal_lm(path: str | Path, device: torch.device | None = None) -> Any:
    """An ``AutoModelForCausalLM`` from a local directory, in fp32 on ``device``.

    Weights stay fp32 (master weights); mixed precision is applied by autocast in trainers.
    """
    from transformers import AutoModelForCausalLM

    path = Path(path)
    if not (path / "config.json").exists():
        raise ModelLoadError(f"{path}: not a Hugging Face model directory (no config.json)")
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="sdpa")
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path}: cannot load as a causal LM: {exc}") from None
    return model.to(device or pick_device())
