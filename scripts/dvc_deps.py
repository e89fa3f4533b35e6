"""``alignflow dvc-stages`` under its former name: write or check ``dvc.yaml`` from the stage registry.

The generator is :mod:`flows.dvc_stages`; this keeps ``python scripts/dvc_deps.py [--check|--write]`` working.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the checkout's packages
from flows.dvc_stages import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
