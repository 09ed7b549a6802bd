#!/bin/sh
# Starts or resumes training in the background, niced, logging to DATA/ckpt/train.log.
#   tools/train/run_train.sh [DATA] [extra train.py args]    (DATA defaults to /work/train-data)
# Resume: run the same command again; train.py continues from DATA/ckpt/last.pt. When the
# schedule finishes, finish.sh exports DATA/export/tiny-dsv3 (+ -fp8) and runs the engine check.
set -e
HERE=$(cd "$(dirname "$0")" && pwd)
DATA=${1:-/work/train-data}
[ $# -gt 0 ] && shift
mkdir -p "$DATA/ckpt"
export OPENBLAS_NUM_THREADS=2 OMP_NUM_THREADS=2
cd "$HERE"
export PYTHONDONTWRITEBYTECODE=1
# train (resumes from DATA/ckpt/last.pt), then export + engine check when the schedule is done
nohup sh -c 'nice -n 19 /usr/bin/python3 train.py --data "$0" "$@" && ./finish.sh "$0"' "$DATA" "$@" \
  >> "$DATA/ckpt/train.log" 2>&1 &
echo "training pid $! (log: $DATA/ckpt/train.log)"
