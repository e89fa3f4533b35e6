"""The static engine's log-probs of its sampled tokens against the trainer's recomputation, on a GPU, at the GRPO
benchmark's shape (64 prompts x 8 samples x 256 new tokens, the side_by_side ``gpu`` variant's model, bf16).

One engine makes three generate calls with a weight change before each later one, as a training run does (every parameter
moved in place by a small random step, as an optimizer step moves them; no sync call: the engine holds the
model); the last call's rows (its phases timed) are scored by ``rl_forward.token_logprobs`` on the padded rows (the model's own head,
temperature 1) and compared on the sampled tokens: mean and max absolute difference, and the mismatch KL
``KL(engine || trainer)`` estimated on the samples (k1, the mean of ``log p_engine - log p_trainer``, and k3, the
mean of ``r - 1 - log r`` with ``r = p_trainer / p_engine``). Run it from the root of the tree to measure, after a
side_by_side call built the model in ``--work``::

    python bench/gpu_rollout_exactness.py --work /tmp/bw05 --out $OUT/exactness.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

import rlhf_core  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", required=True, help="side_by_side's --work folder (its model/ and tok/)")
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    from rlhf_core.models.loading import load_causal_lm, load_tokenizer
    from rlhf_core.rollout.engine import SamplingParams
    from rlhf_core.rollout.static import StaticCacheEngine
    from rlhf_core.trainers.rl_forward import token_logprobs

    dev = torch.device("cuda")
    work = Path(args.work)
    model = load_causal_lm(work / "model", dev, torch.bfloat16, "sdpa").eval().requires_grad_(False)
    tok = load_tokenizer(work / "model")
    prompts = [f"Question {i}: compute {i}*{i + 3} and explain" for i in range(args.rows // 8)]
    engine = StaticCacheEngine(model, tok, batch_size=args.rows)
    params = SamplingParams(n=8, temperature=1.0, max_new_tokens=args.new_tokens, seed=1)
    walls = []
    for call in range(3):
        if call == 2:  # the last call's phases (each waits for the device at its ends)
            engine.phase_seconds = {}
        if call:
            gen = torch.Generator(device=dev).manual_seed(3)
            with torch.no_grad():
                for p in model.parameters():  # an optimizer-sized step, in place
                    p.add_(torch.randn(p.shape, device=dev, generator=gen, dtype=torch.float32).to(p.dtype) * 1e-3)
        torch.cuda.synchronize()
        t = time.perf_counter()
        batch = engine.generate(prompts, SamplingParams(**{**params.__dict__, "seed": 1 + call}))
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - t)
    exp = {k: v.to(dev) for k, v in batch.learner_inputs().items()}
    P, mask = batch.prompt_ids.shape[1], batch.response_mask.to(dev).bool()
    with torch.no_grad():
        trainer = torch.cat([token_logprobs(model, {k: v[s:s + 64] for k, v in exp.items()}, P, 1.0)[0]
                             for s in range(0, args.rows, 64)])
    engine_logp = batch.sampling_logprobs.to(dev)
    d = (engine_logp - trainer.float())[mask].double()
    out = {"rlhf_core": rlhf_core.__file__, "device": torch.cuda.get_device_name(0), "rows": args.rows,
           "tokens": int(mask.sum()), "generate_walls_s": [round(w, 4) for w in walls],
           "mean_abs_diff": float(d.abs().mean()), "max_abs_diff": float(d.abs().max()),
           "mismatch_kl_k1": float(d.mean()), "mismatch_kl_k3": float((torch.exp(-d) - 1 + d).mean()),
           "last_call_phases_s": {k: round(v, 4) for k, v in engine.phase_seconds.items()},
           "kept_decoder": getattr(engine, "_kept", None) is not None}
    print(json.dumps(out))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
