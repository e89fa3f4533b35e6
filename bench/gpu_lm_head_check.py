"""The LM-head paths on a GPU: the CPU tests' comparison (``tests/unit/test_lm_head.py``,
``tests/model/test_lm_head_paths.py``) rerun once in bf16 on the card, plus what each path costs.

Three parts, written to ``$OUT/gpu_lm_head_check.json``:

* ``head``: one LM head of the 1.5B shape (16,381 tokens x 1,536 -> 151,936, bf16 weights and hidden
  states), per-token log-probs by ``full`` (whole float32 logits), ``chunked``, ``liger`` (chunks of about
  4,096 rows, as ``lm_head: liger`` runs it) and ``liger-default`` (liger's own chunking), against
  an fp32 reference; upstream gradient non-uniform (random signed per-token weights, as advantages are).
  Reports max |delta log p|, relative gradient error (hidden, weight), median time of forward +
  backward over 5 runs, and peak memory.
* ``model``: a Qwen2-0.5B-shaped random model (32k vocabulary), bf16, 8 rows x 512 tokens with the
  last 384 labelled: ``labelled_token_logprobs`` under each head kernel, with and without liger's fused
  RMSNorm/RoPE/SwiGLU, against ``full`` without fused kernels and against the fp32 model (the size of
  bf16 rounding itself): log-prob deltas, parameter-gradient relative error, time and peak memory.

On a lent GPU (``.devwheels`` carried, liger-kernel in it: ``bench/device_wheels.sh``)::

    source bench/device_setup.sh && python bench/gpu_lm_head_check.py --out $OUT/gpu_lm_head_check.json

* ``packed``: 32 sequences of 128-511 tokens as one padding-free row, through torch's variable-length
  flash kernel (``rlhf_core.models.attention``, what ``packing: true`` gets on a GPU) and through SDPA's dense
  block-diagonal mask, against padded rows through SDPA, each against fp32 padded rows: per-sequence
  log-prob sums and gradients, time and memory (``--parts packed`` runs this part alone).

* ``heads`` (``--parts heads``): the same comparison at a 1.5B DPO micro-batch's 5,501 scored tokens and at
  the 0.5B shape (14,901 x 896 -> 32,000).

* ``rlhead`` (``--parts rlhead``): the RL update's LM head, which logs each token's entropy: ``head_logprobs``
  with ``with_entropy`` and no entropy gradient, by ``auto`` as a CPU resolves it (whole logits under 2 GiB,
  else chunked with the entropy in each chunk) and as a GPU with liger does (liger's log-probs, the entropy
  beside them without a gradient), at a 0.5B GRPO micro-batch (128 rows x 256 tokens over 32,000) and a 1.5B
  one (32 x 256 over 151,936): log-prob and entropy deltas against fp32, gradient error, time and memory.

* ``rlpacked`` (``--parts rlpacked``): RL's response-token log-probs on rollout-shaped rows (64 rows, prompts of
  12-39 tokens shared by groups of 8, responses of 64-255) by padded rows, shared prompts (the default) and
  ``rl.packing`` (one padding-free row, varlen on a GPU), bf16 against fp32 padded rows, with an
  advantage-weighted backward: log-prob deltas, gradient error, time and memory.

* ``pairtree`` (``--parts pairtree``): preference pairs sharing their prompts (16 pairs, prompts of 64-199 tokens,
  answers of 128-399) as padded rows, prefix trees (``collate_pair_tree``: what DPO and the reward model run when
  ``packing`` is false) and one padding-free row (varlen on a GPU), bf16 against fp32 padded rows: DPO's response
  log-prob sums and the reward model's scores, signed per-sequence weights in backward; deltas, gradient error,
  time and memory.

* ``rmsnorm`` (``--parts rmsnorm``): one Llama-family RMSNorm at a 0.5B GRPO micro-batch's shape (35,200 x 896)
  and a 1.5B one's (8,800 x 1,536), bf16, forward + backward with a random upstream gradient, by the module
  itself, liger-kernel's ``LigerRMSNorm`` and torch's fused ``rms_norm`` (what ``apply_fused_kernels`` now
  uses): error against the fp32 module, device time a call (median of 5 runs of 200 calls, CUDA events) and
  host time a call (the same loop's wall time with the device kept ahead: launches only).

* ``nosync`` (``--parts nosync``): SFT, DPO and reward-model micro-batches, padded and packed, forward and
  backward under ``torch.cuda.set_sync_debug_mode("warn")``: how often and where each waits for the device.

* ``compiled`` (``--parts compiled``): the decoder layers through ``torch.compile`` (``compile_layers: on``) against
  the eager layers with liger's kernels, padded and packed rows, bf16 against fp32: log-prob sums, gradients, the
  first call's seconds (the compile), steady-state time, memory, and the graphs compiled.

``--small`` runs every part at toy sizes (CPU: the liger rows are skipped).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import torch  # noqa: E402

from lm_head_check_parts.kernels import head_part, rl_head_part, rms_norm_part  # noqa: E402
from lm_head_check_parts.layouts import packed_part, pair_tree_part, rl_packed_part  # noqa: E402
from lm_head_check_parts.models import compiled_part, model_part, nosync_part  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gpu_lm_head_check.json")
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--parts", default="head,model,packed",
                    help="comma-separated: head, heads, rlhead, model, packed, rlpacked, pairtree, rmsnorm, nosync, "
                         "compiled")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    reps = 2 if args.small else 5
    import transformers

    out = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "transformers": transformers.__version__, "small": args.small,
           "parts": sorted(parts)}
    if "head" in parts:  # token counts not divisible by 16: liger_token_logprobs pads them
        out["head"] = head_part(509 if args.small else 16381, 64 if args.small else 1536,
                                1000 if args.small else 151936, device, reps)
    if "heads" in parts:  # a 1.5B DPO micro-batch's scored tokens (8k-token packed rows), and 0.5B SFT's
        out["heads"] = [head_part(n, h, v, device, reps) for n, h, v in
                        ([(301, 64, 1000), (509, 32, 3000)] if args.small else [(5501, 1536, 151936), (14901, 896, 32000)])]
    if "rlhead" in parts:  # a 0.5B GRPO update micro-batch (128 x 256 tokens) and a 1.5B one (32 x 256)
        out["rlhead"] = [rl_head_part(n, h, v, device, reps) for n, h, v in
                         ([(301, 64, 1000), (509, 32, 3000)] if args.small else [(32768, 896, 32000), (8192, 1536, 151936)])]
    if "model" in parts:
        out["model"] = model_part(args.small, device, reps)
    if "packed" in parts:
        out["packed"] = packed_part(args.small, device, reps)
    if "rlpacked" in parts:
        out["rlpacked"] = rl_packed_part(args.small, device, reps)
    if "pairtree" in parts:
        out["pairtree"] = pair_tree_part(args.small, device, reps)
    if "rmsnorm" in parts:
        out["rmsnorm"] = rms_norm_part(args.small, device)
    if "nosync" in parts:
        out["nosync"] = nosync_part(args.small, device)
    if "compiled" in parts:
        out["compiled"] = compiled_part(args.small, device, reps)
    try:
        import liger_kernel  # noqa: F401
        from importlib.metadata import version

        out["liger_kernel"] = version("liger-kernel")
    except ImportError:
        out["liger_kernel"] = None
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
