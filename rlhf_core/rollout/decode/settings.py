"""The static engine's decode switches, declared once: :data:`SETTINGS`.

The defaults are what an RL run gets. Benchmarks set fields by name to A/B one choice against another
(``bench/gpu_engine.py``'s engines, ``bench/gpu_profile.py``), tests through ``monkeypatch.setattr(SETTINGS, ...)``;
a misspelt field raises (the class has slots). A decoder reads them when it is built, the eager decode loop
(``compact_below``) each time it checks for finished rows.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class DecodeSettings:
    """Switches of :class:`rlhf_core.rollout.static.StaticCacheEngine`'s decode step."""

    attention: str = "auto"
    """The decode step's attention: triton (our flash-decoding kernel over each row's filled keys,
    rlhf_core/models/decode_attention.py: a GPU with Triton), flash (torch's varlen flash kernel over the same keys:
    a GPU, bf16/fp16), sdpa (SDPA over the whole cache with a key mask) or auto (triton on Hopper where it builds,
    else flash where it runs, else sdpa: :func:`rlhf_core.rollout.decode.attention.choose_row_kernel`). triton and
    flash share the cache layout; on a CPU, flash is the torch reference of that layout (tests) and triton runs under
    Triton's interpreter (TRITON_INTERPRET=1)."""

    compile_layers: bool = True
    """Whether the decode step's layer pieces are compiled (torch.compile) where CUDA graphs are captured; the
    engine's own ``compile_layers`` argument, when given, overrides it."""

    compile_sampler: bool = True
    """With compiled layers, whether sampling's weights (log-softmax, filters, exponential) are compiled too (the
    torch sampler's, and the triton sampler's fallback for greedy, top-k and top-p)."""

    sampler: str = "auto"
    """The decode step's sampling without top-k / top-p: triton (one Triton kernel a step, the inverse-CDF rule of
    rlhf_core/models/fused_sampling.py over the logits in their own dtype: a GPU with Triton), torch (log-softmax,
    cumsum and searchsorted over (rows, V) fp32 arrays: rlhf_core.rollout.decode.sampling.sample) or auto (triton on a
    CUDA device where Triton imports, else torch: :func:`rlhf_core.rollout.decode.sampling.choose_sampler`). Greedy,
    top-k and top-p sample with torch under every choice; on a CPU, triton runs under Triton's interpreter
    (TRITON_INTERPRET=1, tests)."""

    flash_grouped: bool = True
    """Whether the flash call folds each KV head's query heads into its query rows (the kernel then reads a row's
    keys once per KV head, not once per query head)."""

    width_bucket: int = 0
    """Columns between the cache widths of the decode graphs (see ``Decoder.width_buckets``); 0: one graph over the
    whole cache. Measured (512 x 256, BENCHMARKS.md) when graphs were captured every generate call: eight 32-column
    graphs were ~25% slower than one graph, the extra captures costing more than the narrower attention saved."""

    sdpa_backends: tuple[str, ...] | None = None
    """SDPA backends a decode step may use (None: torch's choice, cuDNN on Hopper), by name of
    torch.nn.attention.SDPBackend; bench/gpu_engine.py's static_cuda_graphs_<backend> engines A/B them."""

    keep_decoder: bool = True
    """Whether the engine keeps a chunk's decoder (KV cache, fused weight copies, captured graphs) for the next chunk
    of the same shape and sampling settings, resetting its buffers and copying the current weights in, instead of
    building and capturing afresh each call. The cost: the cache and the copies stay allocated between rollouts."""

    compact_below: float = 0.75
    """The eager decode (the CPU's) drops finished rows from its batch once this share or fewer of them still run:
    each drop copies the live rows' caches, so it waits for a quarter of the rows to finish."""


SETTINGS = DecodeSettings()
