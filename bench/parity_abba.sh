#!/bin/bash
# What parity mode (rl.rollout.parity) costs per phase on the embedded GRPO: params.yaml's rl section with the HF
# engine, parity off, on, on, off (ABBA), STEPS steps each, one torch thread; each run's metric rows to
# OUT/rl_parity_<i>_<on|off>.json (bench/rl_embedded.py). Run from the repository root after `make repro` (it reads
# models/sft and data/embedded):  bash bench/parity_abba.sh bench/results/cpu/<UTC date> 12
set -euo pipefail
OUT=${1:?an output folder}
STEPS=${2:-12}
SCRATCH=$(mktemp -d)
trap 'rm -rf "$SCRATCH"' EXIT
mkdir -p "$OUT"
i=0
for parity in false true true false; do
  i=$((i + 1))
  name=$([ "$parity" = true ] && echo on || echo off)
  OMP_NUM_THREADS=1 .venv/bin/python bench/rl_embedded.py --out "$OUT/rl_parity_${i}_${name}.json" \
    --set max_steps="$STEPS" --set rollout.engine=hf --set rollout.parity="$parity" --set eval_at_start=false \
    --set eval_items=1 --set save_every=0 --set output_dir="$SCRATCH/out_$i" --set checkpoint_dir="$SCRATCH/ckpt_$i"
done
