#!/bin/sh
# Exports the latest checkpoint and checks it against the C++ engine (niced).
#   tools/train/finish.sh [DATA] [PDSERVE]
# Writes DATA/export/tiny-dsv3 (BF16), DATA/export/tiny-dsv3-fp8, eval.json, loss.svg and
# engine_check.json (in the BF16 folder), logging to DATA/export/finish.log.
set -e
HERE=$(cd "$(dirname "$0")" && pwd)
DATA=${1:-/work/train-data}
PDSERVE=${2:-$DATA/bin/pdserve}
OUT=$DATA/export/tiny-dsv3
export OPENBLAS_NUM_THREADS=2 OMP_NUM_THREADS=2 PYTHONDONTWRITEBYTECODE=1
cd "$HERE"
mkdir -p "$DATA/export"
{
  nice -n 19 /usr/bin/python3 export.py --data "$DATA" --out "$OUT"
  nice -n 19 /usr/bin/python3 check_engine.py --pdserve "$PDSERVE" --model "$OUT" > "$OUT/engine_check.json" || echo "engine check FAILED"
  nice -n 19 /usr/bin/python3 check_engine.py --pdserve "$PDSERVE" --model "$OUT-fp8" --tokens 8 > "$OUT-fp8/engine_check.json" || echo "fp8 engine check FAILED"
  tail -8 "$OUT/engine_check.json"
} >> "$DATA/export/finish.log" 2>&1
