#!/usr/bin/env bash
# Encode throughput (MB/s of UTF-8 text, one thread) of pd::tokenizer and of the reference,
# npm tokenizers@0.23.2 (Hugging Face's Rust library), on the same mixed corpus in the same run,
# and their ratio. Both runs print a checksum of all ids; the script fails if they differ.
#
#   tools/bench/tokenizer_bench.sh [BUILD_DIR]       (default: build; needs target pd_tokenizer_bench)
#
# Environment: PD_TOKENIZER_DIR (default ~/.cache/pdserve/tokenizers/deepseek-v3, see
# scripts/fetch-tokenizer.sh), PD_TOKBENCH_DIR (scratch folder for the npm install and the corpus,
# default /tmp/pd-tokbench; never inside the repository), PASSES (timed passes, best one counts; 5).
set -euo pipefail

root=$(cd "$(dirname "$0")/../.." && pwd)
build=${1:-$root/build}
tokenizer=${PD_TOKENIZER_DIR:-$HOME/.cache/pdserve/tokenizers/deepseek-v3}
scratch=${PD_TOKBENCH_DIR:-/tmp/pd-tokbench}
passes=${PASSES:-5}
bench=$build/tools/pd_tokenizer_bench

[[ -x $bench ]] || { echo "tokenizer_bench: build $bench first (ninja -C $build pd_tokenizer_bench)" >&2; exit 1; }
[[ -f $tokenizer/tokenizer.json ]] || { echo "tokenizer_bench: no $tokenizer/tokenizer.json: run scripts/fetch-tokenizer.sh" >&2; exit 1; }
mkdir -p "$scratch"
if [[ ! -f $scratch/node_modules/tokenizers/package.json ]]; then
  (cd "$scratch" && npm install --silent --no-audit --no-fund --no-save tokenizers@0.23.2)
fi

"$bench" write-corpus --golden "$root/tests/data/golden/tokenizer/cases.jsonl" --prose /usr/share/common-licenses \
  --sources "$root/common" "$root/tools" "$root/docs" --tokenizer "$tokenizer" --out "$scratch/corpus.jsonl"
ours=$("$bench" run --tokenizer "$tokenizer" --corpus "$scratch/corpus.jsonl" --passes "$passes")
reference=$(RAYON_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false \
  node "$root/tools/bench/tokenizer_reference.mjs" "$scratch/node_modules" "$tokenizer" "$scratch/corpus.jsonl" "$passes")
echo "$ours"
echo "$reference"

ours_sum=$(sed -E 's/.*checksum ([0-9]+).*/\1/' <<<"$ours")
ref_sum=$(sed -E 's/.*checksum ([0-9]+).*/\1/' <<<"$reference")
if [[ $ours_sum != "$ref_sum" ]]; then
  echo "tokenizer_bench: the ids differ from the reference (checksum $ours_sum vs $ref_sum)" >&2
  exit 1
fi
echo "ratio pdserve / reference (same ids: checksums match):"
# "category X MB/s;" fields of both lines, joined by category.
rates() { sed -E 's/ \(.*//; s/^[^:]*: ([0-9.]+) MB\/s total;/total \1;/' <<<"$1" | grep -oE '[a-z-]+ [0-9.]+' | sort; }
join <(rates "$ours") <(rates "$reference") |
  awk '{ printf "  %-13s %8.2f MB/s  vs %8.2f MB/s  = %5.2fx\n", $1, $2, $3, $2 / $3 }'
