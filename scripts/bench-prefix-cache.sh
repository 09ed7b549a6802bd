#!/bin/bash
# Turn-2 latency of a two-turn conversation with the prefill prefix cache on or off
# (docs/benchmarks.md "Prefix cache"). Starts `pdserve up` on MODEL, sends 8 conversations
# (turn 1: a ~550-token history; turn 2: the same history and a question) with max_tokens 1, so
# the request time is the time to first token, and prints turn 2's time and usage.
# usage: scripts/bench-prefix-cache.sh PDSERVE MODEL_DIR PREFIX_CACHE_BLOCKS PORT
set -euo pipefail
PDS=$1 MODEL=$2 BLOCKS=$3 PORT=$4
OUT=$(mktemp -d)
"$PDS" up --model.path="$MODEL" --port "$PORT" --prefill.threads=1 --decode.threads=1 --prefill.chunk_size=64 \
  --prefill.cache_block_size=64 --prefill.prefix_cache_blocks="$BLOCKS" --log.level=warn >"$OUT/up.log" 2>&1 &
UP=$!
trap 'kill -INT $UP 2>/dev/null; wait $UP 2>/dev/null; rm -rf "$OUT"' EXIT
for _ in $(seq 1 120); do curl -sf "localhost:$PORT/ready" >/dev/null 2>&1 && break; sleep 1; done
for c in 1 2 3 4 5 6 7 8; do
  H="Conversation $c:"
  for w in $(seq 1 60); do H="$H the river $((w * c)) runs to the sea;"; done
  for turn in 1 2; do
    P="$H"
    [ "$turn" = 2 ] && P="$H and what happens next?"
    T=$(curl -s -o "$OUT/out.json" -w '%{time_total}' "localhost:$PORT/v1/completions" \
      -H 'Content-Type: application/json' \
      -d "{\"model\":\"pdserve-default\",\"prompt\":\"$P\",\"max_tokens\":1,\"temperature\":0}")
    if [ "$turn" = 2 ]; then
      python3 -c "import json,sys; u=json.load(open('$OUT/out.json'))['usage']; \
print('conv $c turn2 %.1f ms, prompt %d, cached %d' % ($T*1000, u['prompt_tokens'], \
u.get('prompt_tokens_details', {}).get('cached_tokens', 0)))"
    fi
  done
done
