"""No third-party chatter that tells a user nothing (rlhf_core/common/quiet.py, rlhf_core/common/offline.py).

Logging a model through MLflow's transformers flavor used to print, for every model, that the model card
"could not be retrieved from the hub ... make sure your Internet connection is on" and that no licence was
found; importing DeepSpeed on a CPU machine printed its accelerator warning on stdout, inside a stage
command's JSON. Real MLflow (sqlite) and the micro model; DeepSpeed imported in a fresh interpreter.
"""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO

HUB_TEXT = ("Internet connection", "model card", "license information", "huggingface.co")


def test_logging_a_model_prints_no_hub_text(isolated_project, micro_model, capfd):
    from rlhf_core.config import TrackingConfig
    from rlhf_core.tracking.mlflow_runs import start_run

    with start_run(TrackingConfig(experiment="quiet"), "log-model") as run:
        uri = run.log_hf_model(micro_model, "quiet-model")
    assert uri  # logged and registered
    out, err = capfd.readouterr()
    for text in HUB_TEXT:
        assert text not in err and text not in out, (text, err[-2000:])


def test_deepspeed_on_a_cpu_machine_prints_nothing_on_stdout():
    """A stage command's stdout is its JSON result: DeepSpeed's CPU-accelerator warning must not land there."""
    proc = subprocess.run([sys.executable, "-c", "import rlhf_core, deepspeed\n"
                           "from deepspeed.accelerator import get_accelerator\nget_accelerator()"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Setting accelerator" not in proc.stdout + proc.stderr, proc.stdout
