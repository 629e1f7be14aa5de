#!/usr/bin/env bash
# Train MAC, Transformer++ and SWA (and MAG, the other hybrid) with the same data, tokenizer, preset and
# token budget, then print a table of held-out loss and bits per byte. Extra arguments go to `titans train`
# for every run, e.g.
#   scripts/compare.sh --set steps=100            (a quicker look)
#   scripts/compare.sh --overwrite                (discard earlier runs; the default resumes / reuses them)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
args=("$@")
[[ " $* " == *" --overwrite "* || " $* " == *" --resume "* ]] || args+=(--resume)
exec "$PYTHON" -m titans train \
  --compare configs/compare_mac.json configs/compare_transformer.json configs/compare_swa.json configs/compare_mag.json \
  "${args[@]}"
