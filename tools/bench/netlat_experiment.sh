#!/usr/bin/env bash
# The network-latency experiment on one machine (docs/planner.md, "Network latency on one
# machine"): a local cluster (`pdserve up`) whose decode worker runs tensor-parallel over 2 ranks
# on the host (shm) communicator with a TEST-ONLY injected per-message latency
# (decode.tp_inject_latency_us), swept over a list of latencies; at each, single-stream decode
# tokens/s measured by `pdserve bench serve --concurrency 1`, and predicted by `pdserve plan` for
# the same setup (TP 2 as 2 "nodes" of 1 GPU, so every collective crosses the emulated network),
# with the planner's default network constants and with the constants `pdserve plan --calibrate`
# fits to these measurements. Writes OUT/netlat.json, OUT/netlat.md (table) and OUT/netlat.svg;
# with --update-docs also replaces the generated block in docs/planner.md and docs/netlat.svg.
#
# usage: tools/bench/netlat_experiment.sh [--update-docs]
# environment (defaults in brackets):
#   PDSERVE     pdserve binary [build/tools/pdserve]
#   MODEL       checkpoint folder [tests/data/golden/tiny-bf16]
#   TOKENIZER   tokenizer folder [~/.cache/pdserve/tokenizers/deepseek-v3]
#   LATENCIES   one-way latencies in ms [0.2 0.7 1.2 1.7 2.2]
#   INPUT_TOKENS / OUTPUT_TOKENS / NUM_PROMPTS   per level [32 / 64 / 6]
#   THREADS     compute threads per process [1]
#   CPU_BW_GBS / CPU_TFLOPS   this machine as a planner hardware override [20 / 0.1]
#   OUT         output folder [/tmp/pdserve-netlat]
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PDSERVE=${PDSERVE:-$ROOT/build/tools/pdserve}
MODEL=${MODEL:-$ROOT/tests/data/golden/tiny-bf16}
TOKENIZER=${TOKENIZER:-$HOME/.cache/pdserve/tokenizers/deepseek-v3}
LATENCIES=${LATENCIES:-"0.2 0.7 1.2 1.7 2.2"}
INPUT_TOKENS=${INPUT_TOKENS:-32}
OUTPUT_TOKENS=${OUTPUT_TOKENS:-64}
NUM_PROMPTS=${NUM_PROMPTS:-6}
THREADS=${THREADS:-1}
CPU_BW_GBS=${CPU_BW_GBS:-20}
CPU_TFLOPS=${CPU_TFLOPS:-0.1}
OUT=${OUT:-/tmp/pdserve-netlat}
UPDATE_DOCS=0
[[ "${1:-}" == "--update-docs" ]] && UPDATE_DOCS=1

[[ -x "$PDSERVE" ]] || { echo "netlat: no pdserve at $PDSERVE (set PDSERVE)" >&2; exit 2; }
[[ -f "$MODEL/config.json" ]] || { echo "netlat: no checkpoint at $MODEL (set MODEL)" >&2; exit 2; }
mkdir -p "$OUT"
VOCAB=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["vocab_size"])' "$MODEL/config.json")

UP_PID=""
stop_up() {
  if [[ -n "$UP_PID" ]] && kill -0 "$UP_PID" 2>/dev/null; then
    kill -TERM "$UP_PID"
    wait "$UP_PID" || true
  fi
  UP_PID=""
}
trap stop_up EXIT

# The planner's view of this setup: TP 2 over 2 single-GPU "nodes" (every collective crosses the
# network), this CPU's bandwidth and FLOP/s instead of a GPU's.
PLAN_FLAGS=(--model "$MODEL" --decode-tp 2 --nodes 2 --gpus-per-node 1 --concurrency 1
            --input-len "$INPUT_TOKENS" --output-len "$OUTPUT_TOKENS" --mtp-k 0
            --hbm-bandwidth-gbs "$CPU_BW_GBS" --bf16-tflops "$CPU_TFLOPS" --fp8-tflops "$CPU_TFLOPS")

for lat in $LATENCIES; do
  us=$(python3 -c "print(round($lat * 1000))")
  echo "netlat: injected latency $lat ms ($us us per message)" >&2
  "$PDSERVE" up --model "$MODEL" --model.tokenizer "$TOKENIZER" --port 0 --tp 2 --mtp 0 \
    --decode.tp_inject_latency_us "$us" --decode.threads "$THREADS" --prefill.threads "$THREADS" \
    --log.level warn > "$OUT/up-$lat.out" 2> "$OUT/up-$lat.err" &
  UP_PID=$!
  url=""
  for _ in $(seq 1 600); do
    url=$(sed -n 's/^PDSERVE_READY role=up url=\(.*\)$/\1/p' "$OUT/up-$lat.out" | head -1)
    [[ -n "$url" ]] && break
    kill -0 "$UP_PID" 2>/dev/null || { echo "netlat: pdserve up exited; see $OUT/up-$lat.err" >&2; exit 1; }
    sleep 0.2
  done
  [[ -n "$url" ]] || { echo "netlat: pdserve up not ready in 120 s" >&2; exit 1; }
  "$PDSERVE" bench serve --url "$url" --concurrency 1 --input-tokens "$INPUT_TOKENS" \
    --output-tokens "$OUTPUT_TOKENS" --num-prompts "$NUM_PROMPTS" --warmup 1 --token-id-min 1 \
    --token-id-max "$VOCAB" --net-latency-ms "$lat" --quiet --json "$OUT/bench-$lat.json" --markdown "$OUT/bench-$lat.md"
  stop_up
done

# One calibration input from the sweep, the fit, and the predictions at every latency.
python3 - "$OUT" "$MODEL" "$INPUT_TOKENS" "$OUTPUT_TOKENS" $LATENCIES > "$OUT/calibrate-input.json" <<'EOF'
import json, sys
out, model, inp, outp, lats = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5:]
levels = []
for lat in lats:
    rep = json.load(open(f"{out}/bench-{lat}.json"))
    lvl = rep["levels"][0]
    # Single stream: decode tokens/s of the one user (TPOT), not output / wall time (which
    # includes the TTFT).
    tps = lvl.get("output_tokens_per_s_per_user") or lvl["output_tokens_per_s"]
    levels.append({"concurrency": 1, "tokens_per_s": tps, "net_latency_ms": float(lat)})
print(json.dumps({"model": model, "tp": 2, "nodes": 2, "context": inp + outp // 2, "decode": levels}))
EOF
"$PDSERVE" plan --calibrate "$OUT/calibrate-input.json" "${PLAN_FLAGS[@]}" --json > "$OUT/calibrate.json"
read -r OVERHEAD HOPS < <(python3 -c 'import json,sys; h=json.load(open(sys.argv[1]))["hardware"]; print(h["net_collective_overhead_us"], h["net_latency_hops"])' "$OUT/calibrate.json")
for lat in $LATENCIES; do
  "$PDSERVE" plan "${PLAN_FLAGS[@]}" --net-latency-ms "$lat" --json > "$OUT/plan-default-$lat.json"
  "$PDSERVE" plan "${PLAN_FLAGS[@]}" --net-latency-ms "$lat" --net-collective-overhead-us "$OVERHEAD" \
    --net-latency-hops "$HOPS" --json > "$OUT/plan-fitted-$lat.json"
done

python3 - "$OUT" "$UPDATE_DOCS" "$ROOT" "$MODEL" "$INPUT_TOKENS" "$OUTPUT_TOKENS" "$NUM_PROMPTS" "$OVERHEAD" "$HOPS" $LATENCIES <<'EOF'
import json, os, sys, datetime
out, update, root, model = sys.argv[1], sys.argv[2] == "1", sys.argv[3], sys.argv[4]
inp, outp, nprompts, overhead, hops = sys.argv[5], sys.argv[6], sys.argv[7], float(sys.argv[8]), float(sys.argv[9])
lats = sys.argv[10:]
rows = []
for lat in lats:
    lvl = json.load(open(f"{out}/bench-{lat}.json"))["levels"][0]
    measured = lvl.get("output_tokens_per_s_per_user") or lvl["output_tokens_per_s"]
    d = json.load(open(f"{out}/plan-default-{lat}.json"))
    f = json.load(open(f"{out}/plan-fitted-{lat}.json"))
    rows.append({"latency_ms": float(lat), "measured_tokens_per_s": measured,
                 "predicted_default": d["decode_tokens_per_s_per_user"],
                 "predicted_fitted": f["decode_tokens_per_s_per_user"],
                 "step_time_fitted": f.get("step_time_ms")})
json.dump({"model": model, "net_collective_overhead_us": overhead, "net_latency_hops": hops, "points": rows},
          open(f"{out}/netlat.json", "w"), indent=1)

md = ["| injected latency (ms) | measured tok/s | predicted, default constants | predicted, fitted constants | fitted / measured |",
      "| --- | --- | --- | --- | --- |"]
for r in rows:
    md.append(f"| {r['latency_ms']:.1f} | {r['measured_tokens_per_s']:.1f} | {r['predicted_default']:.1f} | "
              f"{r['predicted_fitted']:.1f} | {r['predicted_fitted'] / r['measured_tokens_per_s']:.2f} |")
md.append("")
md.append(f"Fitted: `--net-collective-overhead-us {overhead:.1f} --net-latency-hops {hops:.3f}` "
          f"({os.path.basename(model)}, {inp} prompt / {outp} output tokens, {nprompts} requests per point, "
          f"{datetime.date.today().isoformat()}).")
table = "\n".join(md)
open(f"{out}/netlat.md", "w").write(table + "\n")

# SVG: tokens/s against injected latency; measured points, both predictions as lines.
W, H, L, R, T, B = 560, 340, 60, 20, 20, 50
xmax = max(r["latency_ms"] for r in rows) * 1.1
ymax = max(max(r["measured_tokens_per_s"], r["predicted_default"], r["predicted_fitted"]) for r in rows) * 1.1
X = lambda v: L + (W - L - R) * v / xmax
Y = lambda v: H - B - (H - T - B) * v / ymax
svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
       f'<rect width="{W}" height="{H}" fill="white"/>',
       f'<line x1="{L}" y1="{H-B}" x2="{W-R}" y2="{H-B}" stroke="black"/>',
       f'<line x1="{L}" y1="{T}" x2="{L}" y2="{H-B}" stroke="black"/>',
       f'<text x="{(L+W-R)/2}" y="{H-12}" text-anchor="middle">injected one-way latency per message (ms)</text>',
       f'<text x="14" y="{(T+H-B)/2}" transform="rotate(-90 14 {(T+H-B)/2})" text-anchor="middle">single-stream tokens/s</text>']
for i in range(6):
    xv, yv = xmax * i / 5, ymax * i / 5
    svg.append(f'<text x="{X(xv):.1f}" y="{H-B+16}" text-anchor="middle">{xv:.1f}</text>')
    svg.append(f'<text x="{L-6}" y="{Y(yv)+4:.1f}" text-anchor="end">{yv:.0f}</text>')
    svg.append(f'<line x1="{L}" y1="{Y(yv):.1f}" x2="{W-R}" y2="{Y(yv):.1f}" stroke="#ddd"/>')
for key, color, dash in (("predicted_default", "#888", "4 3"), ("predicted_fitted", "#1f77b4", "")):
    pts = " ".join(f"{X(r['latency_ms']):.1f},{Y(r[key]):.1f}" for r in rows)
    svg.append(f'<polyline points="{pts}" fill="none" stroke="{color}" stroke-width="2" stroke-dasharray="{dash}"/>')
for r in rows:
    svg.append(f'<circle cx="{X(r["latency_ms"]):.1f}" cy="{Y(r["measured_tokens_per_s"]):.1f}" r="4" fill="#d62728"/>')
legend = (("#d62728", "measured (bench serve, concurrency 1)"), ("#1f77b4", "pdserve plan, fitted constants"),
          ("#888", "pdserve plan, default constants"))
for i, (color, text) in enumerate(legend):
    y = T + 14 + 16 * i
    svg.append(f'<rect x="{W-R-250}" y="{y-9}" width="10" height="10" fill="{color}"/>')
    svg.append(f'<text x="{W-R-235}" y="{y}">{text}</text>')
svg.append("</svg>")
open(f"{out}/netlat.svg", "w").write("\n".join(svg) + "\n")

if update:
    doc_path = f"{root}/docs/planner.md"
    doc = open(doc_path).read()
    begin, end = "<!-- netlat:begin (tools/bench/netlat_experiment.sh --update-docs) -->", "<!-- netlat:end -->"
    i, j = doc.find(begin), doc.find(end)
    if i < 0 or j < 0:
        sys.exit("netlat: docs/planner.md has no netlat:begin/end markers")
    block = begin + "\n\n" + table + "\n\n![tokens/s against injected latency](netlat.svg)\n\n"
    open(doc_path, "w").write(doc[:i] + block + doc[j:])
    open(f"{root}/docs/netlat.svg", "w").write("\n".join(svg) + "\n")
print(table)
EOF
