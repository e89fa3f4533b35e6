"""The TRL search (``side_by_side.py --search``): TRL's step under each configuration of
``settings.SEARCHES[bench]`` (SFT's or GRPO's), one child each, ranked by median; the winner is trl-best of later calls
(``--trl-best-from``), and trl-default itself when no configuration beats it.
"""

from __future__ import annotations

import json
from pathlib import Path

from .settings import ROWS


def search_table(results: dict) -> dict:
    """The search's ranking from a result file's ``results`` (its one benchmark): each configuration's options,
    median, min and max; the winner and by how much it beats trl-default."""
    name = next(iter(results))
    rows = results[name].get("summary", {}).get("rows", {})
    configs = {r: {"options": ROWS[r].get("opts", {}),
                   **{k: rows.get(r, {}).get(k) for k in ("median_step_s", "min_step_s", "max_step_s",
                                                             "max_over_min", "flagged", "peak_memory_gb")},
                   **({"error": rows[r]["error"][-300:]} if "error" in rows.get(r, {}) else {})}
               for r in results[name]["runs"]}
    timed = {r: c["median_step_s"] for r, c in configs.items() if c.get("median_step_s")}
    default = timed.get("trl-default")
    fastest = min(timed, key=timed.get) if timed else None
    winner = fastest if default is None or (fastest and timed[fastest] < default) else "trl-default"
    return {"bench": name, "configs": configs, "ranking": sorted(timed, key=timed.get), "winner": winner,
            "winner_options": ROWS[winner].get("opts", {}) if winner else None,
            "winner_over_default": round(timed[winner] / default, 3) if winner and default else None,
            "note": ("no configuration beat trl-default: trl-best is trl-default" if winner == "trl-default"
                     else f"{winner} beats trl-default")}


def load_winner(path: Path) -> dict:
    """``--trl-best-from FILE``: the recorded search's winner and its options."""
    doc = json.loads(Path(path).read_text())
    if "search" not in doc or not doc["search"].get("winner"):
        raise SystemExit(f"--trl-best-from {path}: no search winner recorded in it (run --search first)")
    s = doc["search"]
    return {"file": str(path), "winner": s["winner"], "options": s["winner_options"],
            "winner_median_step_s": s["configs"][s["winner"]]["median_step_s"],
            "device": doc.get("environment", {}).get("nvidia_smi")}
