"""Sections of the pipeline around the trainers: where runs are tracked (``tracking``), how long they are kept
(``retention``), how the align flow runs its stages (``flow``) and the iterative flows' cycles (``cycles``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from rlhf_core.config.base import _check
from rlhf_core.config.stage_registry import chain_names


@dataclass
class TrackingConfig:
    """``tracking``: where MLflow (or the local-file fallback) records runs."""

    tracking_uri: str = ""
    """MLflow tracking URI; empty means sqlite at <project>/mlflow.db (MLFLOW_TRACKING_URI wins)."""
    artifact_dir: str = "mlartifacts"
    """Artifact folder for new experiments of a local store (sqlite), relative to the project root unless absolute;
    on a tracking server (http(s)) new experiments keep their artifacts in the server's store."""
    experiment: str = "alignflow"
    """MLflow experiment name."""
    registered_model: str = "alignflow-sft"
    """Registry name of the SFT model."""
    log_model: bool = True
    """Log the final model with MLflow's transformers flavor and register it."""
    connect_patience_s: float = 20.0
    """Seconds a stage waits for an http(s) tracking server to answer when it opens its run, then fails with a
    clear error (without this bound MLflow's own retries block each call about 4 minutes). 20 s keeps the whole
    failure, process start included, within 30 s; raise it to ride out a server restart."""
    model_storage: str = "copy"
    """How a registered model is kept: copy (MLflow's transformers flavor: the folder is copied into the artifact
    store, so models:/<name>@champion loads anywhere and outlives the folder; about 15 GB per 7B version) or
    reference (a small JSON pointer with the folder's absolute path and DVC md5, no weights copied: only for
    folders that are DVC-versioned or never overwritten, since the flows rewrite models/ on every run)."""
    keep_model_versions: int = 0
    """After each registration keep only this many newest versions of the registered model, plus every version
    an alias (champion, candidate) points at or whose registration is under way; older ones are deleted with
    the weights they copied. 0 keeps every version."""
    registry_settle_s: float = 2.0
    """On a shared tracking server (http(s) or a database server, which the project's lock cannot guard), seconds a
    promotion waits, twice, before re-reading the champion alias to catch a concurrent flow's overwrite."""
    hash_cache: str | bool = ""
    """File of the md5 cache of inputs (empty: <project>/.alignflow/hash-cache.json; off or false: none)."""

    def __post_init__(self) -> None:
        if isinstance(self.hash_cache, bool):  # YAML 1.1: a bare off is a boolean
            self.hash_cache = "" if self.hash_cache else "off"
        _check(self.connect_patience_s >= 0, "tracking", "connect_patience_s",
               f"must be >= 0 seconds, got {self.connect_patience_s}")
        _check(self.model_storage in ("copy", "reference"), "tracking", "model_storage",
               f"must be copy or reference, got {self.model_storage!r}")
        _check(self.keep_model_versions >= 0, "tracking", "keep_model_versions",
               f"must be >= 0 (0 keeps every version), got {self.keep_model_versions}")
        _check(self.registry_settle_s >= 0, "tracking", "registry_settle_s",
               f"must be >= 0 seconds, got {self.registry_settle_s}")


@dataclass
class RetentionConfig:
    """``retention``: what ``alignflow gc`` keeps of old runs, checkpoints and DVC objects. Whatever these say,
    it keeps every registered version an alias points at, that version's lineage, and runs tagged alignflow.keep."""

    keep_runs: int = 10
    """Keep the newest this many flow runs (a run with no parent run, with all its stage runs) and the git commits
    they ran at."""
    keep_days: float = 7.0
    """Also keep every run, checkpoint and git commit younger than this many days."""
    dvc_cloud: bool = False
    """Also delete, from the DVC remote, the objects no kept commit or kept run refers to (``dvc gc --cloud``)."""
    dvc_remote: str = ""
    """The DVC remote ``dvc_cloud`` cleans (empty: the project's default remote)."""

    def __post_init__(self) -> None:
        _check(self.keep_runs >= 1, "retention", "keep_runs",
               f"must be >= 1 (the newest flow run is always kept), got {self.keep_runs}")
        _check(self.keep_days >= 0, "retention", "keep_days", f"must be >= 0 days, got {self.keep_days}")


@dataclass
class FlowConfig:
    """``flow``: how the align flow runs its stages."""

    retries: int = 1
    """Retries of a failed task (transient failures: a busy file system, a killed worker)."""
    retry_delay_s: float = 2.0
    """Seconds between retries."""
    use_cache: bool = True
    """Reuse a task's result when its inputs (paths + md5s), params and code are unchanged."""
    isolation: str = "process"
    """Where training tasks run: process (a child process per stage, so a killed or crashed trainer is a
    failed task that Prefect retries from the stage's checkpoint, and the stage's memory is returned
    when it ends) or inline (in the flow's own process: no start-up cost, but a crash ends the flow)."""
    ray_address: str = ""
    """Ray cluster (``host:port`` that ``ray start --head`` prints) that training tasks are submitted to through
    prefect-ray; each task then runs in a Ray worker there (its data-parallel ranks too). Empty: tasks run on
    this machine, where a stage with num_workers > 1 still attaches to RAY_ADDRESS when that is set."""
    stages: list[str] = field(default_factory=lambda: list(chain_names()))
    """Alignment stages run after SFT, in this order: any of the stage registry's align chain (the default;
    rejection and rl with reward_kind model use the reward stage's model; raft needs rejection)."""
    gpu_limit: str = "alignflow-gpus"
    """Prefect global concurrency limit a flow run holds from its first GPU stage (the base model) to its last, so
    flows of every project on one Prefect server take turns on the GPUs instead of running out of memory together.
    Made on first use with one slot per device of the machine (``alignflow services up`` sizes it from
    team.gpu_devices); empty: no limit."""
    gpu_slots: int = 1
    """Slots of gpu_limit one flow run holds: the devices its widest stage uses (num_workers)."""

    def __post_init__(self) -> None:
        _check(self.retries >= 0, "flow", "retries", f"must be >= 0, got {self.retries}")
        _check(self.isolation in ("process", "inline"), "flow", "isolation",
               f"must be process or inline, got {self.isolation!r}")
        _check(isinstance(self.stages, list) and all(isinstance(x, str) for x in self.stages), "flow", "stages",
               f"must be a list of stage names, got {self.stages!r}")
        unknown = [x for x in self.stages if x not in chain_names()]
        _check(not unknown, "flow", "stages", f"unknown stage(s) {unknown}; known: {list(chain_names())}")
        _check("raft" not in self.stages or "rejection" in self.stages, "flow", "stages",
               "raft trains on the rejection stage's output: add rejection")
        _check(self.gpu_slots >= 1, "flow", "gpu_slots", f"must be >= 1, got {self.gpu_slots}")
        _check(all(c not in self.gpu_limit for c in "/%&<>"), "flow", "gpu_limit",
               f"a Prefect limit name has none of / % & < >, got {self.gpu_limit!r}")


@dataclass
class CyclesConfig:
    """``cycles``: the iterative_dpo and raft flows (sample -> score -> version -> train, N times)."""

    cycles: int = 3
    """Number of cycles; each starts from the previous cycle's policy."""
    start_model: str = "models/sft"
    """Policy of the first cycle."""
    scorer: str = "reward_model"
    """reward_model (reward_model_path) or rule (exact match against the prompt's label)."""
    reward_model_path: str = "models/reward"
    """Reward model scoring the samples (and, with retrain_reward, the one retrained each cycle)."""
    n_samples: int = 4
    """Samples per prompt in each cycle."""
    temperature: float = 1.0
    """Sampling temperature."""
    max_prompts: int = 0
    """Prompts sampled per cycle (0: the whole prompt file)."""
    retrain_reward: bool = False
    """iterative_dpo: retrain the reward model each cycle on all pairs so far (plus the original pairs)."""
    data_dir: str = "data/cycles"
    """Each flow writes its cycle data under <data_dir>/<flow>/ (DVC-tracked, overwritten each cycle)."""
    models_dir: str = "models/cycles"
    """Each cycle's policy goes to <models_dir>/<flow>/cycle_<k>."""
    version: bool = True
    """Commit each cycle's data (and retrained reward model) to git + DVC and push to the DVC remote."""
    push: bool = True
    """Push versioned data to the default DVC remote."""
    registered_model: str = "alignflow-policy"
    """Registry name of each cycle's policy (aliases: candidate, champion)."""
    seed: int = 0
    """Base sampling seed; cycle k samples with seed + k."""

    def __post_init__(self) -> None:
        s = "cycles"
        _check(self.cycles >= 1, s, "cycles", f"must be >= 1, got {self.cycles}")
        _check(self.scorer in ("reward_model", "rule"), s, "scorer", f"must be reward_model or rule, got {self.scorer!r}")
        _check(self.n_samples >= 2, s, "n_samples", f"must be >= 2, got {self.n_samples}")
        _check(self.temperature > 0, s, "temperature", f"must be > 0, got {self.temperature}")
        _check(self.max_prompts >= 0, s, "max_prompts", f"must be >= 0, got {self.max_prompts}")
