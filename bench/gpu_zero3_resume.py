"""ZeRO-3 kill-and-resume on two GPUs: the only ZeRO-3 check on real accelerators (issue 16).

Two Ray ranks (NCCL) train SFT under DeepSpeed ZeRO-3 with mid-run checkpoints. Runs, in one call:

* ``whole`` and ``whole_again``: uninterrupted, twice (their difference is this GPU stack's own
  run-to-run floor: NCCL reductions and some CUDA backward kernels are not bit-deterministic);
* ``killed``: rank 1's worker SIGKILLs itself right after the step-``kill_at`` checkpoint
  (``ALIGNFLOW_FAULT_SIGNAL=KILL``); the launcher must fail the call within 60 s; then the same call
  again (what Prefect's retry does) resumes from that checkpoint and finishes;
* ``on_one_gpu``: ``whole``'s step-``kill_at`` checkpoint finished by one rank (2 -> 1 GPUs).

Recorded: seconds from the kill to the failure, the resumed step, final weights against
``whole`` (md5 and max |diff|, beside the whole/whole_again floor), the step-``kill_at``
optimizer state of ``killed`` against ``whole``'s (what the retry loaded), final losses.
Writes ``$OUT/gpu_zero3_resume.json`` (``bench/out/`` locally).

On the device (after ``source bench/device_setup.sh``): ``python bench/gpu_zero3_resume.py [--small]``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from rlhf_core.config import SFTConfig  # noqa: E402
from rlhf_core.embedded.tiny_model import build_tiny_model, train_tokenizer  # noqa: E402
from rlhf_core.embedded.tasks import generate_datasets  # noqa: E402


class Losses:
    def __init__(self) -> None:
        self.rows: list[tuple[int, float]] = []

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if "train/loss" in metrics:
            self.rows.append((step, float(metrics["train/loss"])))


def _md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def _max_diff(a: Path, b: Path) -> float:
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    return max(float((wa[k].float() - wb[k].float()).abs().max()) for k in wa)


def _optimizer_gap(a: Path, b: Path) -> dict[str, float]:
    sa = torch.load(a / "trainer_state.pt", weights_only=True)["optimizer"]
    sb = torch.load(b / "trainer_state.pt", weights_only=True)["optimizer"]
    return {key: max(float((sa[key][n].float() - sb[key][n].float()).abs().max()) for n in sa[key])
            for key in ("exp_avg", "exp_avg_sq", "step")} | {"tensors": len(sa["exp_avg"])}


def _world(root: Path, small: bool) -> tuple[Path, dict[str, Path]]:
    data = generate_datasets(root / "data", seed=7, n_sft=4000, n_preference=10, n_prompts=10, n_eval=200,
                             sft_noise=0.2)
    texts = [json.loads(line)["prompt"] + json.loads(line)["completion"]
             for line in data["sft"].read_text().splitlines()]
    tok = train_tokenizer(texts, root / "tok", vocab_size=2000)
    shape = (dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128) if small else
             dict(hidden_size=1024, num_layers=12, num_heads=16, num_kv_heads=4, intermediate_size=2816))
    model = build_tiny_model(tok, root / "model", arch="qwen2", max_positions=256, seed=0, **shape)
    return model, data


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", action="store_true", help="a tiny model: a smoke test of the script")
    args = parser.parse_args()
    from rlhf_core.trainers.ray_launcher import train_data_parallel
    from rlhf_core.trainers.sft import train_sft

    out_dir = Path(os.environ.get("OUT", REPO / "bench" / "out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp())
    os.environ["ALIGNFLOW_HOME"] = str(root)
    model, data = _world(root, args.small)
    steps, kill_at = (8, 4) if args.small else (16, 8)

    def cfg(name: str, **kw) -> SFTConfig:
        return SFTConfig(**{**dict(model_path=str(model), train_file=str(data["sft"]), eval_file=str(data["eval"]),
                                   output_dir=str(root / name / "out"), checkpoint_dir=str(root / name / "ckpt"),
                                   max_steps=steps, batch_size=32, grad_accum=2, max_length=128, lr=1e-3,
                                   warmup_steps=1, eval_items=32, num_threads=4, precision="fp32", log_every=1,
                                   save_every=kill_at // 2, keep_checkpoints=10, num_workers=2, parallel="zero3"),
                            **kw})

    def run(c: SFTConfig) -> tuple[Losses, float]:
        sink, started = Losses(), time.perf_counter()
        if c.num_workers == 1:
            train_sft(c, sink, show_progress=False)
        else:
            train_data_parallel(train_sft, c, sink, show_progress=False)
        return sink, time.perf_counter() - started

    gpu = torch.cuda.is_available()
    report: dict = {"device": torch.cuda.get_device_name(0) if gpu else "cpu", "gpus": torch.cuda.device_count(),
                    "torch": torch.__version__, "small": args.small, "steps": steps, "kill_at": kill_at,
                    "model_params": sum(t.numel() for t in load_file(str(model / "model.safetensors")).values())}
    whole, report["whole_seconds"] = run(cfg("whole"))
    whole_again, _ = run(cfg("whole_again"))
    marker = root / "killed.marker"
    os.environ.update(ALIGNFLOW_FAULT=f"sft:{kill_at}:{marker}", ALIGNFLOW_FAULT_RANK="1",
                      ALIGNFLOW_FAULT_SIGNAL="KILL")
    try:
        run(cfg("killed"))
        report["kill"] = "the run finished: the fault never fired"
    except Exception as exc:  # noqa: BLE001 - the failure is the point; its type and delay are recorded
        report["kill"] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}",
                          "seconds_to_fail": round(time.time() - marker.stat().st_mtime, 2)}
    for key in ("ALIGNFLOW_FAULT", "ALIGNFLOW_FAULT_RANK", "ALIGNFLOW_FAULT_SIGNAL"):
        os.environ.pop(key)
    ckpt = f"step-{kill_at:07d}"
    shutil.copytree(root / "killed" / "ckpt" / ckpt, root / "resumed_from")
    retry, _ = run(cfg("killed"))
    shutil.copytree(root / "whole" / "ckpt" / ckpt, root / "single" / "ckpt" / ckpt)  # whole's, at the kill step
    single, _ = run(cfg("single", num_workers=1, parallel="ddp"))
    final = {name: root / name / "out" for name in ("whole", "whole_again", "killed", "single")}
    report.update({
        "retry_first_step": retry.rows[0][0], "one_gpu_first_step": single.rows[0][0],
        "md5": {k: _md5(v / "model.safetensors") for k, v in final.items()},
        "max_abs_diff_vs_whole": {k: _max_diff(final["whole"], v) for k, v in final.items() if k != "whole"},
        "optimizer_at_resume_vs_whole": _optimizer_gap(root / "resumed_from", root / "whole" / "ckpt" / ckpt),
        "final_loss": {"whole": whole.rows[-1][1], "whole_again": whole_again.rows[-1][1],
                       "killed_then_resumed": retry.rows[-1][1], "resumed_on_one_gpu": single.rows[-1][1]},
    })
    report["one_gpu_relative_loss_gap"] = abs(single.rows[-1][1] - whole.rows[-1][1]) / abs(whole.rows[-1][1])
    name = "gpu_zero3_resume_small.json" if args.small else "gpu_zero3_resume.json"
    (out_dir / name).write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
