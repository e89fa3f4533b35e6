"""Result files: the one at ``--out`` (rewritten after every child), this machine's paths made generic, and
``--combine``, ``--scaling``, ``--resummarize``.
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
import time
from pathlib import Path

from .settings import REPO, SETTINGS, apply_global_batch, make_small
from .search import search_table
from .summary import summarize
from .hygiene import enforce, plan_problems


class ResultFile:
    """The result file at ``--out``, rewritten after every child (a call cut off at its limit keeps what ran)."""

    def __init__(self, args: argparse.Namespace, header: dict, started: float):
        self.args, self.header, self.started = args, header, started

    def ceiling(self) -> dict:
        """The matmul and copy ceilings: the max over every measurement so far (start, and end once run)."""
        ceilings = self.header["ceilings"]
        ms = [m for c in ceilings.values() if "error" not in c for m in c["matmul_flops"]]
        bw = [m for c in ceilings.values() if "error" not in c for m in c["copy_bytes_per_s"]]
        return {"matmul_flops": max(ms), "copy_bytes_per_s": max(bw), "measurements": len(ms),
                "when": sorted(k for k, c in ceilings.items() if "error" not in c)}

    def write(self, results: dict, final: bool) -> dict:
        args, ceiling = self.args, self.ceiling()
        summary = summarize(args.variant, results, args.warmup, ceiling, self.header["model"])
        extra = {"search": search_table(results)} if getattr(args, "search", False) and results else {}
        doc = {**self.header, **extra, "ceiling": {**ceiling, "matmul_tflops": round(ceiling["matmul_flops"] / 1e12, 2),
                                          "copy_tb_per_s": round(ceiling["copy_bytes_per_s"] / 1e12, 3)},
               "final": final, "results": results, "summary": summary,
               "wall_s": round(time.perf_counter() - self.started, 1)}
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(portable(doc), indent=2) + "\n")
        return doc


# A path is a run from a "/" to white space or a quote, taken whole (possessive): each character is
# scanned once. Nested repetition of path segments would be quadratic on long runs of "-/-/".
_PATH = re.compile(r"/[^\s\"']*+")
_PACKAGES_DIRS = ("/site-packages", "/dist-packages")


def _site_packages(match: re.Match) -> str:
    """A path with everything up to its last ``site-packages``/``dist-packages`` folder made generic."""
    path = match.group()
    start, name = max((path.rfind(name), name) for name in _PACKAGES_DIRS)
    return "<site-packages>" + path[start + len(name):] if start > 0 else path  # a folder above it, as in /x/site-packages


def portable(obj: object) -> object:
    """``obj`` with this machine's paths in its strings made generic (``<repo>``, ``<site-packages>``,
    ``<tmp>``), so a committed result file (its tracebacks, the model directory) names no local folder."""
    if isinstance(obj, dict):
        return {k: portable(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [portable(v) for v in obj]
    if not isinstance(obj, str):
        return obj
    text = obj.replace(str(REPO), "<repo>")
    text = _PATH.sub(_site_packages, text)
    # /tmp/site: where bench/device_setup.sh installs the carried wheels on a lent GPU
    return text.replace("/tmp/site/", "<site-packages>/").replace(tempfile.gettempdir() + "/", "<tmp>/")


def scaling(one: Path, many: Path, out: Path) -> dict:
    """1 -> N GPU scaling of ours' rows from two result files of one call (the same variant, benchmarks and
    global batch; ``--gpus`` differs): efficiency = tokens/s on N / (N x tokens/s on 1), per benchmark and row,
    from each side's median step."""
    a, b = json.loads(one.read_text()), json.loads(many.read_text())
    ga, gb = a["settings"]["gpus"], b["settings"]["gpus"]
    rows: dict = {}
    for name in sorted(set(a["results"]) & set(b["results"])):
        for row, ra in a["results"][name]["summary"]["rows"].items():
            rb = b["results"][name]["summary"]["rows"].get(row, {})
            if row == "ours-best" or "tokens_per_s" not in ra or "tokens_per_s" not in rb:
                continue
            rows[f"{name} {row}"] = {
                f"tokens_per_s_{ga}gpu": ra["tokens_per_s"], f"tokens_per_s_{gb}gpu": rb["tokens_per_s"],
                f"median_step_s_{ga}gpu": ra["median_step_s"], f"median_step_s_{gb}gpu": rb["median_step_s"],
                "range_step_s": {ga: ra["range_step_s"], gb: rb["range_step_s"]},
                "parallel": {ga: (ra.get("settings") or {}).get("parallel"), gb: (rb.get("settings") or {}).get("parallel")},
                "peak_memory_gb": {ga: ra["peak_memory_gb"], gb: rb["peak_memory_gb"]},
                "global_batch": {g: (r.get("settings") or {}).get("batch_size", 0) * (r.get("settings") or {}).get("grad_accum", 1)
                                 for g, r in ((ga, ra), (gb, rb))},
                "efficiency": round(rb["tokens_per_s"] / (ra["tokens_per_s"] * gb / ga), 3)}
    doc = {"variant": a["variant"], "gpus": [ga, gb], "files": [one.name, many.name], "rows": rows,
           "target": "scaling 1 -> 4 GPUs at a fixed global batch >= 85% (SFT and DPO tokens/s, ZeRO-2)",
           "status": {k: ("met" if v["efficiency"] >= 0.85 else "not met") for k, v in rows.items()},
           "device": a["results"][next(iter(a["results"]))]["summary"]["rows"].get("ours-best", {}).get("device")}
    out.write_text(json.dumps(portable(doc), indent=2) + "\n")
    print(json.dumps(doc), flush=True)
    return doc


def apply_recorded_settings(data: dict) -> None:
    """The variant's SETTINGS as a result file ran them (``--small``, ``--gpus``, ``--global-batch``), before its
    summaries are recomputed."""
    settings, variant = data["settings"], data["variant"]
    if settings.get("small"):
        make_small(variant)
    if settings.get("gpus"):
        SETTINGS[variant]["gpus"] = settings["gpus"]
    if settings.get("global_batch"):
        apply_global_batch(variant, settings["global_batch"])


def combine(paths: list[Path], out: Path, warmup: int, as_rounds: bool = False) -> dict:
    """One result file from the rows of several (``--combine A B ...``): the 7B variant's AB round split across
    consecutive calls on one warm machine (the issue allows it; one call would not hold both sides). The files
    must share the variant, GPU count and benchmarks; every row's runs are kept as run, the ceiling is the max over
    all the calls' measurements (each call's own kept under ``combined_from``), and the summaries are recomputed.

    ``as_rounds`` (``--combine-rounds``): each file is one ABBA round of the same rows (one call would not hold
    every round), the row order reversed in every second file; a row's runs are concatenated, numbered as the
    rounds of one call, and the hygiene minimums are checked again over the combined rounds."""
    docs = [json.loads(p.read_text()) for p in paths]
    first = docs[0]
    for p, d in zip(paths[1:], docs[1:]):
        if d["variant"] != first["variant"]:
            raise SystemExit(f"--combine: {p.name} is variant {d['variant']!r}, {paths[0].name} {first['variant']!r}")
        if d["settings"].get("gpus") != first["settings"].get("gpus") or set(d["results"]) != set(first["results"]):
            raise SystemExit(f"--combine: {p.name} has other GPUs or benchmarks than {paths[0].name}")
    if as_rounds:
        _check_round_split(paths, docs)
    results: dict = {name: {"runs": {}} for name in first["results"]}
    offset = 0
    for p, d in zip(paths, docs):
        for name, res in d["results"].items():
            for row, runs in res["runs"].items():
                if row in results[name]["runs"] and not as_rounds:
                    raise SystemExit(f"--combine: row {row} of {name} is in more than one file")
                results[name]["runs"].setdefault(row, []).extend(
                    {**r, "call": p.name, **({"round": offset + r.get("round", 0)} if as_rounds else {})} for r in runs)
        offset += d["settings"].get("rounds", 1)
    c = {"matmul_flops": max(d["ceiling"]["matmul_flops"] for d in docs),
         "copy_bytes_per_s": max(d["ceiling"]["copy_bytes_per_s"] for d in docs)}
    apply_recorded_settings(first)
    summary = summarize(first["variant"], results, warmup, c, first["model"])
    doc = {**{k: v for k, v in first.items() if k not in ("results", "summary", "ceiling", "wall_s")},
           "combined_from": [{"file": p.name, "ceiling": d["ceiling"], "wall_s": d.get("wall_s")}
                             for p, d in zip(paths, docs)],
           "ceiling": {**c, "matmul_tflops": round(c["matmul_flops"] / 1e12, 2),
                       "copy_tb_per_s": round(c["copy_bytes_per_s"] / 1e12, 3), "rule": "max over the combined calls"},
           "results": results, "summary": summary}
    if as_rounds:
        steps = {name: first["settings"]["benches"][name]["steps"] for name in first["results"]}
        problems = plan_problems(steps, warmup, offset)
        doc["settings"] = {**first["settings"], "rounds": offset, "combined_rounds": [p.name for p in paths]}
        doc["hygiene"] = {**first.get("hygiene", {}), **enforce(problems, waive=True),
                          "rounds_from": "one ABBA round a call, --combine-rounds"}
    out.write_text(json.dumps(portable(doc), indent=2) + "\n")
    print(json.dumps({"summary": doc["summary"]}), flush=True)
    return doc


def _check_round_split(paths: list[Path], docs: list[dict]) -> None:
    """``--combine-rounds``: the files ran the same rows one round each, in ABBA order (every second reversed)."""
    rows = list(docs[0]["settings"]["rows"])
    for i, (p, d) in enumerate(zip(paths, docs)):
        if d["settings"].get("rounds", 1) != 1:
            raise SystemExit(f"--combine-rounds: {p.name} ran {d['settings'].get('rounds')} rounds; one a file")
        expected = rows if i % 2 == 0 else rows[::-1]
        if list(d["settings"]["rows"]) != expected:
            raise SystemExit(f"--combine-rounds: {p.name} ran rows {list(d['settings']['rows'])}, ABBA wants {expected}")
    # A row's rounds must be one regime: a TRL row that ran before any ours row of its call had no choice of ours to
    # match (--trl-grad-ckpt match) and took TRL's default, so such a call needs --trl-grad-ckpt set
    for name in docs[0]["results"]:
        for row in rows:
            ckpt = {_checkpointing(r) for d in docs for r in d["results"][name]["runs"].get(row, [])}
            if len(ckpt) > 1:
                raise SystemExit(f"--combine-rounds: {row} of {name} ran with gradient checkpointing "
                                 f"{sorted(ckpt, key=str)} across the files (pass --trl-grad-ckpt on or off to each call)")


def _checkpointing(run: dict) -> object:
    """A run's gradient checkpointing: ours' logged choice, or TRL's setting."""
    return (run.get("gradient_checkpointing") or {}).get("on", run.get("settings", {}).get("gradient_checkpointing"))


def resummarize(path: Path, warmup: int) -> None:
    """Recompute every summary of a result file from its recorded runs, ceilings and model facts."""
    data = json.loads(path.read_text())
    apply_recorded_settings(data)
    c = data["ceiling"]
    ceiling = {"matmul_flops": c["matmul_flops"], "copy_bytes_per_s": c["copy_bytes_per_s"]}
    data["summary"] = summarize(data["variant"], data["results"], warmup, ceiling, data["model"])
    for name, res in data["results"].items():
        print(json.dumps({"bench": name, "summary": res["summary"]}))
    path.write_text(json.dumps(portable(data), indent=2) + "\n")
