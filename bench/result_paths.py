"""Where a benchmark's result file goes: ``bench/results/<device>/<UTC date>/<name>``.

``bench/record.py`` lists every file of that tree in ``bench/results/INDEX.md`` (device, date, the script
that wrote it, the commit that added it) and checks the listing against the tree.
"""

from __future__ import annotations

import re
from datetime import datetime, timezone
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def device_label() -> str:
    """``cpu``, or the first GPU's model in lower case, with ``xN`` for N GPUs on the host (``a100x4``)."""
    try:
        import torch
    except ImportError:
        return "cpu"
    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name(0)
    found = re.search(r"\b([A-Z]+\d{2,4}[A-Z]?)\b", name)
    model = (found.group(1) if found else name.split()[-1]).lower()
    count = torch.cuda.device_count()
    return model if count == 1 else f"{model}x{count}"


def result_path(name: str, device: str = "", day: str = "") -> Path:
    """``bench/results/<device>/<day>/<name>``; the device defaults to :func:`device_label`, the day to today (UTC)."""
    day = day or datetime.now(timezone.utc).strftime("%Y-%m-%d")
    return RESULTS / (device or device_label()) / day / name
