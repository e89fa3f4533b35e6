"""What the bounds of :func:`rlhf_core.data.chat.render_chat` (a trace function: time and nesting) cost.

One tokenizer (``models/base`` with the plain chat template), one three-message chat, rendered 500 times
by ``tokenizer.apply_chat_template`` directly and 500 times by ``render_chat``, alternately, seven rounds;
prints one JSON object with the median and range of microseconds per chat for each, and the ratio of
the medians. Run: ``.venv/bin/python bench/chat_render_cost.py [--out FILE]``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Callable

from rlhf_core.data.chat import ensure_chat_template, render_chat
from rlhf_core.models.loading import load_tokenizer

CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "sort 3 1 2"},
        {"role": "assistant", "content": "1 2 3"}]
CALLS, ROUNDS = 500, 7


def _us_per_call(render: Callable[[], str]) -> float:
    start = time.perf_counter()
    for _ in range(CALLS):
        render()
    return (time.perf_counter() - start) / CALLS * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the result to this JSON file")
    args = parser.parse_args()
    tok = ensure_chat_template(load_tokenizer(Path(__file__).resolve().parents[1] / "models" / "base"))
    rows: dict[str, list[float]] = {"apply_chat_template": [], "render_chat": []}
    for _ in range(ROUNDS):
        rows["apply_chat_template"].append(_us_per_call(
            lambda: tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=False)))
        rows["render_chat"].append(_us_per_call(lambda: render_chat(tok, CHAT, False)))
    result = {name: {"median_us": round(statistics.median(v), 1), "min_us": round(min(v), 1),
                     "max_us": round(max(v), 1)} for name, v in rows.items()}
    result["ratio_of_medians"] = round(result["render_chat"]["median_us"] / result["apply_chat_template"]["median_us"], 2)
    result["machine"] = f"{platform.processor() or platform.machine()}, {len(__import__('os').sched_getaffinity(0))} cores"
    print(json.dumps(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
