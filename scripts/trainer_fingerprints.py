"""Trainer fingerprints: prove that a refactor of the trainers is bit-identical.

Builds the micro world of ``tests/conftest.py`` (datasets, tokenizer, tiny Qwen2 and Llama models)
in a temporary folder, then runs a few steps of every trainer on CPU with fixed seeds and one torch
thread: SFT, reward model, DPO, KTO, distillation, RAFT (rejection sampling + SFT), GRPO, PPO
(GAE critic, KL in the reward, k1) and GRPO on Ray (colocated, 2 policy ranks). SFT, GRPO and PPO
(and the others where cheap) checkpoint periodically (``save_every``) and evaluate mid-run
(``eval_every``), so those paths are exercised too; ``sft_resume``, ``grpo_resume`` and ``ppo_resume``
stop a run after a checkpoint (the loop's ``ALIGNFLOW_FAULT`` hook) and resume it, which also fingerprints
the checkpoint files themselves.

For each run it records, in one JSON file:

* ``files``: md5 of every file of the output model directory (relative name -> md5);
* ``result_metrics``: the metrics the trainer returned (``perf/*`` timings left out);
* ``logged``: every metric sent to the sink, as ``[step, name, repr(float(value))]`` in logging
  order (``perf/*`` left out), and every ``log_table`` call in ``tables``;
* eval samples and rollout tables of the result, and a few run-specific extras (RAFT's rejection
  files, what is left in the checkpoint folder);
* ``seconds`` (wall time; never compared).

All paths given to the trainers are relative to the temporary folder (the script ``chdir``\\ s into it),
so ``alignflow.json`` beside the weights does not depend on where the folder is.

Run from the repository root whose ``rlhf_core`` you want to fingerprint::

    PYTHONPATH=. .venv/bin/python scripts/trainer_fingerprints.py --out X.json
    PYTHONPATH=. .venv/bin/python scripts/trainer_fingerprints.py --out X.json --only sft,grpo
    .venv/bin/python scripts/trainer_fingerprints.py --compare before.json after.json

``--compare`` prints IDENTICAL / DIFFERENT (with the first differences) per trainer and exits 1
if any trainer differs or is missing from one side. The run prints ``rlhf_core.__file__`` (and the
one Ray workers import): check that it is the checkout you meant (the venv's editable install points
at the checkout it was made from; PYTHONPATH wins over it). To fingerprint an older commit, run it in a
``git worktree`` of that commit with ``PYTHONPATH`` set there. About a minute on 2 CPU cores, half of
it Ray's start-up.
"""

from __future__ import annotations

import os

# One thread everywhere (this process, the tokenizer subprocess, Ray workers), before torch loads.
for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ[_var] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable  # noqa: E402

# Same as tests/conftest.py.
MICRO_GEN = dict(seed=7, n_sft=600, n_preference=100, n_prompts=100, n_eval=100, sft_noise=0.2)
MICRO_MODEL = dict(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64,
                   max_positions=64, seed=0)
LLAMA_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LENGTH_REWARD = "def reward(prompts, completions, labels):\n    return [len(c) / 10 for c in completions]\n"

TRAINERS = ["sft", "reward", "dpo", "kto", "distill", "raft", "grpo", "ppo", "grpo_ray",
            "sft_resume", "grpo_resume", "ppo_resume"]
NOT_COMPARED = ("seconds",)


# --------------------------------------------------------------------------------------
# Recording
# --------------------------------------------------------------------------------------


def _num(value: Any) -> str:
    """Exact text of a metric value."""
    try:
        return repr(float(value))
    except (TypeError, ValueError):
        return repr(value)


def _exact(obj: Any) -> Any:
    """``obj`` made JSON-safe with every float as its repr (exact, NaN-safe)."""
    if isinstance(obj, bool) or obj is None or isinstance(obj, (int, str)):
        return obj
    if isinstance(obj, float):
        return repr(obj)
    if isinstance(obj, dict):
        return {str(k): _exact(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_exact(v) for v in obj]
    if hasattr(obj, "tolist"):  # tensors, numpy values
        return _exact(obj.tolist())
    return repr(obj)


class Recorder:
    """A MetricSink keeping every non-``perf/`` metric as ``[step, name, repr(value)]`` and every table."""

    def __init__(self) -> None:
        self.logged: list[list[Any]] = []
        self.tables: list[list[Any]] = []

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        for name, value in metrics.items():
            if not str(name).startswith("perf/"):
                self.logged.append([int(step), str(name), _num(value)])

    def log_table(self, rows: Any, name: str) -> None:
        self.tables.append([str(name), _exact(rows)])


def md5_file(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "md5").hexdigest()


def _renamed() -> dict[str, str]:
    """``rlhf_core.config.RENAMED`` (rl's old flat field names -> dotted), read from this script's own checkout, so an
    older checkout fingerprinted with ``PYTHONPATH`` set there builds and digests its configs the same way."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_rl_sections", Path(__file__).resolve().parents[1] / "rlhf_core"
                                                  / "config" / "rl_sections.py")
    module = sys.modules.setdefault(spec.name, importlib.util.module_from_spec(spec))  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module.RENAMED


# Trainer fields that were environment switches before they became config fields, and fields added since whose
# default keeps what a run did before (label_check, format_check: exact match, no format figures); at these values
# a run computes what a run without them did, so a record that has them digests like one that has not.
FROM_ENVIRONMENT = {"attention": "auto", "collective_timeout_s": 600.0, "compile_backend": "inductor",
                    "stack_dump_s": 0.0, "label_check": "", "format_check": ""}


def recorded_config_md5(path: Path) -> str:
    """md5 of an ``alignflow.json`` with its recorded config in one spelling: a section within a config (``kl: {coef:
    ...}``) as dotted names (``kl.coef``), and an old flat name mapped through ``rlhf_core.config.RENAMED`` (``kl_coef``
    -> ``kl.coef``), so a config recorded under either spelling digests the same; a field of
    :data:`FROM_ENVIRONMENT` at its value is left out."""
    renamed = _renamed()
    record = json.loads(Path(path).read_text())
    config = record.get("config")
    if isinstance(config, dict):
        flat: dict[str, Any] = {}
        for key, value in config.items():
            if isinstance(value, dict) and key in {new.split(".")[0] for new in renamed.values()}:
                flat.update({f"{key}.{k}": v for k, v in value.items()})
            else:
                flat[renamed.get(key, key)] = value
        record["config"] = {k: v for k, v in flat.items() if k not in FROM_ENVIRONMENT or FROM_ENVIRONMENT[k] != v}
    return hashlib.md5(json.dumps(record, sort_keys=True).encode()).hexdigest()


def md5_tree(root: Path) -> dict[str, str]:
    """Relative path -> md5 of every file under ``root`` (sorted; nothing skipped); an ``alignflow.json``'s is
    :func:`recorded_config_md5`."""
    root = Path(root)
    if root.is_file():
        return {root.name: md5_file(root)}
    return {str(p.relative_to(root)): recorded_config_md5(p) if p.name == "alignflow.json" else md5_file(p)
            for p in sorted(root.rglob("*")) if p.is_file()}


def _digest(obj: Any, h: Any) -> None:
    """Feed a canonical form of a checkpoint value into ``h`` (dict keys ``perf/*``, timings, skipped)."""
    import torch

    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(obj, dict):
        h.update(f"D{len(obj)}".encode())
        for k in sorted(obj, key=repr):
            if isinstance(k, str) and k.startswith("perf/"):
                continue
            h.update(repr(k).encode())
            _digest(obj[k], h)
    elif isinstance(obj, (list, tuple)):
        h.update(f"L{len(obj)}".encode())
        for v in obj:
            _digest(v, h)
    else:
        h.update(f"{type(obj).__name__}:{obj!r}".encode())


def state_digest(path: Path) -> dict[str, str]:
    """md5 per part of a checkpoint's ``trainer_state.pt`` (loaded, not as bytes: torch.save's bytes and the
    run fingerprint, which holds the inputs' mtimes, change from run to run; the fingerprint is left out)."""
    import torch

    state = torch.load(path, map_location="cpu", weights_only=True)
    out: dict[str, str] = {}
    for key in sorted(state):
        if key == "fingerprint":
            continue
        parts = state[key] if isinstance(state[key], dict) and state[key] else {"": state[key]}
        for sub in sorted(parts, key=repr):
            h = hashlib.md5()
            _digest(parts[sub], h)
            out[f"{key}/{sub}" if sub != "" else key] = h.hexdigest()
    return out


def manifest_digest(path: Path) -> str:
    """md5 of a checkpoint's ``manifest.json`` less the run fingerprint (it holds the hash of ``rlhf_core``'s
    source, which any refactor changes) and less ``trainer_state.pt``'s sha256 (that file holds the fingerprint
    too; :func:`state_digest` compares its contents). Every other file's path, size and sha256 stay compared."""
    manifest = json.loads(Path(path).read_text())
    manifest.pop("fingerprint", None)
    for entry in manifest.get("files", []):
        if isinstance(entry, dict) and str(entry.get("path", "")).endswith("trainer_state.pt"):
            entry.pop("sha256", None)
    return hashlib.md5(json.dumps(manifest, sort_keys=True).encode()).hexdigest()


def checkpoint_tree(root: Path) -> dict[str, Any]:
    """``md5_tree`` of a checkpoint folder with each ``trainer_state.pt`` given as its :func:`state_digest` and
    each ``manifest.json`` as its :func:`manifest_digest`."""
    tree: dict[str, Any] = md5_tree(root)
    for name in tree:
        if name.endswith("trainer_state.pt"):
            tree[name] = state_digest(Path(root) / name)
        elif name.endswith("manifest.json"):
            tree[name] = manifest_digest(Path(root) / name)
    return tree


def listing(root: Path) -> list[str]:
    root = Path(root)
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")) if root.exists() else []


def fingerprint_result(result: Any, rec: Recorder, **extra: Any) -> dict[str, Any]:
    metrics = getattr(result, "metrics", {}) or {}
    return {
        "files": md5_tree(Path(result.output_dir)),
        "result_metrics": {k: _num(v) for k, v in sorted(metrics.items()) if not k.startswith("perf/")},
        "logged": rec.logged,
        "tables": rec.tables,
        "eval_samples": _exact(getattr(result, "eval_samples", [])),
        "rollout_table": _exact(getattr(result, "rollout_table", [])),
        **extra,
    }


# --------------------------------------------------------------------------------------
# The micro world (as tests/conftest.py builds it), relative to the working directory
# --------------------------------------------------------------------------------------


def build_world() -> dict[str, str]:
    from rlhf_core.embedded.tiny_model import build_tiny_model, train_tokenizer
    from rlhf_core.embedded.tasks import generate_datasets

    data = generate_datasets(Path("world/data"), **MICRO_GEN)
    texts = [json.loads(line)["prompt"] + json.loads(line)["completion"]
             for line in Path(data["sft"]).read_text().splitlines()]
    tok = train_tokenizer(texts, Path("world/tok/tokenizer"), vocab_size=280)
    qwen = build_tiny_model(tok, Path("world/models/qwen2"), arch="qwen2", **MICRO_MODEL)
    llama = build_tiny_model(tok, Path("world/models/llama"), arch="llama", hidden_size=48, num_layers=3,
                             num_heads=4, num_kv_heads=2, intermediate_size=96, max_positions=96, seed=1,
                             chat_template=LLAMA_CHAT_TEMPLATE)
    Path("world/length_reward.py").write_text(LENGTH_REWARD)
    world = {k: str(v) for k, v in data.items()}
    world.update(tokenizer=str(tok), model=str(qwen), llama=str(llama), length_reward="world/length_reward.py:reward")
    return world


# --------------------------------------------------------------------------------------
# The runs
# --------------------------------------------------------------------------------------


def _dirs(name: str) -> dict[str, str]:
    return {"output_dir": f"runs/{name}/out", "checkpoint_dir": f"runs/{name}/ckpt"}


COMMON = dict(num_threads=1, precision="fp32", log_every=1, keep_checkpoints=2)


def run_sft(w: dict[str, str], rec: Recorder) -> dict[str, Any]:
    from rlhf_core.config import SFTConfig
    from rlhf_core.trainers.sft import train_sft

    cfg = SFTConfig(model_path=w["model"], train_file=w["sft"], eval_file=w["eval"], **_dirs("sft"), **COMMON,
                    max_steps=6, batch_size=16, grad_accum=2, lr=3e-3, warmup_steps=2, eval_every=3, eval_items=16,
                    save_every=2)
    result = train_sft(cfg, rec, show_progress=False)
    return fingerprint_result(result, rec, checkpoint_dir_after=listing(Path(cfg.checkpoint_dir)))


def run_reward(w: dict[str, str], rec: Recorder) -> dict[str, Any]:
    from rlhf_core.config import RewardConfig
    from rlhf_core.trainers.reward import train_reward_model

    cfg = RewardConfig(model_path=w["model"], train_file=w["preferences"], eval_file="", eval_fraction=0.2,
                       **_dirs("reward"), **COMMON, max_steps=6, batch_size=8, lr=3e-3, warmup_steps=2,
                       eval_every=3, save_every=3)
    result = train_reward_model(cfg, rec, show_progress=False)
    return fingerprint_result(result, rec, checkpoint_dir_after=listing(Path(cfg.checkpoint_dir)))


def run_dpo(w: dict[str, str], rec: Recorder) -> dict[str, Any]:
    from rlhf_core.config import DPOConfig
    from rlhf_core.trainers.dpo import train_dpo

    cfg = DPOConfig(model_path=w["model"], train_file=w["preferences"], eval_file=w["eval"], **_dirs("dpo"),
                    **COMMON, max_steps=6, batch_size=8, lr=3e-3, warmup_steps=2, eval_items=8, beta=0.5,
                    nll_weight=0.5, eval_every=3, save_every=3)
    result = train_dpo(cfg, rec, show_progress=False)
    return fingerprint_result(result, rec, checkpoint_dir_after=listing(Path(cfg.checkpoint_dir)))


def run_kto(w: dict[str, str], rec: Recorder) -> dict[str, Any]:
    from rlhf_core.config import KTOConfig
    from rlhf_core.trainers.kto import train_kto

    cfg = KTOConfig(model_path=w["model"], train_file=w["preferences"], eval_file=w["eval"], **_dirs("kto"),
                    **COMMON, max_steps=6, batch_size=8, lr=3e-3, warmup_steps=2, eval_items=8, beta=0.5,
                    eval_every=3, save_every=3)
    result = train_kto(cfg, rec, show_progress=False)
    return fingerprint_result(result, rec, checkpoint_dir_after=listing(Path(cfg.checkpoint_dir)))


def run_distill(w: dict[str, str], rec: Recorder) -> dict[str, Any]:
    from rlhf_core.config import DistillConfig
    from rlhf_core.trainers.distill import train_distill

    cfg = DistillConfig(model_path=w["model"], teacher_path=w["llama"], train_file=w["sft"], eval_file=w["eval"],
                        **_dirs("distill"), **COMMON, max_steps=6, batch_size=8, lr=3e-3, warmup_steps=2,
                        eval_items=8, nll_weight=0.25, eval_every=3, save_every=3)
    result = train_distill(cfg, rec, show_progress=False)
    return fingerprint_result(result, rec, checkpoint_dir_after=listing(Path(cfg.checkpoint_dir)))


def run_raft(w: dict[str, str], rec: Recorder) -> dict[str, Any]:
    """One RAFT round as the align flow runs it: rejection sampling (rule scorer), then SFT on the kept samples."""
    from rlhf_core.config import RaftConfig, RejectionConfig
    from rlhf_core.rollout.rejection import rejection_sample
    from rlhf_core.trainers.sft import train_sft

    rej = rejection_sample(RejectionConfig(policy_path=w["model"], prompts_file=w["prompts"], scorer="rule",
                                           n_samples=4, max_prompts=24, temperature=1.5, max_new_tokens=8,
                                           batch_size=64, num_threads=1, seed=0,
                                           output_file="runs/raft/rejection/best.jsonl",
                                           pairs_file="runs/raft/rejection/pairs.jsonl"), show_progress=False)
    cfg = RaftConfig(model_path=w["model"], train_file=str(rej.output_file), eval_file=w["eval"], **_dirs("raft"),
                     **COMMON, max_steps=4, batch_size=8, lr=3e-3, warmup_steps=1, eval_items=8, eval_every=2,
                     save_every=2)
    result = train_sft(cfg, rec, show_progress=False)
    return fingerprint_result(result, rec, checkpoint_dir_after=listing(Path(cfg.checkpoint_dir)),
                              rejection_files=md5_tree(Path("runs/raft/rejection")),
                              rejection_metrics={k: _num(v) for k, v in sorted(rej.metrics.items())})


def _rl_cfg(w: dict[str, str], name: str, kw: dict[str, Any]) -> Any:
    """The RL runs' config: these values, then ``kw`` (dotted names within rl's sections: ``kl.coef``)."""
    from rlhf_core.config import RLConfig, build_config

    values = {"model_path": w["model"], "prompts_file": w["prompts"], "eval_file": w["eval"], **_dirs(name),
              "reward.function": w["length_reward"], "rollout.prompts_per_step": 4, "rollout.group_size": 4,
              "rollout.max_new_tokens": 6, "batch_size": 64, "algorithm.mini_batch_size": 8, "lr": 3e-3,
              "algorithm.critic_lr": 3e-3, "warmup_steps": 0, "eval_items": 8, "eval_at_start": True,
              "log_rollouts_every": 1, "num_threads": 1, "precision": "fp32", "keep_checkpoints": 2}
    values.update(kw)
    if not hasattr(RLConfig, "renamed"):  # a checkout whose RLConfig is flat: the same values, flat names
        flat = {new: old for old, new in _renamed().items()}
        values = {flat.get(k, k): v for k, v in values.items()}
    return build_config(RLConfig, "rl", values)


def run_grpo(w: dict[str, str], rec: Recorder) -> dict[str, Any]:
    from rlhf_core.trainers.rl import train_rl

    cfg = _rl_cfg(w, "grpo", {"algorithm.estimator": "grpo", "max_steps": 4, "eval_every": 2, "save_every": 2,
                              "kl.coef": 0.1, "kl.estimator": "k3", "kl.adaptive": True, "kl.target": 0.05,
                              "kl.horizon": 16})
    result = train_rl(cfg, rec, show_progress=False)
    return fingerprint_result(result, rec, checkpoint_dir_after=listing(Path(cfg.checkpoint_dir)))


def run_ppo(w: dict[str, str], rec: Recorder) -> dict[str, Any]:
    from rlhf_core.trainers.rl import train_rl

    cfg = _rl_cfg(w, "ppo", {"algorithm.estimator": "gae", "kl.in_reward": True, "kl.estimator": "k1", "max_steps": 3,
                             "eval_every": 2, "save_every": 2, "algorithm.ppo_epochs": 2})
    result = train_rl(cfg, rec, show_progress=False)
    return fingerprint_result(result, rec, checkpoint_dir_after=listing(Path(cfg.checkpoint_dir)))


def _resumed(stage: str, fail_after: int, train: Callable[..., Any], cfg: Any, rec: Recorder) -> dict[str, Any]:
    """Run ``cfg`` until the loop's fault hook (``ALIGNFLOW_FAULT``, raised right after a step's checkpoint)
    stops it, then run it again: it resumes from the newest checkpoint. Fingerprints the resumed run, the
    first run's metrics and the checkpoints as they were at the fault."""
    from rlhf_core.common.faults import InjectedFault

    first = Recorder()
    os.environ["ALIGNFLOW_FAULT"] = f"{stage}:{fail_after}"
    try:
        train(cfg, first, show_progress=False)
        raise RuntimeError(f"ALIGNFLOW_FAULT={stage}:{fail_after} did not stop the run")
    except InjectedFault:
        pass
    finally:
        os.environ.pop("ALIGNFLOW_FAULT", None)
    at_fault = checkpoint_tree(Path(cfg.checkpoint_dir))
    result = train(cfg, rec, show_progress=False)
    return fingerprint_result(result, rec, logged_before_fault=first.logged, first_run_tables=first.tables,
                              checkpoints_at_fault=at_fault, checkpoint_dir_after=listing(Path(cfg.checkpoint_dir)))


def run_sft_resume(w: dict[str, str], rec: Recorder) -> dict[str, Any]:
    from rlhf_core.config import SFTConfig
    from rlhf_core.trainers.sft import train_sft

    cfg = SFTConfig(model_path=w["model"], train_file=w["sft"], eval_file=w["eval"], **_dirs("sft_resume"),
                    **COMMON, max_steps=8, batch_size=16, lr=3e-3, warmup_steps=2, eval_every=3, eval_items=16,
                    save_every=2)
    return _resumed("sft", 5, train_sft, cfg, rec)


def run_grpo_resume(w: dict[str, str], rec: Recorder) -> dict[str, Any]:
    from rlhf_core.trainers.rl import train_rl

    cfg = _rl_cfg(w, "grpo_resume", {"algorithm.estimator": "grpo", "max_steps": 5, "eval_every": 2, "save_every": 2,
                                     "kl.adaptive": True, "kl.coef": 0.1, "kl.target": 0.05, "kl.horizon": 16})
    return _resumed("rl", 3, train_rl, cfg, rec)


def run_ppo_resume(w: dict[str, str], rec: Recorder) -> dict[str, Any]:
    from rlhf_core.trainers.rl import train_rl

    cfg = _rl_cfg(w, "ppo_resume", {"algorithm.estimator": "gae", "kl.in_reward": True, "kl.estimator": "k1",
                                    "max_steps": 4, "eval_every": 2, "save_every": 2})
    return _resumed("rl", 3, train_rl, cfg, rec)


def _where_ray_imports() -> str:
    import rlhf_core

    return str(Path(rlhf_core.__file__).resolve())


def run_grpo_ray(w: dict[str, str], rec: Recorder) -> dict[str, Any]:
    """GRPO with the controller here and the models in Ray actors (colocated, 2 DDP ranks over gloo),
    as tests/model/test_parallel.py runs it, on a local Ray instance of this run's own."""
    import ray

    from rlhf_core.trainers.ray_launcher import connect
    from rlhf_core.trainers.rl_on_ray import train_rl_on_ray

    saved = os.environ.pop("RAY_ADDRESS", None)
    connect(min_cpus=4)
    try:
        worker_import = ray.get(ray.remote(num_cpus=0)(_where_ray_imports).remote())
        print(f"[fingerprints] Ray workers import rlhf_core from {worker_import}", flush=True)
        here = _where_ray_imports()
        if worker_import != here:
            raise RuntimeError(f"Ray workers import rlhf_core from {worker_import}, this process from {here}")
        cfg = _rl_cfg(w, "grpo_ray", {"algorithm.estimator": "grpo", "distribution.placement": "colocated",
                                      "num_workers": 2, "max_steps": 3, "eval_every": 2, "save_every": 2})
        result = train_rl_on_ray(cfg, rec, show_progress=False)
        return fingerprint_result(result, rec, checkpoint_dir_after=listing(Path(cfg.checkpoint_dir)))
    finally:
        ray.shutdown()
        if saved is not None:
            os.environ["RAY_ADDRESS"] = saved


RUNS: dict[str, Callable[[dict[str, str], Recorder], dict[str, Any]]] = {
    "sft": run_sft, "reward": run_reward, "dpo": run_dpo, "kto": run_kto, "distill": run_distill,
    "raft": run_raft, "grpo": run_grpo, "ppo": run_ppo, "grpo_ray": run_grpo_ray,
    "sft_resume": run_sft_resume, "grpo_resume": run_grpo_resume, "ppo_resume": run_ppo_resume,
}
assert list(RUNS) == TRAINERS


# --------------------------------------------------------------------------------------
# Fingerprint mode
# --------------------------------------------------------------------------------------


def _git_head(repo: Path) -> str:
    try:
        out = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True)
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--", "rlhf_core"],
                               capture_output=True, text=True)
        return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except OSError:
        return "unknown"


def fingerprint(names: list[str], out: Path, keep: bool) -> int:
    import rlhf_core

    pkg = Path(rlhf_core.__file__).resolve()
    repo = pkg.parent.parent
    print(f"[fingerprints] rlhf_core.__file__ = {pkg}", flush=True)
    # Subprocesses (the tokenizer trainer) and Ray workers must import this same rlhf_core, also
    # after the chdir below (a relative PYTHONPATH such as '.' would then point elsewhere).
    os.environ["PYTHONPATH"] = os.pathsep.join([str(repo)] + [str(Path(p).resolve()) for p in
                                                              os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])

    import torch

    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass

    doc: dict[str, Any] = {
        "meta": {"rlhf_core": str(pkg), "git_head": _git_head(repo), "python": sys.version.split()[0],
                 "torch": torch.__version__, "trainers": names},
        "trainers": {},
    }
    out = out.resolve()
    work = Path(tempfile.mkdtemp(prefix="alignflow-fingerprints-"))
    cwd = os.getcwd()
    failed = []
    try:
        os.chdir(work)
        started = time.perf_counter()
        world = build_world()
        doc["world"] = {"seconds": round(time.perf_counter() - started, 2),
                        "files": {k: md5_tree(Path(v.split(":")[0])) for k, v in sorted(world.items())}}
        print(f"[fingerprints] world built in {doc['world']['seconds']:.1f} s under {work}", flush=True)
        for name in names:
            rec = Recorder()
            started = time.perf_counter()
            try:
                entry = RUNS[name](world, rec)
            except Exception:  # noqa: BLE001 - a failing trainer is a finding, recorded and compared
                entry = {"error": traceback.format_exc(limit=-3).strip().splitlines()[-1],
                         "logged": rec.logged, "tables": rec.tables}
                traceback.print_exc()
                failed.append(name)
            entry["seconds"] = round(time.perf_counter() - started, 2)
            doc["trainers"][name] = entry
            print(f"[fingerprints] {name}: {entry['seconds']:.1f} s, {len(entry.get('logged', []))} metric points"
                  f"{', ERROR ' + entry['error'] if 'error' in entry else ''}", flush=True)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(doc, indent=1, sort_keys=False) + "\n")  # partial results survive a crash
    finally:
        os.chdir(cwd)
        if keep:
            print(f"[fingerprints] kept the work folder {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print(f"[fingerprints] wrote {out}" + (f"; FAILED: {', '.join(failed)}" if failed else ""), flush=True)
    return 1 if failed else 0


# --------------------------------------------------------------------------------------
# Compare mode
# --------------------------------------------------------------------------------------


def _diffs(a: Any, b: Any, path: str, out: list[str], limit: int) -> None:
    """First differences between two JSON values, as readable lines."""
    if len(out) >= limit or a == b:
        return
    if isinstance(a, dict) and isinstance(b, dict):
        for k in list(a) + [k for k in b if k not in a]:
            if k not in b:
                out.append(f"{path}/{k}: only in A ({_short(a[k])})")
            elif k not in a:
                out.append(f"{path}/{k}: only in B ({_short(b[k])})")
            else:
                _diffs(a[k], b[k], f"{path}/{k}", out, limit)
            if len(out) >= limit:
                return
        return
    if isinstance(a, list) and isinstance(b, list):
        if path.endswith("/logged") and sorted(map(json.dumps, a)) == sorted(map(json.dumps, b)):
            out.append(f"{path}: same metric points, different logging order")
            return
        for i, (x, y) in enumerate(zip(a, b)):
            if path.endswith("logged") and x != y:  # a whole [step, name, value] row reads best
                out.append(f"{path}[{i}]: A={_short(x)}  B={_short(y)}")
            else:
                _diffs(x, y, f"{path}[{i}]", out, limit)
            if len(out) >= limit:
                return
        if len(a) != len(b):
            out.append(f"{path}: length {len(a)} (A) vs {len(b)} (B)")
        return
    out.append(f"{path}: A={_short(a)}  B={_short(b)}")


def _short(v: Any) -> str:
    s = json.dumps(v)
    return s if len(s) <= 160 else s[:157] + "..."


def compare(path_a: Path, path_b: Path, limit: int = 8) -> int:
    a, b = json.loads(Path(path_a).read_text()), json.loads(Path(path_b).read_text())
    print(f"A: {path_a} (rlhf_core {a['meta'].get('rlhf_core')}, {a['meta'].get('git_head')})")
    print(f"B: {path_b} (rlhf_core {b['meta'].get('rlhf_core')}, {b['meta'].get('git_head')})")
    bad = 0
    strip = lambda d: {k: v for k, v in d.items() if k not in NOT_COMPARED}  # noqa: E731
    names = ["world"] + [n for n in TRAINERS if n in a["trainers"] or n in b["trainers"]]
    for name in names:
        x = a.get("world") if name == "world" else a["trainers"].get(name)
        y = b.get("world") if name == "world" else b["trainers"].get(name)
        if x is None or y is None:
            print(f"{name:11s} MISSING in {'A' if x is None else 'B'}")
            bad += 1
            continue
        lines: list[str] = []
        _diffs(strip(x), strip(y), "", lines, limit)
        errors = [f"{side}: {d['error']}" for side, d in (("A", x), ("B", y)) if "error" in d]
        tx, ty = x.get("seconds", math.nan), y.get("seconds", math.nan)
        if lines or errors:
            bad += 1
            print(f"{name:11s} DIFFERENT   ({tx:.1f} s vs {ty:.1f} s)")
            for line in errors + lines:
                print(f"    {line}")
        else:
            n = len(x.get("logged", []))
            files = x.get("files", {})
            n_files = sum(len(v) if isinstance(v, dict) else 1 for v in files.values())
            print(f"{name:11s} IDENTICAL   ({n_files} files, {n} metric points; "
                  f"{tx:.1f} s vs {ty:.1f} s)")
    print("all identical" if not bad else f"{bad} of {len(names)} differ")
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="JSON file receiving the fingerprints")
    p.add_argument("--only", default="", help=f"comma-separated subset of {','.join(TRAINERS)}")
    p.add_argument("--compare", nargs=2, type=Path, metavar=("A.json", "B.json"),
                   help="compare two fingerprint files; exit 1 if any trainer differs")
    p.add_argument("--keep", action="store_true", help="keep the temporary work folder (for debugging)")
    args = p.parse_args(argv)
    if args.compare:
        return compare(*args.compare)
    if args.out is None:
        p.error("--out is required (or use --compare A.json B.json)")
    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(TRAINERS)
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        p.error(f"unknown trainer(s) {unknown}; known: {', '.join(TRAINERS)}")
    return fingerprint([n for n in TRAINERS if n in names], args.out, args.keep)


if __name__ == "__main__":
    sys.exit(main())
