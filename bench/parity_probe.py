"""Can a rollout engine and the trainer compute the same log-probs bit for bit on a CPU? A probe before building
parity mode (issue 54, item 1).

The two sides differ in how rows and keys are grouped: the engine decodes a token at a time over a KV cache with
whatever rows are still in the batch, the trainer scores whole sequences in batches of its own, and left padding puts
a sequence's keys at different columns in each. Floating-point sums depend on their grouping, so log-probs differ in
the last bits (the mismatch KL alignflow logs and corrects). The probe tries two batch-invariant replacements on a
model loaded from a folder (the embedded SFT model by default), and reports, with them off and on:

* ``linear``: every ``nn.Linear`` computes its rows as one batched matmul over blocks of a fixed size (zero rows pad
  the last block), so each row goes through the math library's kernel in a block of the same shape whatever the batch;
* ``attention``: a registered transformers attention that moves each row's keys to their logical positions (left
  padding shifted out), pads them to a fixed length and reduces over the same layout for every query, in the cache
  or not.

It compares, for the sampled (here: given) tokens, ``log_softmax(logits)`` from (a) one forward of a batch of 64
left-padded sequences, (b) each sequence alone, (c) a batch where half the rows end early (right padding), and
(d) a prefill plus token-by-token decode over transformers' cache, as HF ``generate`` runs it; then times a forward
of the batch both ways (median and range of 5). Nothing here is wired into the trainers: the probe says whether the
route holds on this machine's math library and what it costs.

Run: ``python bench/parity_probe.py --model models/sft --out bench/results/cpu/DAY/parity_probe.json``
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
import types
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import rlhf_core  # noqa: E402,F401  (offline switches, fixed math-library threading)

PARITY = "parity_probe"
BLOCK_ROWS = 16


def blocked_linear(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``x @ W.T (+ b)`` as one batched matmul over blocks of :data:`BLOCK_ROWS` rows (zero rows pad the last): every
    row meets the kernel in a block of the same shape whatever the batch."""
    flat = x.reshape(-1, x.shape[-1])
    rows = flat.shape[0]
    padded = F.pad(flat, (0, 0, 0, (-rows) % BLOCK_ROWS))
    blocks = padded.shape[0] // BLOCK_ROWS
    out = torch.bmm(padded.view(blocks, BLOCK_ROWS, -1), self.weight.t().unsqueeze(0).expand(blocks, -1, -1))
    out = out.reshape(-1, self.weight.shape[0])[:rows]
    if self.bias is not None:
        out = out + self.bias
    return out.reshape(*x.shape[:-1], out.shape[-1])


def canonical_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, key_length=64, **_):
    """Attention whose reductions see each row's keys at their logical positions, padded to ``key_length``.

    query ``(B, H, Tq, D)``, key/value ``(B, Hkv, Tk, D)``; ``attention_mask`` transformers' boolean ``(B, 1, Tq, Tk)``
    (True: attend) or None (no padding: causal over the last ``Tq`` positions). Returns ``(B, Tq, H, D)``."""
    B, H, Tq, D = query.shape
    Tk = key.shape[2]
    key = key.repeat_interleave(H // key.shape[1], dim=1)
    value = value.repeat_interleave(H // value.shape[1], dim=1)
    if attention_mask is None:
        q_pos = torch.arange(Tk - Tq, Tk).view(Tq, 1)
        allowed = (torch.arange(Tk).view(1, Tk) <= q_pos).expand(B, 1, Tq, Tk)
    else:
        allowed = attention_mask.bool().expand(B, 1, Tq, Tk)
    shift = allowed[:, 0, -1, :].int().argmax(-1)  # leading padding of each row (its first key the last query sees)
    src = torch.arange(key_length).view(1, key_length) + shift.view(B, 1)  # canonical slot i <- key i + shift
    inside = src < Tk
    src = src.clamp(max=Tk - 1)
    take = src.view(B, 1, key_length, 1).expand(B, H, key_length, D)
    key = torch.gather(key, 2, take) * inside.view(B, 1, key_length, 1)
    value = torch.gather(value, 2, take) * inside.view(B, 1, key_length, 1)
    allowed = torch.gather(allowed, 3, src.view(B, 1, 1, key_length).expand(B, 1, Tq, key_length))
    allowed = allowed & inside.view(B, 1, 1, key_length)
    scores = (query.unsqueeze(-2) * key.unsqueeze(-3)).sum(-1) * (scaling if scaling is not None else D ** -0.5)
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1).nan_to_num(0.0)  # padding queries: 0
    out = (probs.unsqueeze(-1) * value.unsqueeze(-3)).sum(-2)
    return out.transpose(1, 2).contiguous(), None


def register(key_length: int) -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(PARITY, lambda *a, **k: canonical_attention(*a, key_length=key_length, **k))
    AttentionMaskInterface.register(PARITY, sdpa_mask)


def load(path: Path, parity: bool):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), attn_implementation=PARITY if parity else "sdpa").eval()
    if parity:
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.forward = types.MethodType(blocked_linear, module)
    return model


def batch(vocab: int, rows: int, width: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` sequences of ``length`` tokens after prompts of 3 to ``width`` tokens, left-padded to ``width``."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, vocab, (rows, width + length), generator=g)
    mask = torch.ones_like(ids)
    for r in range(rows):
        pad = int(torch.randint(0, width - 2, (1,), generator=g))
        ids[r, :pad], mask[r, :pad] = 0, 0
    return ids, mask


def scored(model, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(rows, T-1)`` log-probs of each next token from one forward (positions as HF generate gives them)."""
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    return torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]


def decoded(model, ids: torch.Tensor, mask: torch.Tensor, width: int) -> torch.Tensor:
    """The same log-probs from a prefill of the prompts, then one token at a time over transformers' cache."""
    from transformers.cache_utils import DynamicCache

    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        out = model(input_ids=ids[:, :width], attention_mask=mask[:, :width], position_ids=positions[:, :width],
                    past_key_values=DynamicCache(config=model.config), use_cache=True)
        steps = [torch.log_softmax(out.logits[:, :-1].float(), -1).gather(-1, ids[:, 1:width, None])[..., 0]]
        for t in range(width, ids.shape[1]):
            steps.append(torch.log_softmax(out.logits[:, -1].float(), -1).gather(-1, ids[:, t:t + 1]))
            out = model(input_ids=ids[:, t:t + 1], attention_mask=mask[:, :t + 1], position_ids=positions[:, t:t + 1],
                        past_key_values=out.past_key_values, use_cache=True)
    return torch.cat(steps, 1)


def compare(a: torch.Tensor, b: torch.Tensor, valid: torch.Tensor) -> dict:
    diff = (a - b).abs()[valid]
    return {"bit_identical": bool(torch.equal(a[valid], b[valid])), "max_abs_diff": float(diff.max()),
            "tokens_differing": int((diff > 0).sum()), "tokens": int(valid.sum())}


def probe(path: Path, parity: bool, rows: int, width: int, length: int) -> dict:
    model = load(path, parity)
    ids, mask = batch(model.config.vocab_size, rows, width, length, seed=0)
    valid = (mask[:, 1:] * mask[:, :-1]).bool()  # a real token predicted from a real token
    full = scored(model, ids, mask)
    starts = [int(mask[r].argmax()) for r in range(rows)]  # each sequence alone: its padding cut off
    alone = torch.cat([F.pad(scored(model, ids[r:r + 1, s:], mask[r:r + 1, s:]), (s, 0)) for r, s in enumerate(starts)])
    ended = mask.clone()
    ended[::2, width + length // 2:] = 0  # half the rows finished half-way (right padding after them)
    early = scored(model, ids, ended)
    keep = valid & (ended[:, 1:] * ended[:, :-1]).bool()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        scored(model, ids, mask)
        times.append(time.perf_counter() - start)
    return {"batch_vs_alone": compare(full, alone, valid), "batch_vs_rows_ended_early": compare(full, early, keep),
            "batch_vs_cached_decode": compare(full, decoded(model, ids, mask, width), valid),
            "forward_s": {"median": statistics.median(times), "min": min(times), "max": max(times)}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=REPO / "models" / "sft")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--width", type=int, default=12, help="prompt width (prompts of 3..width tokens, left-padded)")
    parser.add_argument("--length", type=int, default=24, help="response tokens after the prompt")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    register(key_length=args.width + args.length)
    torch.manual_seed(0)
    result = {"model": str(args.model), "host": platform.processor() or platform.machine(),
              "threads": torch.get_num_threads(), "torch": torch.__version__, "block_rows": BLOCK_ROWS,
              "shape": {"rows": args.rows, "prompt_width": args.width, "response": args.length},
              "off": probe(args.model, False, args.rows, args.width, args.length),
              "on": probe(args.model, True, args.rows, args.width, args.length)}
    result["on_over_off_forward"] = result["on"]["forward_s"]["median"] / result["off"]["forward_s"]["median"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
