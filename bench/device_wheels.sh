#!/usr/bin/env bash
# Build .devwheels/ for a lent GPU machine: the shared pack (Ray, DeepSpeed, TRL; ../shared/device/pack.sh)
# plus the GPU-only extras the benchmarks use, pinned: liger-kernel 0.8.5 (Triton kernels; the first
# release with the per-token gradient fix for reduction='none', PR #1298). Never installed on the CPU
# machine: `make` does not touch these. bench/device_setup.sh installs everything in .devwheels/.
set -euo pipefail
bash ../shared/device/pack.sh
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 -d .devwheels "liger-kernel==0.8.5"
du -sh .devwheels
