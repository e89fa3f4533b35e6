"""Third-party messages that tell an alignflow user nothing, dropped at the logger that emits them.

* DeepSpeed's ``Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect
  it.``: printed on stdout (into a stage command's JSON) by every process that imports DeepSpeed on a
  machine without CUDA; alignflow trains on the CPU there by design (``models.pick_device``).
* MLflow's transformers flavor asking the Hugging Face Hub for a model card and a licence for every logged
  model (``The model card could not be retrieved from the hub ... make sure your Internet connection is
  on``, ``Unable to find license information``): alignflow logs local folders, and runs offline
  (:mod:`rlhf_core.common.offline`), so the look-up can only fail.

Each filter drops only the messages named in :data:`DROPPED`; everything else those loggers say still
shows. :func:`install` runs when ``rlhf_core`` is imported, so the driver, a stage's child process and each
Ray actor are all covered.
"""

from __future__ import annotations

import logging

DROPPED: dict[str, tuple[str, ...]] = {
    "DeepSpeed": ("Setting accelerator to CPU",),
    "mlflow.transformers": ("The model card could not be retrieved from the hub",
                            "Unable to find license information"),
}
"""Logger name -> the starts of the messages dropped from it."""


class _DropMessages(logging.Filter):
    """Drops the records whose message starts with one of ``starts``."""

    def __init__(self, starts: tuple[str, ...]):
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.starts)


def install() -> None:
    """Add the filters of :data:`DROPPED` to their loggers (once; the loggers need not exist yet: DeepSpeed
    sets its logger's level and handler when imported, and keeps the filters)."""
    for name, starts in DROPPED.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessages) for f in logger.filters):
            logger.addFilter(_DropMessages(starts))
