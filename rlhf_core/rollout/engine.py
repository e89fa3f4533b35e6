"""Rollout engines: sample ``n`` completions per prompt and the log-prob of every sampled token.

Online RL (PPO, GRPO, RLOO, ...) needs, for each prompt, a group of sampled responses and
the behaviour policy's log-prob of each sampled token. A :class:`RolloutEngine` returns both
in one :class:`RolloutBatch`; trainers depend on the Protocol only, so the engine behind it
(Hugging Face ``generate`` here, vLLM in a later issue) is a config choice.

Which log-prob: ``sampling_logprobs`` are ``log_softmax(logits / temperature)`` of the sampled
token — temperature-scaled, *not* renormalised over the top-k / top-p nucleus. That is what
a trainer recomputes from its own forward pass (``logits / T`` then log-softmax, as OpenRLHF
and verl do), so on-policy importance ratios start at exactly 1. Any other engine must return
the same quantity: vLLM V1's default ``logprobs_mode="raw_logprobs"`` is *before* temperature,
so a vLLM engine has to ask for temperature-processed log-probs or recompute them.

Example::

    engine = HFGenerateEngine(model, tokenizer, batch_size=16)
    batch = engine.generate(prompts, SamplingParams(n=4, temperature=1.0, max_new_tokens=32, seed=step))
    ids, mask = batch.sequences()
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Protocol, Sequence, runtime_checkable

import torch

from rlhf_core.data.tokenize import encode_prompt
from rlhf_core.models.fp8 import load_quantized, quantize_linears
from rlhf_core.models.loading import copy_adapters, has_lora, load_causal_lm


@dataclass(frozen=True)
class SamplingParams:
    """How to sample a rollout; validated on construction."""

    n: int = 1
    """Samples per prompt (the group size of GRPO / RLOO)."""
    temperature: float = 1.0
    """Softmax temperature; 0 = greedy (log-probs are then of the unscaled logits)."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]; 1 = off."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 = off."""
    max_new_tokens: int = 64
    """Upper bound on response length (tokens, eos included)."""
    seed: int | None = None
    """Seed for this call (vary it per step); ``None`` draws from torch's global RNG."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end a response like eos (kept in it, as eos is): a tool call's closing tag in a
    multi-turn rollout (:mod:`rlhf_core.rollout.environments`). Empty: eos only."""

    def __post_init__(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"SamplingParams.n must be an integer >= 1, got {self.n!r}")
        if not self.temperature >= 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"SamplingParams.seed must be an integer or None, got {self.seed!r}")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"SamplingParams.stop_token_ids must be token ids (integers >= 0), "
                             f"got {self.stop_token_ids!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class RolloutBatch:
    """``B`` prompts times ``n`` samples = ``B*n`` rows; rows ``i*n .. (i+1)*n - 1`` are prompt ``i``'s group.

    Tensors are on the CPU. ``P`` is the longest prompt, ``R`` the longest response.
    """

    prompts: list[str]
    """``(B*n,)`` each prompt repeated ``n`` times, contiguously."""
    completions: list[str]
    """``(B*n,)`` decoded responses (special tokens, eos included, skipped)."""
    prompt_ids: torch.Tensor
    """``(B*n, P)`` long, left-padded with the pad id."""
    prompt_mask: torch.Tensor
    """``(B*n, P)`` long, 1 on prompt tokens."""
    response_ids: torch.Tensor
    """``(B*n, R)`` long, right-padded with the pad id."""
    response_mask: torch.Tensor
    """``(B*n, R)`` long, 1 on generated tokens up to and including the first eos, 0 after."""
    sampling_logprobs: torch.Tensor
    """``(B*n, R)`` float32 ``log_softmax(logits / T)`` of each sampled token (module docstring); 0 where masked."""
    group_size: int
    """``n``: samples per prompt."""
    action_mask: torch.Tensor | None = None
    """``(B*n, R)`` long, 1 on the tokens the policy sampled, 0 on observation tokens an environment appended
    (multi-turn rollouts, :mod:`rlhf_core.rollout.environments`); ``None``: every response token is the policy's."""
    tool_calls: torch.Tensor | None = None
    """``(B*n,)`` long: environment steps (tool calls) of each trajectory; ``None`` without an environment."""

    def __post_init__(self) -> None:
        rows = len(self.prompts)
        if len(self.completions) != rows or rows % max(self.group_size, 1):
            raise ValueError(f"RolloutBatch: {rows} prompts, {len(self.completions)} completions, "
                             f"group_size {self.group_size}")
        for name in ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "sampling_logprobs"):
            t = getattr(self, name)
            if t.dim() != 2 or t.shape[0] != rows:
                raise ValueError(f"RolloutBatch.{name}: expected ({rows}, L), got {tuple(t.shape)}")
        if self.prompt_ids.shape != self.prompt_mask.shape:
            raise ValueError("RolloutBatch: prompt_ids and prompt_mask differ in shape")
        if not self.response_ids.shape == self.response_mask.shape == self.sampling_logprobs.shape:
            raise ValueError("RolloutBatch: response_ids, response_mask and sampling_logprobs differ in shape")
        if self.action_mask is not None and self.action_mask.shape != self.response_mask.shape:
            raise ValueError("RolloutBatch: action_mask and response_mask differ in shape")

    def loss_mask(self) -> torch.Tensor:
        """``(B*n, R)`` long: the tokens the loss and the advantages cover, the policy's own samples
        (``response_mask``, times ``action_mask`` when observations are interleaved)."""
        return self.response_mask if self.action_mask is None else self.response_mask * self.action_mask

    def __len__(self) -> int:
        return len(self.prompts)

    def sequences(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(B*n, P+R)`` ids and attention mask of prompt + response (padding on both ends)."""
        return (torch.cat([self.prompt_ids, self.response_ids], dim=1),
                torch.cat([self.prompt_mask, self.response_mask], dim=1))

    def position_ids(self) -> torch.Tensor:
        """``(B*n, P+R)`` positions counted from each row's first real token, as ``generate`` used.

        Pass them with :meth:`sequences` when recomputing log-probs: without them a
        left-padded row is scored at shifted positions and its log-probs drift.
        """
        _, mask = self.sequences()
        return (mask.cumsum(-1) - 1).clamp(min=0)

    def learner_inputs(self) -> dict[str, torch.Tensor]:
        """What the learner scores the rows from (:func:`rlhf_core.trainers.rl_forward.token_logprobs`):
        ``input_ids``, ``attention_mask`` and ``position_ids``, each ``(B*n, P+R)`` (:meth:`sequences`,
        :meth:`position_ids`), and the ``(B*n, R)`` ``response_ids`` it takes the log-probs of."""
        ids, attention = self.sequences()
        return {"input_ids": ids, "attention_mask": attention, "position_ids": self.position_ids(),
                "response_ids": self.response_ids}

    def response_lengths(self) -> torch.Tensor:
        """``(B*n,)`` long: tokens generated per row, eos included."""
        return self.response_mask.sum(-1)


@runtime_checkable
class RolloutEngine(Protocol):
    """Samples rollouts from the current policy; kept engine-agnostic (HF ``generate``, vLLM, ...)."""

    @property
    def name(self) -> str:
        """Short engine name for logs and metrics (``hf``, ``vllm``)."""
        ...

    def generate(self, prompts: Sequence[str], params: SamplingParams) -> RolloutBatch:
        """``params.n`` samples for each raw prompt, grouped contiguously."""
        ...

    def update_weights(self, weights: Mapping[str, torch.Tensor] | torch.nn.Module | str | Path) -> int:
        """Make the next :meth:`generate` sample from ``weights`` (a state dict, a model or an HF directory);
        returns the bytes of weights the engine took in (:func:`tensor_bytes`; 0 when handed the model it samples
        from), which the trainer logs as ``perf/weight_sync_bytes``."""
        ...


def tensor_bytes(weights: Mapping[str, Any]) -> int:
    """Bytes of the tensors among ``weights``' values (what a weight sync moves: a state dict, adapters, a bucket)."""
    return sum(v.numel() * v.element_size() for v in weights.values() if isinstance(v, torch.Tensor))


@runtime_checkable
class ReleasesWeights(Protocol):
    """An engine whose weights' memory can be handed back between a rollout and the next weight sync (colocated Ray
    replicas under ``rl.rollout.sleep``, :class:`rlhf_core.trainers.rl_on_ray.RemoteRollout`): the controller calls
    :meth:`release_weights` once a step's rollout is done, and the sync after the update allocates and fills them again.
    Only where every rollout is followed by a sync of the whole weights (synchronous)."""

    def release_weights(self) -> int:
        """Free the weights until the next ``update_weights``; the bytes freed (0 where this engine keeps them)."""
        ...


@runtime_checkable
class LoadsWeightBuckets(Protocol):
    """An engine that takes new weights a bucket at a time (``rl.distribution.weight_sync`` collective,
    :mod:`rlhf_core.distributed.weight_sync`): the seam a Ray rollout replica hands each broadcast bucket through."""

    def load_weight_bucket(self, weights: Mapping[str, torch.Tensor], last: bool) -> None:
        """Copy ``weights`` (named tensors by the policy's parameter names, on the engine's device, valid only
        during the call) into the engine's model in place; ``last``: the sync's final bucket (refresh whatever
        derives from the weights: a sampling copy, a prefix cache)."""
        ...


# --------------------------------------------------------------------------------------
# Hugging Face generate
# --------------------------------------------------------------------------------------


class _SampledTokenLogprobs:
    """A logits processor that records ``log_softmax(logits / T)`` of each sampled token.

    ``generate`` calls processors once per step with the ids so far; the token sampled at
    step ``t`` is therefore known at call ``t + 1``, so this keeps only the previous step's
    ``(rows, vocab)`` distribution. ``output_logits=True`` would instead hold all ``R`` steps
    (``rows * R * vocab`` floats — gigabytes at a 150k vocabulary) until generation ends.
    """

    def __init__(self, temperature: float, prompt_width: int):
        self.temperature = temperature or 1.0  # greedy: log-probs of the unscaled logits
        self.prompt_width = prompt_width
        self.prev: torch.Tensor | None = None
        self.steps: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[1] > self.prompt_width:
            self.steps.append(self.prev.gather(-1, input_ids[:, -1:]).squeeze(-1))
        self.prev = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        return scores

    def collect(self, response_ids: torch.Tensor) -> torch.Tensor:
        """``(rows, R)`` log-probs of ``response_ids``; the last step's token is read from the output."""
        if len(self.steps) != response_ids.shape[1] - 1 or self.prev is None:
            raise RuntimeError(f"generate made {response_ids.shape[1]} tokens but called the logits processor "
                               f"{len(self.steps) + 1} times; log-probs would be misaligned")
        last = self.prev.gather(-1, response_ids[:, -1:].to(self.prev.device)).squeeze(-1)
        return torch.stack(self.steps + [last], dim=1)


@contextlib.contextmanager
def _plain_generation_config(model: Any, eos_id: int, pad_id: int) -> Iterator[None]:
    """Hide the model's own ``generation_config`` while sampling.

    ``generate`` fills every unset option from it, so a checkpoint shipping e.g.
    ``repetition_penalty=1.05`` would silently sample from a distribution other than
    ``softmax(logits / T)`` and break the log-prob contract above.
    """
    from transformers import GenerationConfig  # lazy: transformers (~1 s; generation only)

    saved = model.generation_config
    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id)
    try:
        yield
    finally:
        model.generation_config = saved


def _left_pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):  # left padding: every prompt ends at the same column
        ids[i, width - len(r):] = torch.tensor(r, dtype=torch.long)
        mask[i, width - len(r):] = 1
    return ids, mask


def _pad_to(t: torch.Tensor, width: int, value: float, *, left: bool) -> torch.Tensor:
    extra = width - t.shape[1]
    if extra == 0:
        return t
    fill = torch.full((t.shape[0], extra), value, dtype=t.dtype)
    return torch.cat([fill, t] if left else [t, fill], dim=1)


def decode_rows(rows: Sequence[list[int]], tokenizer: Any) -> list[str]:
    """``tokenizer.decode(row, skip_special_tokens=True)`` for every row. A fast tokenizer without the
    clean-up pass decodes them in one call of its Rust backend (``decode_batch``): the same strings, without
    transformers' per-call Python work (512 rows of up to 256 tokens, the GPU bench's 32k BPE, on this project's
    2-core CPU host: 18 ms row by row, 12.5 ms batched; tests/model/test_rollout_hf.py checks the strings)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return [tokenizer.decode(row, skip_special_tokens=True) for row in rows]
    return backend.decode_batch(list(rows), skip_special_tokens=True)


def assemble_batch(tokenizer: Any, prompts: Sequence[str], n: int, chunks: Sequence[tuple[torch.Tensor, ...]]) -> RolloutBatch:
    """One :class:`RolloutBatch` from per-chunk ``(prompt_ids, prompt_mask, response_ids, response_mask,
    logprobs)``: prompts left-padded and responses right-padded to the widest chunk, completions decoded."""
    pad = tokenizer.pad_token_id
    p_width = max(c[0].shape[1] for c in chunks)
    r_width = max(c[2].shape[1] for c in chunks)
    prompt_ids = torch.cat([_pad_to(c[0], p_width, pad, left=True) for c in chunks])
    prompt_mask = torch.cat([_pad_to(c[1], p_width, 0, left=True) for c in chunks])
    response_ids = torch.cat([_pad_to(c[2], r_width, pad, left=False) for c in chunks])
    response_mask = torch.cat([_pad_to(c[3], r_width, 0, left=False) for c in chunks])
    logprobs = torch.cat([_pad_to(c[4], r_width, 0.0, left=False) for c in chunks])
    completions = decode_rows([ids[:k] for ids, k in zip(response_ids.tolist(), response_mask.sum(-1).tolist())],
                              tokenizer)
    return RolloutBatch(prompts=[p for p in prompts for _ in range(n)], completions=completions,
                        prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
                        response_mask=response_mask, sampling_logprobs=logprobs, group_size=n)


def response_mask_from_ids(response_ids: torch.Tensor, eos_id: int, stop_ids: Sequence[int] = ()) -> torch.Tensor:
    """``(rows, R)`` long: 1 up to and including each row's first ``eos_id`` (or stop id), all 1 where none."""
    is_eos = (response_ids == eos_id).long()
    for stop in stop_ids:
        is_eos |= (response_ids == stop).long()
    eos_before = is_eos.cumsum(-1) - is_eos  # eos tokens strictly before each position
    return (eos_before == 0).long()


class HFGenerateEngine:
    """Rollouts from a Hugging Face causal LM with ``model.generate`` (left-padded batches, KV cache).

    The reference engine: exact and dependency-free, not fast. Holding the trainer's own
    model object makes weight sync free — :meth:`update_weights` with that object is a no-op.
    """

    def __init__(self, model: Any, tokenizer: Any, batch_size: int = 16, autocast_dtype: torch.dtype | None = None,
                 fp8: bool = False):
        """``fp8`` (``rl.rollout.fp8``): sample through a copy whose linear layers but the LM head are e4m3
        (:mod:`rlhf_core.models.fp8`), quantized again from the model's weights at every :meth:`update_weights`."""
        if batch_size < 1:
            raise ValueError(f"{type(self).__name__}: batch_size must be >= 1, got {batch_size}")
        if tokenizer.eos_token_id is None or tokenizer.pad_token_id is None:
            raise ValueError(f"{type(self).__name__}: tokenizer needs an eos and a pad token (use models.load_tokenizer)")
        self.model, self.tokenizer, self.batch_size = model, tokenizer, batch_size
        # Sampling runs in ``autocast_dtype``: a policy already in it (the trainer's mixed and bf16
        # regimes hold a bf16 model) is sampled directly; an fp32 one through a bf16 copy refreshed
        # by update_weights, so the decode loop does no fp32 -> bf16 casts (a GRPO rollout about
        # 30% shorter than with fp32 weights; bench/gpu_grpo.py, BENCHMARKS.md). None: sample
        # with the model itself, in its own dtype.
        self.autocast_dtype, self.fp8 = autocast_dtype, fp8
        self.sampler = None
        own = next(model.parameters()).dtype
        if fp8 and has_lora(model):
            raise ValueError(f"{type(self).__name__}: fp8 sampling needs a model without LoRA adapters (merge them "
                             "first)")
        if fp8 or (autocast_dtype is not None and own != autocast_dtype):
            self.sampler = copy.deepcopy(model).to(autocast_dtype or own).eval().requires_grad_(False)
            if fp8:
                quantize_linears(self.sampler)

    @property
    def name(self) -> str:
        return "hf"

    def update_weights(self, weights: Mapping[str, torch.Tensor] | torch.nn.Module | str | Path) -> int:
        """Load a state dict, another model's weights or an HF directory into the engine's model; for a model
        carrying LoRA adapters, also exactly its adapter tensors (:meth:`PolicyLearner.engine_weights` with
        ``adapters_only``), copied in place. Returns the bytes copied in (the sampling copy's refresh counts; the
        trainer's own model without one is 0: nothing moves)."""
        if weights is self.model:  # the trainer's model itself: already current, or refresh the copy
            if self.sampler is None:
                return 0
            with torch.no_grad():
                if self.fp8:  # each sync quantizes the new weights again
                    load_quantized(self.sampler, self.model.named_parameters())
                    return tensor_bytes(self.sampler.state_dict())
                for mine, theirs in zip(self.sampler.parameters(), self.model.parameters()):
                    mine.copy_(theirs)
            return tensor_bytes(dict(self.sampler.named_parameters()))
        if isinstance(weights, (str, Path)):
            weights = load_causal_lm(weights, torch.device("cpu"))
        if isinstance(weights, torch.nn.Module):
            weights = weights.state_dict()

        if not copy_adapters(self.model, weights):  # not a LoRA policy's adapters alone: the whole weights
            self.model.load_state_dict(weights, strict=True)
        if self.sampler is not None:
            self.update_weights(self.model)
        return tensor_bytes(weights)

    def load_weight_bucket(self, weights: Mapping[str, torch.Tensor], last: bool) -> None:
        """One bucket of a collective sync (:class:`LoadsWeightBuckets`), copied into the model's parameters in
        place (captured CUDA graphs stay valid); the last one refreshes the sampling copy."""
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, tensor in weights.items():
                if name not in params:
                    raise KeyError(f"{type(self).__name__}.load_weight_bucket: the model has no parameter {name!r}")
                params[name].copy_(tensor)
        if last and self.sampler is not None:
            self.update_weights(self.model)

    @property
    def _sampling_model(self) -> Any:
        return self.sampler if self.sampler is not None else self.model

    def _encode(self, prompts: Sequence[str]) -> list[list[int]]:
        """Token ids of each prompt; an empty list, or a prompt with no tokens, is an error naming it."""
        if not prompts:
            raise ValueError(f"{type(self).__name__}.generate: no prompts")
        encoded = [encode_prompt(self.tokenizer, p) for p in prompts]
        empty = [i for i, ids in enumerate(encoded) if not ids]
        if empty:
            raise ValueError(f"{type(self).__name__}.generate: prompt {empty[0]} encodes to no tokens")
        return encoded

    def generate(self, prompts: Sequence[str], params: SamplingParams) -> RolloutBatch:
        """``params.n`` samples per prompt; see :class:`RolloutBatch` for the layout."""
        return self.generate_ids(self._encode(prompts), params, prompts)

    @torch.no_grad()
    def generate_ids(self, encoded: Sequence[list[int]], params: SamplingParams,
                     prompts: Sequence[str] | None = None) -> RolloutBatch:
        """:meth:`generate` from token ids: a multi-turn rollout continues each trajectory's exact ids
        (:func:`rlhf_core.rollout.environments.rollout_with_environment`), never a re-tokenisation of its text.
        ``prompts`` only labels the batch's rows (default: empty strings)."""
        prompts = list(prompts) if prompts is not None else [""] * len(encoded)
        device = torch.device("cpu")
        try:
            device = next(self._sampling_model.parameters()).device
        except StopIteration:
            pass
        model = self._sampling_model
        was_training = model.training
        model.eval()
        # A private RNG stream: a seeded rollout neither depends on nor disturbs the trainer's RNG.
        rng_devices = [device] if device.type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=rng_devices, enabled=params.seed is not None):
                if params.seed is not None:
                    torch.manual_seed(params.seed)
                chunks = [self._generate_chunk(encoded[s:s + self.batch_size], params, device)
                          for s in range(0, len(encoded), self.batch_size)]
        finally:
            model.train(was_training)
        return assemble_batch(self.tokenizer, prompts, params.n, chunks)

    def _generate_chunk(self, encoded: Sequence[list[int]], params: SamplingParams,
                        device: torch.device) -> tuple[torch.Tensor, ...]:
        """Prompt ids/mask, response ids/mask and log-probs of one batch, each ``(rows * n, L)`` on the CPU."""
        from transformers import LogitsProcessorList  # lazy: transformers (~1 s; generation only)
        from transformers.generation.logits_process import (  # lazy: transformers (~1 s; generation only)
            TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

        eos, pad = self.tokenizer.eos_token_id, self.tokenizer.pad_token_id
        ids, mask = _left_pad(encoded, pad)
        # The n copies of each prompt are made here, exactly as num_return_sequences would
        # (repeat_interleave), because generate refuses num_return_sequences > 1 when greedy.
        ids, mask = ids.repeat_interleave(params.n, dim=0), mask.repeat_interleave(params.n, dim=0)
        recorder = _SampledTokenLogprobs(params.temperature, ids.shape[1])
        # generate's own warpers are switched off (temperature 1, top-k 0, top-p 1) and ours
        # run in a fixed order after the recorder: its position must not depend on how a
        # transformers release orders processors.
        processors: list[Any] = [recorder]
        if not params.greedy:
            if params.temperature != 1.0:
                processors.append(TemperatureLogitsWarper(params.temperature))
            if params.top_k:
                processors.append(TopKLogitsWarper(top_k=params.top_k))
            if params.top_p < 1.0:
                processors.append(TopPLogitsWarper(top_p=params.top_p))
        model = self._sampling_model
        with _plain_generation_config(model, eos, pad):
            out = model.generate(
                input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=not params.greedy,
                temperature=1.0, top_k=0, top_p=1.0,
                max_new_tokens=params.max_new_tokens, pad_token_id=pad, use_cache=True,
                eos_token_id=[eos, *params.stop_token_ids] if params.stop_token_ids else eos,
                logits_processor=LogitsProcessorList(processors))
        response = out[:, ids.shape[1]:]
        logprobs = recorder.collect(response).float().cpu()
        response = response.cpu()
        response_mask = response_mask_from_ids(response, eos, params.stop_token_ids)
        response = response.masked_fill(response_mask == 0, pad)
        return ids, mask, response, response_mask, logprobs.masked_fill(response_mask == 0, 0.0)
