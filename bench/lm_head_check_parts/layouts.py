"""Row layouts through a whole model, bf16 against fp32 padded rows: ``packed`` (one padding-free row), ``rlpacked``
(RL's rollout-shaped rows), ``pairtree`` (preference pairs as prefix trees).
"""

from __future__ import annotations

import torch

from rlhf_core.models.lm_head import LMHead, labelled_token_logprobs

from .common import grads_and_cost_vs_fp32, pairs_sharing_prompts, random_model_dir, timed, values_and_grads


def packed_part(small: bool, device: torch.device, reps: int) -> dict:
    """Padding-free rows against padded rows through SDPA: per-sequence log-prob sums and parameter
    gradients, bf16, signed per-sequence weights, each against fp32 padded rows. Packed rows run through
    both attention paths (a trainer config's ``attention``): ``varlen`` (torch's flash varlen kernel, what
    ``packing: true`` gets on a GPU) and ``sdpa`` (transformers' dense block-diagonal mask)."""
    from rlhf_core.models import attention
    from rlhf_core.data.tokenize import TokenizedExample, collate_packed, collate_padded
    from rlhf_core.algorithms.logprobs import sequence_sums
    from rlhf_core.models.loading import load_causal_lm

    model_dir, vocab = random_model_dir(small, "packed-")
    g = torch.Generator().manual_seed(2)
    rows = 4 if small else 32
    lengths = torch.randint(16 if small else 128, 64 if small else 512, (rows,), generator=g).tolist()
    examples = []
    for n in lengths:
        ids = torch.randint(0, vocab - 10, (n,), generator=g).tolist()
        examples.append(TokenizedExample(input_ids=ids, labels=[-100] * (n // 4) + ids[n // 4:]))
    weights = (torch.randn(rows, generator=g) * 2).to(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    out: dict = {"rows": rows, "tokens": sum(lengths), "padded_tokens": rows * max(lengths), "dtype": str(dtype)}
    try:
        from torch.nn.attention.varlen import varlen_attn
        import inspect

        out["varlen_attn_signature"] = str(inspect.signature(varlen_attn))
    except ImportError:
        out["varlen_attn_signature"] = None
    results = {}
    for name, packed, model_dtype, impl in (("fp32-padded", False, torch.float32, "sdpa"),
                                            ("padded-sdpa", False, dtype, "sdpa"),
                                            ("packed-sdpa", True, dtype, "sdpa"),
                                            ("packed-varlen", True, dtype, "varlen")):
        model = load_causal_lm(model_dir, device, attention=impl).to(model_dtype)
        batch = collate_packed(examples) if packed else collate_padded(examples, 0)

        def step():
            model.zero_grad(set_to_none=True)
            sums = sequence_sums(labelled_token_logprobs(model, batch, LMHead("chunked", 4096)), batch)
            (sums * weights).sum().backward()
            return sums.detach().float()

        before = dict(attention.calls)
        sums = step()
        grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
        if name == "fp32-padded":
            exact = (sums, grads)
            continue
        times, peak = timed(step, reps)
        results[name] = {"attention": model.config._attn_implementation,
                         "layer_calls": {k: attention.calls[k] - before[k] for k in before},
                         "max_abs_dsum_vs_fp32": float((sums - exact[0]).abs().max()),
                         **grads_and_cost_vs_fp32(grads, exact[1], times, peak)}
        model = None  # freed before the next variant loads
    out["results"] = results
    return out


def rl_packed_part(small: bool, device: torch.device, reps: int) -> dict:
    """RL's response-token log-probs (``rl_forward.token_logprobs``, temperature 0.9, the entropy logged) on rows
    laid out as the rollout leaves them, left-padded prompts shared by groups of 8 and right-padded responses,
    by the three layouts the trainer has: padded rows, each distinct prompt once (the default), and one
    padding-free row (``rl.packing``, torch's varlen flash kernel on a GPU); bf16, advantage-weighted backward,
    each against fp32 padded rows: log-prob deltas, gradient error, time and peak memory."""
    from rlhf_core.models.loading import load_causal_lm
    from rlhf_core.trainers.rl_forward import token_logprobs

    model_dir, vocab = random_model_dir(small, "rlpacked-")
    g = torch.Generator().manual_seed(3)
    prompts, group = (2, 4) if small else (8, 8)
    rows = prompts * group
    p_len = torch.randint(6 if small else 12, 12 if small else 40, (prompts,), generator=g).repeat_interleave(group)
    r_len = torch.randint(4 if small else 64, 16 if small else 256, (rows,), generator=g)
    P, R = int(p_len.max()), int(r_len.max())
    ids = torch.randint(0, vocab - 10, (prompts, P + R), generator=g).repeat_interleave(group, dim=0)
    ids[:, P:] = torch.randint(0, vocab - 10, (rows, R), generator=g)  # the group's samples differ
    cols = torch.arange(P + R)
    attention = ((cols >= P - p_len[:, None]) & (cols < P + r_len[:, None])).long()
    exp = {"input_ids": ids * attention, "attention_mask": attention,
           "position_ids": (attention.cumsum(-1) - 1).clamp(min=0), "response_ids": (ids * attention)[:, P:]}
    exp = {k: v.to(device) for k, v in exp.items()}
    mask = attention[:, P:].float().to(device)
    adv = (torch.randn(rows, R, generator=g) * 2).to(device) * mask
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    out = {"rows": rows, "prompt_width": P, "response_width": R, "tokens": int(attention.sum()),
           "padded_tokens": rows * (P + R), "dtype": str(dtype)}
    results, exact = {}, None
    for name, model_dtype, way, impl in (("fp32-padded", torch.float32, {}, "sdpa"),
                                         ("padded", dtype, {}, "sdpa"),
                                         ("shared-prompts", dtype, {"share_prompts": True}, "auto"),
                                         ("packed-varlen", dtype, {"packed": True}, "auto")):
        model = load_causal_lm(model_dir, device, attention=impl).to(model_dtype).eval()

        def step():
            model.zero_grad(set_to_none=True)
            logp, _ = token_logprobs(model, exp, P, 0.9, with_entropy=True, head=LMHead("chunked", 4096), **way)
            (logp * adv).sum().backward()
            return logp.detach().float() * mask

        logp, grads = values_and_grads(step, model)
        if exact is None:
            exact = (logp, grads)
            continue
        times, peak = timed(step, reps)
        results[name] = {"attention": model.config._attn_implementation,
                         "max_abs_dlogp_vs_fp32": float((logp - exact[0]).abs().max()),
                         "mean_abs_dlogp_vs_fp32": float((logp - exact[0]).abs().sum() / mask.sum()),
                         **grads_and_cost_vs_fp32(grads, exact[1], times, peak)}
        model = None  # freed before the next variant loads
    out["results"] = results
    return out


def pair_tree_part(small: bool, device: torch.device, reps: int) -> dict:
    """Pairs as prefix trees (``collate_pair_tree``, what DPO and the reward model run when ``packing`` is false)
    against padded rows and one padding-free row (varlen on a GPU), bf16, each against fp32 padded rows: DPO's
    per-sequence response log-prob sums and the reward model's scores, signed per-sequence weights in backward;
    value deltas, gradient error, time and peak memory."""
    from rlhf_core.data.tokenize import collate_pair_tree, collate_pairs
    from rlhf_core.algorithms.logprobs import response_logprobs
    from rlhf_core.models.loading import load_causal_lm
    from rlhf_core.rewards.model import load_reward_model, pair_rewards

    from transformers import AutoConfig

    model_dir, vocab = random_model_dir(small, "pairtree-")
    pad = AutoConfig.from_pretrained(model_dir).pad_token_id
    g = torch.Generator().manual_seed(4)
    pairs = pairs_sharing_prompts(4 if small else 16, small, vocab, pad, g)
    weights = (torch.randn(2 * len(pairs), generator=g) * 2).to(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    layouts = {"padded": collate_pairs(pairs, pad), "tree": collate_pair_tree(pairs, pad),
               "packed": collate_pairs(pairs, pad, packed=True)}
    out: dict = {"pairs": len(pairs), "dtype": str(dtype),
                 "tokens": {k: int(b["input_ids"].numel()) for k, b in layouts.items()},
                 "sequence_tokens": int(layouts["tree"]["n_tokens"])}
    for what, load, fn in (("dpo_logprobs", load_causal_lm,
                            lambda m, b: response_logprobs(m, b, head=LMHead("chunked", 4096))),
                           ("reward_scores", load_reward_model, pair_rewards)):
        results, exact = {}, None
        for name, layout, model_dtype, impl in (("fp32-padded", "padded", torch.float32, "sdpa"),
                                                ("padded", "padded", dtype, "sdpa"),
                                                ("tree", "tree", dtype, "sdpa"),
                                                ("packed-varlen", "packed", dtype, "auto")):
            torch.manual_seed(0)  # the reward model's new score head: the same random init in every variant
            model = load(model_dir, device, attention=impl).to(model_dtype)
            batch = layouts[layout]

            def step():
                model.zero_grad(set_to_none=True)
                values = fn(model, batch)
                (values * weights).sum().backward()
                return values.detach().float()

            values, grads = values_and_grads(step, model)
            if exact is None:
                exact = (values, grads)
                continue
            times, peak = timed(step, reps)
            results[name] = {"max_abs_delta_vs_fp32": float((values - exact[0]).abs().max()),
                             **grads_and_cost_vs_fp32(grads, exact[1], times, peak)}
            model = None  # freed before the next variant loads
        out[what] = results
    return out
