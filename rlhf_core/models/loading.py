"""Load any Hugging Face causal-LM directory (the embedded model or a user's) the same way.

A folder that cannot be loaded is a :class:`ModelLoadError` naming the folder and the file: its small JSON files
(:data:`JSON_FILES`) are read first and must each hold one JSON object, and whatever transformers, tokenizers or
safetensors raise while loading the rest becomes the same error, naming the files that step reads. Loading
writes nothing into the folder.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch

from rlhf_core.data.chat import ensure_chat_template
from rlhf_core.models import attention


class ModelLoadError(ValueError):
    """A model directory that cannot be loaded, with the path and the reason."""


def pick_device() -> torch.device:
    """CUDA when present, else CPU."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


JSON_FILES = ("config.json", "generation_config.json", "tokenizer_config.json", "special_tokens_map.json")
"""A model folder's small JSON files, each one JSON object where present (``tokenizer.json``, megabytes, is
left to the tokenizers library)."""
TOKENIZER_FILES = "tokenizer.json / tokenizer_config.json"


def check_json_files(path: Path) -> None:
    """:class:`ModelLoadError` naming the file where one of :data:`JSON_FILES` in ``path`` is present but not
    one JSON object (unreadable, not UTF-8, not JSON, nested past the parser's depth, or another JSON value)."""
    for name in JSON_FILES:
        file = path / name
        if not file.exists():
            continue
        try:
            value = json.loads(file.read_bytes())
        except (OSError, ValueError, RecursionError) as exc:  # UnicodeDecodeError and JSONDecodeError: ValueError
            raise ModelLoadError(f"{file}: not readable as JSON: {type(exc).__name__}: {str(exc)[:200]}") from None
        if not isinstance(value, dict):
            raise ModelLoadError(f"{file}: expected a JSON object, got {type(value).__name__}")


@contextmanager
def refusing(path: Path, files: str) -> Iterator[None]:
    """Whatever loading ``files`` of the folder ``path`` raises inside, as a :class:`ModelLoadError` naming them.

    Every exception: transformers, huggingface_hub, tokenizers and safetensors raise many types (TypeError,
    AttributeError, a Rust ``SafetensorError``) on a folder's malformed content, none of them a fault here."""
    try:
        yield
    except ModelLoadError:
        raise
    except Exception as exc:  # noqa: BLE001 - see the docstring
        raise ModelLoadError(f"{path}: cannot load {files}: {type(exc).__name__}: {str(exc)[:300]}") from None


def load_tokenizer(path: str | Path, padding_side: str = "right") -> Any:
    """Tokenizer of a model directory, with a pad token and a chat template guaranteed."""
    from transformers import AutoTokenizer  # lazy: transformers (~1 s; with a model only)

    path = Path(path)
    if not (path / "tokenizer_config.json").exists() and not (path / "tokenizer.json").exists():
        raise ModelLoadError(f"{path}: no tokenizer files ({TOKENIZER_FILES})")
    check_json_files(path)
    with refusing(path, TOKENIZER_FILES):
        tok = AutoTokenizer.from_pretrained(str(path))
    if not isinstance(getattr(tok, "chat_template", None), (str, dict, type(None))):
        raise ModelLoadError(f"{path / 'tokenizer_config.json'}: chat_template must be a string, got "
                             f"{type(tok.chat_template).__name__}")
    if tok.pad_token_id is None:
        if tok.eos_token_id is None:
            raise ModelLoadError(f"{path}: tokenizer has neither a pad nor an eos token (special tokens of "
                                 f"{TOKENIZER_FILES})")
        tok.pad_token = tok.eos_token
    tok.padding_side = padding_side
    return ensure_chat_template(tok)


def attn_implementation(path: Path, device: torch.device, choice: str = "auto") -> str:
    """The ``attn_implementation`` a model directory loads with on ``device`` for ``choice`` (a trainer config's
    ``attention``): auto (torch's variable-length flash kernel on a GPU, :mod:`rlhf_core.models.attention`; SDPA
    elsewhere), sdpa, or varlen (forced; its torch reference on a CPU: tests, A/Bs).

    SDPA serves padded rows everywhere and packed rows on a CPU (a dense block-diagonal mask; correct,
    but no faster than padding). On a GPU packed rows go through flash attention's variable-length
    kernel (``rlhf_core.models.attention``), which skips the masked blocks: that is what makes packing pay.
    Flex attention was tried for packed rows before: no backward on a CPU, slower than padded SDPA on a
    GPU once compiled, and a compile per packed length (BENCHMARKS.md).
    """
    from transformers import AutoConfig  # lazy: transformers (~1 s; with a model only)

    if choice == "sdpa":
        return "sdpa"
    check_json_files(path)
    with refusing(path, "config.json"):
        config = AutoConfig.from_pretrained(str(path))
    try:
        varlen = attention.use_varlen(config, device, choice)
    except ValueError as exc:
        raise ValueError(f"attention: {exc}") from None
    return attention.register() if varlen else "sdpa"


def load_causal_lm(path: str | Path, device: torch.device | None = None, dtype: torch.dtype = torch.float32,
                   attention: str = "auto") -> Any:
    """An ``AutoModelForCausalLM`` from a local directory, its parameters in ``dtype`` on ``device``, its attention
    as ``attention`` says (:func:`attn_implementation`).

    Trainers pick ``dtype`` from their precision regime (:class:`rlhf_core.models.precision.Precision`):
    ``load_dtype`` for the trained model, ``weight_dtype`` for frozen ones. transformers keeps
    buffers (RoPE's ``inv_freq``) in fp32 whatever ``dtype`` is.
    """
    from transformers import AutoModelForCausalLM  # lazy: transformers (~1 s; with a model only)

    path = Path(path)
    if not (path / "config.json").exists():
        raise ModelLoadError(f"{path}: not a Hugging Face model directory (no config.json)")
    device = device or pick_device()
    implementation = attn_implementation(path, device, attention)
    weights = " / ".join(sorted(p.name for p in path.glob("*.safetensors*"))) or "weights"
    with refusing(path, f"a causal LM (config.json, generation_config.json, {weights})"):
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation=implementation)
    return model.to(device)


# --------------------------------------------------------------------------------------
# Memory switches: gradient checkpointing and LoRA (peft)
# --------------------------------------------------------------------------------------

# Bytes a parameter holds while it trains, by precision regime: weights + gradients + AdamW's two
# moments (+ the fp32 master copy under ``mixed``).
_STATE_BYTES = {"fp32": 4 + 4 + 8, "mixed": 2 + 4 + 4 + 8, "bf16": 2 + 2 + 8}


def activation_bytes(model_config: Any, tokens: int, *, checkpointing: bool, dtype_bytes: int = 2) -> int:
    """Estimated activation memory of one training micro-batch of ``tokens`` tokens.

    Per layer and token a decoder stores about ``10 h + 4 i`` values (h hidden, i MLP width: the
    norms' and projections' inputs, attention output, and the gate, up, activation and product of a
    SwiGLU MLP) when attention is flash-style (no ``s x s`` scores kept; Korthikanti et al. 2022,
    "Reducing Activation Recomputation", Sec. 4.1, with their ``5 a s / h`` term dropped). With
    checkpointing each layer keeps only its input (``h``), plus one layer's full set while it is
    recomputed.
    """
    h = int(getattr(model_config, "hidden_size"))
    i = int(getattr(model_config, "intermediate_size", 4 * h))
    layers = int(getattr(model_config, "num_hidden_layers"))
    full_layer = (10 * h + 4 * i) * tokens * dtype_bytes
    if checkpointing:
        return layers * h * tokens * dtype_bytes + full_layer
    return layers * full_layer


def resolve_checkpointing(setting: str, model: Any, tokens: int, precision: str) -> tuple[bool, str]:
    """``(on, why)`` for ``gradient_checkpointing`` = ``setting`` (auto, on or off).

    ``auto`` is off on a CPU (host memory is not the limit at the sizes a CPU trains) and on a GPU
    turns on only when the training states (:data:`_STATE_BYTES` per parameter) plus the micro-batch's
    activations without checkpointing (:func:`activation_bytes`, ``tokens`` the micro-batch's padded
    size) would exceed 85% of the memory free now: checkpointing costs about a third more compute.
    """
    if setting in ("on", "off"):
        return setting == "on", f"gradient_checkpointing: {setting}"
    device = next(model.parameters()).device
    if device.type != "cuda":
        return False, "gradient_checkpointing auto: off (not a CUDA device)"
    free, _total = torch.cuda.mem_get_info(device)
    n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    states = n_params * _STATE_BYTES.get(precision, _STATE_BYTES["fp32"])
    resident = sum(p.numel() * p.element_size() for p in model.parameters())  # already allocated: not in ``free``
    need = states - resident + activation_bytes(model.config, tokens, checkpointing=False)
    on = need > 0.85 * free
    return on, (f"gradient_checkpointing auto: {'on' if on else 'off'} (estimated {need / 2**30:.1f} GiB for "
                f"optimizer state and {tokens} tokens of activations, {free / 2**30:.1f} GiB free)")


def enable_checkpointing(model: Any) -> None:
    """Gradient checkpointing on every decoder layer (non-reentrant: works with frozen inputs, i.e. LoRA,
    and under DDP without extra flags)."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def prepare_for_training(model: Any, *, gradient_checkpointing: bool = False, lora_rank: int = 0,
                         lora_alpha: float = 16.0, lora_dropout: float = 0.0) -> Any:
    """Turn on gradient checkpointing and/or LoRA adapters, in place; returns the model to train.

    LoRA (Hu et al. 2021) comes from ``peft``: adapters ``W + (alpha / r) B A`` on every linear
    layer but the LM head, base weights frozen. ``peft`` injects the adapter modules into the
    model it wraps, so code holding the original model (an evaluation closure, the HF rollout
    engine) already runs with the adapters. Save with :func:`merged_model` to get a plain model.
    """
    if gradient_checkpointing:
        enable_checkpointing(model)
    if lora_rank > 0:
        from peft import LoraConfig, get_peft_model  # lazy: peft (LoRA only; several seconds to import)

        config = LoraConfig(r=lora_rank, lora_alpha=lora_alpha, lora_dropout=lora_dropout,
                            target_modules="all-linear", bias="none")
        get_peft_model(model, config)  # injects adapters into ``model`` itself
    return model


def has_lora(model: Any) -> bool:
    return any("lora_A" in name for name, _ in model.named_parameters())


def adapter_parameters(model: Any) -> dict[str, torch.nn.Parameter]:
    """``model``'s LoRA adapter parameters by name (peft's ``lora_A`` / ``lora_B``): what a LoRA policy trains, and
    all a rollout replica holding the same frozen base needs at each sync."""
    return {name: p for name, p in model.named_parameters() if "lora_" in name}


def copy_adapters(model: Any, weights: Mapping[str, torch.Tensor]) -> bool:
    """Copy ``weights`` into ``model``'s LoRA adapters in place when they are exactly its adapter tensors (a LoRA
    policy's sync: the frozen base is there already); ``False``, nothing copied, when ``model`` has no adapters or
    the names differ (the caller loads a whole state dict, or refuses)."""
    adapters = adapter_parameters(model)
    if not adapters or set(weights) != set(adapters):
        return False
    with torch.no_grad():
        for name, tensor in weights.items():
            adapters[name].copy_(tensor)
    return True


@contextmanager
def adapters_off(model: Any) -> Iterator[None]:
    """Within the block ``model``'s LoRA adapters are switched off (peft's per-layer switch), so it computes
    its frozen base: the reference of a LoRA run that started from that base. ``model`` is the model itself (a
    DDP or DeepSpeed wrapper holds the same object). Which parameters require a gradient is put back as it
    was (peft's switch also clears and resets it)."""
    from peft.tuners.tuners_utils import BaseTunerLayer  # lazy: peft (LoRA only; several seconds to import)

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    if not layers:
        raise ValueError("adapters_off: the model carries no LoRA adapters")
    grads = {p: p.requires_grad for p in model.parameters()}
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)
        for p, wanted in grads.items():
            p.requires_grad_(wanted)


def merged_model(model: Any) -> Any:
    """``model`` with any LoRA adapters folded into its weights and removed (a plain HF model).

    Call once, at the end: the adapters are gone afterwards.
    """
    if not has_lora(model):
        return model
    from peft.tuners.tuners_utils import BaseTunerLayer  # lazy: peft (LoRA only; several seconds to import)

    for module in model.modules():
        if isinstance(module, BaseTunerLayer):
            module.merge()
    _unwrap_lora_layers(model)
    return model


def _unwrap_lora_layers(model: Any) -> None:
    """Replace each (merged) LoRA layer by its base layer, so names and modules are the plain model's."""
    from peft.tuners.tuners_utils import BaseTunerLayer  # lazy: peft (LoRA only; several seconds to import)

    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, BaseTunerLayer):
                setattr(module, child_name, child.get_base_layer())
    model.requires_grad_(True)


def export_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """The plain model's weights (LoRA merged in, names without adapters), for a rollout engine; ``model`` is not
    changed.

    Each adapted weight is built out of place, ``W + get_delta_weight()`` per active adapter, the sum peft's
    ``merge()`` forms. Not peft's ``merge()`` then ``unmerge()``: that leaves ``(W + dW) - dW`` in the model, which
    in floating point is not ``W``, so the frozen base (and the KL reference taken with adapters off) moved by an
    ulp at every sync. Vanilla LoRA only (:func:`prepare_for_training` makes no other kind).
    """
    if not has_lora(model):
        return {k: v.detach() for k, v in model.state_dict().items()}
    from peft.tuners.lora import LoraLayer  # lazy: peft (LoRA only; several seconds to import)

    merged: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, layer in model.named_modules():
            if not isinstance(layer, LoraLayer):
                continue
            if layer.merged or layer.lora_variant or any(layer.lora_bias.values()):
                raise ValueError(f"{name}: only unmerged vanilla LoRA adapters can be exported")
            weight = layer.get_base_layer().weight.detach().clone()
            for adapter in layer.active_adapters:
                if adapter in layer.lora_A:
                    weight += layer.get_delta_weight(adapter)
            merged[f"{name}.base_layer.weight"] = weight
    return {key.replace(".base_layer.", "."): merged[key] if key in merged else value.detach().clone()
            for key, value in model.state_dict().items() if "lora_" not in key}
