"""The run dashboard's recorder: what every online RL step leaves for the page
(:mod:`rlhf_core.tracking.run_dashboard`).

One JSON line per step in ``<checkpoint_dir>/dashboard/records.jsonl``, beside the checkpoints, so a resumed
run keeps the steps before its checkpoint (a step's line is rewritten when the step runs again). Each holds:

* ``metrics``: the metrics :meth:`RLTrainer.train_step` returned (what the loop logs);
* ``spans``: ``[lane, phase, start, end]`` of every timed phase (wall-clock seconds); a lane is a process on
  CPU (``pid N``), a device on a GPU (``cuda:0``), split by thread (the trainer's, the rollout thread's). Under
  Ray it is the controller's process or device: a phase is the time the controller waited on its actors;
* ``staleness``: per sample, updates between the policy that generated it and the one it updates;
* ``samples``: per sample of the batch the update learns from: reward, response length, KL to the reference
  (the summed k3 estimate of KL(pi_old || pi_ref), as ``train/kl``) and the mean negative log-prob of its
  sampled tokens under the engine (an estimate of the policy's per-token entropy);
* ``mismatch_kl``: mean per token of the k3 estimate of KL(engine || trainer) over every row (``mismatch_rows``)
  where pi_old is recomputed before the update (the trainer's log-probs); None where pi_old is fused into the
  update (one update per batch), whose per-token log-probs stay inside it;
* ``drill``: the step's highest- and lowest-reward samples: prompt, completion cut into the policy's text and
  tool results, tool calls, reward, and the first :data:`MAX_TOKENS` response tokens with the engine's log-prob
  of each and, where pi_old is recomputed, the trainer's.

Nothing here changes what the run computes or logs (``scripts/trainer_fingerprints.py`` compares weights,
metrics and logged series): it reads what the step computed and adds no forward pass.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from rlhf_core.algorithms.kl import kl_penalty
from rlhf_core.common.redact import redact_secrets
from rlhf_core.config import RLConfig
from rlhf_core.tracking.run_dashboard import DASHBOARD_ARTIFACT, write_dashboard
from rlhf_core.trainers.rl_parts import Experience, PhaseTimes, Rollout, Sampled
from rlhf_core.trainers.rl_roles import KL_CLAMP

MAX_TOKENS = 256
"""Response tokens of a drill-down sample whose log-probs the page shows."""
MAX_PROMPT_CHARS = 1000
MAX_COMPLETION_CHARS = 2000
PHASE_NAMES = {"perf/rollout_s": "rollout", "perf/reward_s": "reward", "perf/logprob_s": "log-probs",
               "perf/update_s": "update", "perf/weight_sync_s": "sync"}


def _rounded(values: torch.Tensor, digits: int = 4, mask: torch.Tensor | None = None) -> list[float | None]:
    """``values`` rounded; None where ``mask`` is 0 (a tool result's tokens: no policy log-prob)."""
    keep = [1] * len(values) if mask is None else mask.tolist()
    return [round(float(v), digits) if k else None for v, k in zip(values.tolist(), keep)]


def drill_rows(rewards: torch.Tensor) -> list[int]:
    """The highest- and lowest-reward rows (the first of ties; one row when they coincide)."""
    if rewards.numel() == 0:
        return []
    hi, lo = int(torch.argmax(rewards)), int(torch.argmin(rewards))
    return [hi] if hi == lo else [hi, lo]


def policy_segments(actions: list[int]) -> list[tuple[str, int, int]]:
    """A response cut into runs of the policy's tokens (``action`` 1) and observations (0, a tool's result):
    ``(source, start, end)`` token ranges in order."""
    out, start = [], 0
    for j in range(1, len(actions) + 1):
        if j == len(actions) or actions[j] != actions[start]:
            out.append(("policy" if actions[start] else "observation", start, j))
            start = j
    return out


def mismatch_kl(engine_logp: torch.Tensor, trainer_logp: torch.Tensor, mask: torch.Tensor) -> float | None:
    """Mean over the tokens of ``mask`` of the k3 estimate of KL(engine || trainer) (Schulman 2020,
    ``exp(t - e) - (t - e) - 1`` per sampled token); all ``(rows, response_len)``. None without tokens."""
    n = float(mask.sum())
    if n == 0:
        return None
    k3 = kl_penalty(engine_logp.float(), trainer_logp.float(), "k3", clamp=KL_CLAMP)
    return float((k3 * mask).sum()) / n


class DashboardRecorder:
    """Records each step of an RL run (:meth:`before_update`, then :meth:`record`); :meth:`write_page` renders."""

    def __init__(self, cfg: RLConfig, tokenizer: Any, device: torch.device):
        self.cfg, self.tokenizer = cfg, tokenizer
        root = Path(cfg.checkpoint_dir)
        self.records_file = root / "dashboard" / "records.jsonl"
        self.page_file = root / DASHBOARD_ARTIFACT
        self.where = (f"cuda:{torch.cuda.current_device() if device.index is None else device.index}"
                      if device.type == "cuda" else f"pid {os.getpid()}")
        self.drill: list[dict[str, Any]] = []
        self.trainer_rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.started = False

    def lane(self, thread: str) -> str:
        return f"{self.where} · {'rollout thread' if thread.startswith('rl-rollout') else 'trainer'}"

    # ---- before the update: the drill-down rows and the trainer's log-probs -----------------------

    def before_update(self, sampled: Sampled, exp: Experience) -> None:
        """Pick the drill-down rows and keep the trainer's log-probs where pi_old was recomputed before the update
        (``exp.old_logp``). Where pi_old is the update's own log-prob (fused: one update per batch) the trainer's
        per-token log-probs are not at hand, and no forward is added to get them: the drill-down shows the
        engine's, and ``rollout/logprob_mismatch`` (logged by the update) is the mismatch."""
        rows = drill_rows(sampled.rewards)
        mask = exp.mask.detach().cpu()
        engine = exp.sampling_logp.detach().cpu() * mask
        trainer = None
        if self.cfg.off_policy.recompute_old_logprobs and not exp.fused_old:
            trainer = exp.old_logp.detach().cpu()
        self.trainer_rows = None if trainer is None else (engine, trainer, mask)
        self.drill = [self._sample(sampled, exp, engine, trainer, i) for i in rows]

    def _sample(self, sampled: Sampled, exp: Experience, engine: torch.Tensor, trainer: torch.Tensor | None,
                i: int) -> dict[str, Any]:
        batch, mask = sampled.batch, exp.mask.detach().cpu()
        n = int(batch.response_mask[i].sum())
        ids = batch.response_ids[i, :n].tolist()
        actions = batch.action_mask[i, :n].tolist() if batch.action_mask is not None else [1] * n
        segments, left = [], MAX_COMPLETION_CHARS
        for source, start, end in policy_segments(actions):
            if left <= 0:
                break
            text = self.tokenizer.decode(ids[start:end], skip_special_tokens=False)[:left]
            segments.append({"source": source, "text": text})
            left -= len(text)
        ids = ids[:MAX_TOKENS]
        return redact_secrets({
            "index": i, "prompt": batch.prompts[i][:MAX_PROMPT_CHARS], "segments": segments,
            "tool_calls": int(batch.tool_calls[i]) if batch.tool_calls is not None else 0,
            "reward": round(float(sampled.rewards[i]), 6), "n_tokens": n,
            "tokens": [self.tokenizer.decode([t], skip_special_tokens=False) for t in ids],
            "engine_logp": _rounded(engine[i, :len(ids)], mask=mask[i, :len(ids)]),
            "trainer_logp": None if trainer is None else _rounded(trainer[i, :len(ids)], mask=mask[i, :len(ids)]),
            "trainer_source": "pi_old" if trainer is not None else None,
            "staleness": 0})

    # ---- after the step: one line ---------------------------------------------------------------

    def record(self, step: int, rollout: Rollout, exp: Experience, metrics: dict[str, float],
               perf: PhaseTimes) -> None:
        """Append step ``step``'s line (dropping any line of this step or later: a resumed run redoes them)."""
        sampled, mask = rollout.sampled, exp.mask.detach().cpu()
        staleness = int(rollout.step - 1 - rollout.version) if self.cfg.off_policy.max_staleness else 0
        for sample in self.drill:
            sample["staleness"] = staleness
        kl = (kl_penalty(exp.old_logp.detach().cpu(), exp.ref_logp.detach().cpu(), "k3", clamp=KL_CLAMP)
              * mask).sum(-1)
        policy_tokens = mask.sum(-1).clamp(min=1)
        entropy = -(exp.sampling_logp.detach().cpu() * mask).sum(-1) / policy_tokens
        spans = [[self.lane(thread), PHASE_NAMES.get(name, name), start, end]
                 for name, start, end, thread in [*rollout.spans, *perf.spans]]
        line = {"step": step, "metrics": {k: float(v) for k, v in metrics.items()}, "spans": spans,
                "staleness": [staleness] * len(mask),
                "samples": {"reward": _rounded(sampled.rewards, 6),
                            "length": [int(v) for v in sampled.batch.response_lengths().tolist()],
                            "kl": _rounded(kl, 6), "entropy": _rounded(entropy, 6)},
                "mismatch_kl": None if self.trainer_rows is None else mismatch_kl(*self.trainer_rows),
                "mismatch_rows": 0 if self.trainer_rows is None else len(self.trainer_rows[0]),
                "drill": self.drill}
        self._append(step, line)

    def _append(self, step: int, line: dict[str, Any]) -> None:
        """On this process's first step, the lines of that step and later are dropped: a fresh run starts the
        file over, a resumed one redoes the steps after its checkpoint."""
        self.records_file.parent.mkdir(parents=True, exist_ok=True)
        if not self.started and self.records_file.exists():
            kept = [raw for raw in self.records_file.read_text(encoding="utf-8").splitlines()
                    if raw.strip() and json.loads(raw)["step"] < step]
            self.records_file.write_text("".join(k + "\n" for k in kept), encoding="utf-8")
        self.started = True
        with self.records_file.open("a", encoding="utf-8") as fh:
            fh.write(json.dumps(line) + "\n")

    def write_page(self, title: str) -> Path | None:
        """The page from every recorded step, at ``<checkpoint_dir>/dashboard.html``; None without records."""
        return write_dashboard(self.records_file, self.page_file, title)
