"""Does parity mode's batch-invariant forward (``rlhf_core/models/parity.py``, ``rl.rollout.parity``) give a
sequence's log-probs the same bits however it is batched, on this machine's math library, and at what cost?

On a model loaded from a folder (the embedded SFT model by default), with the forward plain and batch-invariant,
it compares the log-probs of the given tokens from (a) one forward of a batch of 64 left-padded sequences, (b) each
sequence alone, (c) a batch where half the rows end early (right padding), and (d) a prefill plus token-by-token
decode over transformers' cache, as HF ``generate`` runs it; then times a forward of the batch both ways (median
and range of 5).

Run: ``python bench/parity_probe.py --model models/sft --out bench/results/cpu/DAY/parity_probe.json``; on a GPU
``--device cuda --dtype bfloat16`` (``--model``: e.g. the folder a side_by_side ``--work`` call built).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import rlhf_core  # noqa: E402,F401  (offline switches, fixed math-library threading)
from rlhf_core.models.parity import BLOCK_ROWS, make_batch_invariant  # noqa: E402



def load(path: Path, parity: bool, key_length: int, device: str = "cpu", dtype: str = "float32"):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="sdpa",
                                                 dtype=getattr(torch, dtype)).to(device).eval()
    return make_batch_invariant(model, key_length) if parity else model


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


def probe(path: Path, parity: bool, rows: int, width: int, length: int, device: str = "cpu",
          dtype: str = "float32") -> dict:
    model = load(path, parity, width + length, device, dtype)
    ids, mask = (t.to(device) for t in batch(model.config.vocab_size, rows, width, length, seed=0))
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
        _sync(device)
        start = time.perf_counter()
        scored(model, ids, mask)
        _sync(device)
        times.append(time.perf_counter() - start)
    return {"batch_vs_alone": compare(full, alone, valid), "batch_vs_rows_ended_early": compare(full, early, keep),
            "batch_vs_cached_decode": compare(full, decoded(model, ids, mask, width), valid),
            "forward_s": {"median": statistics.median(times), "min": min(times), "max": max(times)}}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _shown(path: Path) -> str:
    """``path`` relative to the repository where it lies inside it (a result file names no machine's folders)."""
    path = path.resolve()
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else path.name


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=REPO / "models" / "sft")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--width", type=int, default=12, help="prompt width (prompts of 3..width tokens, left-padded)")
    parser.add_argument("--length", type=int, default=24, help="response tokens after the prompt")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (the cuBLAS and attention kernels' bits)")
    parser.add_argument("--dtype", default="float32", help="the model's dtype: float32 or bfloat16")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    result = {"model": _shown(args.model), "host": platform.processor() or platform.machine(),
              "threads": torch.get_num_threads(), "torch": torch.__version__, "block_rows": BLOCK_ROWS,
              "device": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu",
              "dtype": args.dtype, "shape": {"rows": args.rows, "prompt_width": args.width, "response": args.length},
              "off": probe(args.model, False, args.rows, args.width, args.length, args.device, args.dtype),
              "on": probe(args.model, True, args.rows, args.width, args.length, args.device, args.dtype)}
    result["on_over_off_forward"] = result["on"]["forward_s"]["median"] / result["off"]["forward_s"]["median"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
