"""alignflow's training core: data, models, losses and trainers.

Imports nothing from ``flows`` or ``tasks``; runs with torch and transformers alone
(MLflow, Ray and DeepSpeed are optional at import time) so the same trainer code runs on
a laptop and on a lent GPU machine.
"""

from rlhf_core import env as _env  # noqa: F401  (sets offline switches before anything else)
from rlhf_core import quiet as _quiet

_quiet.install()  # third-party chatter dropped at its loggers, in every process that imports rlhf_core

__version__ = "0.1.0"
