"""Regional compilation: each decoder layer of a trained or scoring model through ``torch.compile``.

Why: at 0.5B our training steps are host-bound. An SFT step's kernels take under two thirds of the
step's time (BENCHMARKS.md, the step-gap profiles); the rest is the host launching a layer's
~40 small kernels (norms, rotary, SwiGLU, residual adds, casts) and running the modules' Python around them,
forward and backward. Inductor fuses those elementwise chains into a few kernels and replaces the module
calls by one graph call. Why a layer and not the model: every decoder layer runs the same code on the same
shapes, and parameters are graph inputs (``inline_inbuilt_nn_modules``, on by default in torch >= 2.5), so
one compiled graph serves all of them: the compile costs one layer's, not 24 (torch's "regional compilation"
recipe). The embedding, final norm and LM head stay eager: the head is ``rlhf_core.models.lm_head``'s business
(chunked, liger's fused cross-entropy).

Scope: passes without a KV cache (training forward and backward, reference and old log-prob passes, reward
scoring, the RL passes' shared-prompt prefix trees). A pass with a cache (HF ``generate``) runs the layers
eagerly: its cache object would change the graph at every step. Attention stays what the model attends with; torch's
variable-length flash kernel is a custom op (``torch_attn::_varlen_attn``) the graph calls as it is.

Shapes are dynamic from the first compile (``dynamic=True``): packed micro-batches change their token count
and sequence count every step, and one symbolic graph serves them all instead of a recompile per length.
"""

from __future__ import annotations

import logging
import types
from typing import Any

import torch

log = logging.getLogger(__name__)

__all__ = ["INDUCTOR_OPTIONS", "compile_decoder_layers", "decoder_layers", "use_compiled_layers"]

# Inductor compiles in this process (here and in rlhf_core.rollout.decode's decode step): its default pool of
# compile workers (one per core), started by the first compile, each importing torch, kept every core busy
# through the next steps, and the host-bound ones ran ~2x slower there (a 0.5B GRPO step's log-prob and update
# phases; BENCHMARKS.md); the compile needs only seconds.
INDUCTOR_OPTIONS = {"compile_threads": 1}

def decoder_layers(model: Any) -> list[torch.nn.Module]:
    """The decoder layers of ``model`` (DDP/DeepSpeed and peft wrappers looked through): the modules whose
    class name ends in ``DecoderLayer`` (transformers' naming for every decoder-only text model)."""
    return [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]


def use_compiled_layers(setting: str, device: torch.device, *, parallel: str, lora: bool) -> tuple[bool, str]:
    """Resolve ``compile_layers`` (auto, on, off) and say why; ``parallel`` is ``none`` (one process), ``ddp``,
    ``zero2`` or ``zero3``. auto compiles on a CUDA device (where the host is what limits a step) for one process
    or DDP; not under DeepSpeed (ZeRO-3 gathers each sub-module's parameters in hooks the graph would have to
    trace; ZeRO-2's gradient hooks with compiled layers have not been run on a GPU here) and not for a LoRA
    policy (peft's adapter dispatch is Python per call and changes with the active adapter). ``on`` compiles
    wherever asked except under ZeRO-3 (an error)."""
    if setting == "off":
        return False, "off"
    if parallel == "zero3":
        if setting == "on":
            raise RuntimeError("compile_layers: on does not work with parallel: zero3 (DeepSpeed's parameter hooks "
                               "inside each layer); use auto or off")
        return False, "off (auto: ZeRO-3)"
    if setting == "on":
        return True, "on"
    if device.type != "cuda":
        return False, "off (auto: no CUDA device)"
    if parallel == "zero2":
        return False, "off (auto: ZeRO-2)"
    if lora:
        return False, "off (auto: LoRA adapters)"
    return True, "on (auto: CUDA)"


class _Compiled:
    """One compiled forward per decoder-layer class and backend, shared by every layer of that class (and by every
    model in the process: policy and reference), with its eager fallback."""

    def __init__(self, eager: Any, backend: Any):
        self.eager = eager
        self.graph = torch.compile(eager, dynamic=True, fullgraph=True, backend=backend,
                                   options=INDUCTOR_OPTIONS if backend == "inductor" else None)
        self.failed: str | None = None

    def __call__(self, layer: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        if self.failed is not None or kwargs.get("past_key_values") is not None or kwargs.get("use_cache"):
            return self.eager(layer, *args, **kwargs)
        try:
            return self.graph(layer, *args, **kwargs)
        except (torch._dynamo.exc.TorchDynamoException, torch._dynamo.exc.FailOnRecompileLimitHit) as exc:
            # tracing, code generation or a recompile per call (a guard on something that differs by layer);
            # not a runtime error of the graph (out of memory passes through)
            self.failed = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            log.warning("compile_layers: compiling %s failed (%s); its layers run eagerly from now on",
                        type(layer).__name__, self.failed)
            return self.eager(layer, *args, **kwargs)


_COMPILED: dict[tuple[type, Any], _Compiled] = {}


def compile_decoder_layers(model: Any, backend: Any = "inductor") -> int:
    """Route every decoder layer of ``model`` (:func:`decoder_layers`) through its class's forward compiled by
    ``backend`` (a trainer config's ``compile_backend``: inductor, or aot_eager, the same traced forward and
    backward graphs run by eager kernels: CPU tests check tracing and numerics with it, without a C++ build per
    graph, and it tells a numerics difference of inductor's kernels from one of the tracing); returns how many
    layers. Only each instance's ``forward`` is replaced: parameters, their names, hooks and gradient
    checkpointing (which wraps the module call) stay as they were. Idempotent."""
    layers = decoder_layers(model)
    for layer in layers:
        key = (type(layer), backend)
        if key not in _COMPILED:
            _COMPILED[key] = _Compiled(type(layer).forward, backend)
        compiled = _COMPILED[key]
        layer.forward = types.MethodType(compiled, layer)
    return len(layers)
