#!/usr/bin/env bash
# The device check for the first machine with a GPU (docs/gpu.md): configures and builds the CUDA
# backend on every core, runs the `gpu`-labelled tests (each CUDA kernel against the CPU engine,
# the golden checkpoints uploaded and read back, the device decode step and the CUDA engine behind
# the Engine seam against the CPU engine) and the host tests of the kernels' arithmetic,
# `pdserve generate --model.device cuda` on the golden checkpoints (tokens equal to the CPU's), then `pdserve bench engine --device cuda --json` (the HBM, GEMM and MLA attention ceilings, and
# the upload of a make-model checkpoint of real DeepSeek-V3 layer sizes), and prints one summary.
# Every log lands in one folder. Fails loudly (exit 1) when no GPU is visible, when anything fails, and when any `gpu`
# test reports Skipped: a skip here means the check did not happen, never that it passed.
# Sized to finish well under 8 minutes on a 16-core H200 machine (it builds only the targets the
# tests need; each step has a time limit).
#
# usage: scripts/gpu-check.sh [LOG_DIR]
#   LOG_DIR                 default gpu-check-<UTC time>
#   PD_GPU_BUNDLE           a scripts/gpu-bundle.sh tarball: use its prebuilt binaries instead of
#                           building (a machine without pdserve's build dependencies, such as the
#                           lent device machines; docs/gpu.md, "The device check")
#   PD_GPU_BUILD_DIR        build folder (default build-gpu)
#   CMAKE_CUDA_ARCHITECTURES  default 90 (H100/H200)
#   PD_GPU_TEST_TIMEOUT     with PD_GPU_BUNDLE: each gpu test's time limit in seconds, when lower than
#                           ctest's (a short device lease: a hung test costs this, not 280 s)
#   PD_GPU_CHECK_LAYERS     decoder layers of the bench checkpoint (default 1: one dense layer plus
#                           the MTP layer, which is MoE with 256 experts: about 16 GB in FP8)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1

log_dir=${1:-gpu-check-$(date -u +%Y%m%dT%H%M%SZ)}
build_dir=${PD_GPU_BUILD_DIR:-build-gpu}
arch=${CMAKE_CUDA_ARCHITECTURES:-90}
jobs=$(nproc)
mkdir -p "$log_dir"
summary="$log_dir/summary.txt"
: >"$summary"
start=$SECONDS

say() { echo "$*" | tee -a "$summary"; }
fail() {
  say "gpu-check: FAIL: $*"
  say "gpu-check: logs in $log_dir"
  exit 1
}
step() {  # step NAME LIMIT_S COMMAND...: runs COMMAND with a time limit, output to LOG_DIR/NAME.log
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" >"$log_dir/$name.log" 2>&1
  local rc=$?
  say "gpu-check: $name: exit $rc in $((SECONDS - t0)) s (log $log_dir/$name.log)"
  return $rc
}

say "gpu-check: $(git rev-parse --short HEAD 2>/dev/null || echo '?') on $(hostname), $jobs cores, $(date -u +%FT%TZ)"

# 1. A GPU must be visible, or this check cannot happen.
if ! command -v nvidia-smi >/dev/null 2>&1; then fail "nvidia-smi not found: no NVIDIA driver on this machine"; fi
if ! nvidia-smi -L >"$log_dir/nvidia-smi.log" 2>&1 || ! grep -q '^GPU ' "$log_dir/nvidia-smi.log"; then
  cat "$log_dir/nvidia-smi.log"
  fail "no GPU visible (nvidia-smi -L lists none)"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >>"$log_dir/nvidia-smi.log" 2>&1
say "gpu-check: GPUs: $(grep -c '^GPU ' "$log_dir/nvidia-smi.log"): $(grep '^GPU 0' "$log_dir/nvidia-smi.log")"

# Runs a gpu-bundle.sh test list (NAME WORKING_DIR SKIP_CODE TIMEOUT COMMAND, tab-separated) as
# ctest would, printing ctest's result lines (and the output of every test that did not pass).
run_test_list() {
  local list=$1 n=0 total name dir skip_code limit cmd rc status t0 out
  total=$(wc -l <"$list")
  while IFS=$'\t' read -r name dir skip_code limit cmd; do
    n=$((n + 1))
    t0=$SECONDS
    out="$log_dir/test-$n.log"
    if [[ -n "${PD_GPU_TEST_TIMEOUT:-}" ]] && ((limit > PD_GPU_TEST_TIMEOUT)); then limit=$PD_GPU_TEST_TIMEOUT; fi
    (cd "$dir" && timeout --kill-after=10 "$limit" bash -c "$cmd") </dev/null >"$out" 2>&1
    rc=$?
    if [[ "$rc" == "$skip_code" ]] || grep -q '^\[  SKIPPED \]' "$out"; then
      status='***Skipped'
    elif ((rc == 0)); then
      status='Passed'
    else
      status="***Failed (exit $rc)"
    fi
    printf '%d/%d Test #%d: %s ... %s %d sec\n' "$n" "$total" "$n" "$name" "$status" $((SECONDS - t0))
    if [[ "$status" != Passed ]]; then cat "$out"; fi
  done <"$list"
}

if [[ -n "${PD_GPU_BUNDLE:-}" ]]; then
  # 2'. Prebuilt binaries (scripts/gpu-bundle.sh). They hold the absolute paths of the machine that
  # built them (the test data under its checkout, pdserve under its build folder): those paths are
  # made to lead here, to this checkout and to the unpacked build folder.
  bundle_root=${PD_GPU_BUNDLE_DIR:-/tmp/pd-gpu-bundle}
  rm -rf "$bundle_root" && mkdir -p "$bundle_root" || fail "cannot make $bundle_root"
  tar -C "$bundle_root" -xJf "$PD_GPU_BUNDLE" || fail "cannot unpack $PD_GPU_BUNDLE"
  origin_src=$(sed -n 1p "$bundle_root/origin")
  origin_build=$(sed -n 2p "$bundle_root/origin")
  here=$(pwd -P)
  if [[ "$origin_src" != "$here" ]]; then
    if [[ -e "$origin_src" ]]; then fail "the bundle's source folder $origin_src exists here and is not this checkout"; fi
    mkdir -p "$(dirname "$origin_src")" && ln -s "$here" "$origin_src" || fail "cannot link $origin_src to $here"
  fi
  if [[ ! -e "$origin_build" ]]; then
    mkdir -p "$(dirname "$origin_build")" && ln -s "$bundle_root/build" "$origin_build" ||
      fail "cannot link $origin_build to the bundle"
  fi
  if [[ "$(cd "$origin_build" && pwd -P)" != "$(cd "$bundle_root/build" && pwd -P)" ]]; then
    fail "$origin_build (the bundle's build folder) exists here and is not the bundle"
  fi
  build_dir=$origin_build
  # CUDA's libraries and OpenSSL's libcrypto are the machine's: the system's, CUDA's folders, or the
  # NVIDIA wheels of its Python.
  lib_dirs="$bundle_root/lib"
  search=(/usr/local/cuda/lib64 /usr/local/cuda/lib /usr/local/cuda/targets/x86_64-linux/lib)
  while read -r site; do search+=("$site"/nvidia/*/lib); done < <(python3 -c \
    'import site; print("\n".join(site.getsitepackages()))' 2>/dev/null)
  for lib in libcudart.so.13 libcublas.so.13 libcublasLt.so.13 libnccl.so.2 libcrypto.so.3; do
    if ldconfig -p 2>/dev/null | grep -qE "(^|[[:space:]])$lib[[:space:]]"; then continue; fi
    for dir in "${search[@]}"; do
      if [[ -e "$dir/$lib" ]]; then
        lib_dirs="$lib_dirs:$dir"
        break
      fi
    done
  done
  export LD_LIBRARY_PATH="$lib_dirs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export UCX_MODULE_DIR="$bundle_root/lib/ucx"
  missing=$(ldd "$build_dir/tools/pdserve" "$build_dir/tests/gpu/test_cuda_engine" 2>&1 | grep 'not found' | sort -u)
  if [[ -n "$missing" ]]; then fail "libraries not found on this machine: $(echo "$missing" | tr -s ' \n' ' ')"; fi
  say "gpu-check: prebuilt binaries of $PD_GPU_BUNDLE (built in $origin_build); libraries from $lib_dirs"
  say "gpu-check: host tests of the kernels' arithmetic: not in the bundle (CI runs the same x86 code)"
  gpu_log="$log_dir/gpu-tests.log"
  t0=$SECONDS
  run_test_list "$bundle_root/gpu-tests.tsv" >"$gpu_log" 2>&1
  gpu_rc=$?
  say "gpu-check: gpu-tests: exit $gpu_rc in $((SECONDS - t0)) s (log $gpu_log)"
else
  # 2. Configure and build (only what the tests need).
  launcher=()
  if command -v ccache >/dev/null 2>&1; then
    launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
  fi
  step configure 180 cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DPD_WITH_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES="$arch" "${launcher[@]}" || fail "configure (is nvcc on PATH or CUDACXX set?)"
  targets=(test_kernel_parity test_device_weights test_device_decode test_cuda_engine test_cuda_tp test_up_device test_gpu test_device_math
    test_device_memory_plan test_model_device test_weight_upload_plan test_device_bench test_cuda_handles
    test_decode_step_plan test_forward_plan test_weight_shard test_staging_device test_nccl_device pdserve)
  step build 360 cmake --build "$build_dir" -j "$jobs" --target "${targets[@]}" || fail "build"

  # 3. The host tests of the kernels' arithmetic, then every gpu-labelled test.
  host_tests='^(DeviceMath|DeviceMemoryPlan|ModelDevice|WeightUploadPlan|DeviceBench|DecodeStepPlan|DecodeGraphs|ForwardPlan|WeightShard)\.'
  step host-tests 60 ctest --test-dir "$build_dir" -L unit -R "$host_tests" --output-on-failure ||
    fail "host tests of the kernels' arithmetic"
  step gpu-tests 300 ctest --test-dir "$build_dir" -L gpu --output-on-failure --timeout 280
  gpu_rc=$?
  gpu_log="$log_dir/gpu-tests.log"
fi
ran=$(grep -cE 'Test +#[0-9]+: ' "$gpu_log")
passed=$(grep -cE 'Test +#[0-9]+: .* Passed' "$gpu_log")
skipped=$(grep -cE 'Test +#[0-9]+: .*\*\*\*Skipped' "$gpu_log")
failed=$((ran - passed - skipped))
say "gpu-check: gpu tests: $ran ran, $passed passed, $failed failed, $skipped skipped"
grep -E 'Test +#[0-9]+: ' "$gpu_log" | sed 's/^/  /' | tee -a "$summary"
grep -E 'SKIPPED: ' "$gpu_log" | sort -u | sed 's/^/  /' | tee -a "$summary"

# The decode step's deviation from the CPU engine in the fp32 and bf16 numerics modes
# (informational, for the note and docs/gpu.md "Numerics modes").
"$build_dir/tests/gpu/test_device_decode" --gtest_filter='DeviceDecode.Tiny*' 2>&1 | grep -E ' mode: [0-9]+ steps' |
  sed 's/^/  /' | tee -a "$summary"

# The device's memory and the fit error a user would see (informational, for the note).
"$build_dir/tests/gpu/test_kernel_parity" --gtest_filter='Kernel.MemoryPlan*' 2>&1 |
  grep -E '^(device memory|cuda:0: )' | sed 's/^/  /' | tee -a "$summary"

# The CUDA engine from the command line: greedy generation on the golden checkpoints, the same
# tokens as the CPU engine's (the golden prompt p0 of tiny-bf16; 24 tokens, with and without MTP).
prompt=618,1600,791,1241,955,1454,705,184,603,1292,1272,2008,497,868,1938,231,1435,1962,1878,1385,1827,405,1550
prompt=$prompt,1377,1038,2033,1730,430,2008,1748,765,1431,1602,455,537,380,950,1954,800,698
generate_rc=0
for model in tiny-bf16 tiny-fp8; do
  for mtp in 0 2; do
    args=(generate --model "tests/data/golden/$model" --prompt-ids "$prompt" --max-tokens 24 --mtp "$mtp")
    step "generate-$model-mtp$mtp-cpu" 120 "$build_dir/tools/pdserve" "${args[@]}" --model.device cpu
    step "generate-$model-mtp$mtp-cuda" 120 "$build_dir/tools/pdserve" "${args[@]}" --model.device cuda || generate_rc=1
    want=$(grep -E '^\{' "$log_dir/generate-$model-mtp$mtp-cpu.log")
    got=$(grep -E '^\{' "$log_dir/generate-$model-mtp$mtp-cuda.log")
    if [[ -z "$want" || "$want" != "$got" ]]; then
      generate_rc=1
      say "gpu-check: generate $model --mtp $mtp: cuda printed '$got', cpu '$want'"
    else
      say "gpu-check: generate $model --mtp $mtp: cuda = cpu: $got"
    fi
  done
done

# An FP8 KV cache (decode.kv_dtype fp8) from the command line, cuda against cpu (informational: the
# gate is gpu.CudaEngine.AnFp8HostCache; an e4m3 rounding the two engines' last float bits put on
# different sides can change a random-weight model's later tokens).
for mtp in 0 2; do
  args=(generate --model tests/data/golden/tiny-bf16 --prompt-ids "$prompt" --max-tokens 24 --mtp "$mtp" --kv_dtype fp8)
  step "generate-kv-fp8-mtp$mtp-cpu" 120 "$build_dir/tools/pdserve" "${args[@]}" --model.device cpu || true
  step "generate-kv-fp8-mtp$mtp-cuda" 120 "$build_dir/tools/pdserve" "${args[@]}" --model.device cuda || true
  say "gpu-check: generate tiny-bf16 --kv_dtype fp8 --mtp $mtp: cuda $(grep -E '^\{' "$log_dir/generate-kv-fp8-mtp$mtp-cuda.log"), cpu $(grep -E '^\{' "$log_dir/generate-kv-fp8-mtp$mtp-cpu.log")"
done

# The bf16 mode from the command line (informational: its tokens may differ from the fp32 ones).
step generate-tiny-bf16-numerics-bf16 120 "$build_dir/tools/pdserve" generate --model tests/data/golden/tiny-bf16 \
  --prompt-ids "$prompt" --max-tokens 24 --model.device cuda --model.numerics bf16 || true
say "gpu-check: generate tiny-bf16 --model.numerics bf16: $(grep -E '^\{' "$log_dir/generate-tiny-bf16-numerics-bf16.log")"

# 4. The benchmark: ceilings measured in the same run, then the upload (once) and decode at batches
# 1..64 (MBU per batch) of a checkpoint of real DeepSeek-V3 layer sizes in FP8 (written by
# make-model into the log folder, removed afterwards).
layers=${PD_GPU_CHECK_LAYERS:-1}
bench_model="$log_dir/dsv3-layers-$layers-fp8"
bench_rc=1
if step make-model 240 "$build_dir/tools/pdserve" make-model "$bench_model" --preset "deepseek-v3-layers=$layers" --fp8; then
  step bench-engine 240 "$build_dir/tools/pdserve" bench engine --device cuda --model "$bench_model" --json
  bench_rc=$?
  grep -E '^\{' "$log_dir/bench-engine.log" >"$log_dir/bench-engine.json"
  say "gpu-check: bench engine --device cuda --json:"
  sed 's/^/  /' "$log_dir/bench-engine.json" | tee -a "$summary"
fi

# 5. Serving on the GPU (PD_GPU_CHECK_SERVE=0 skips it): `pdserve up --device cuda` on the same
# checkpoint (one prefill and one decode worker sharing the GPU, a pool of 2048 blocks), then
# `pdserve bench serve` at concurrency 1..64 with the workers' /metrics (TTFT, TPOT, and the prefill
# workers' compute and KV transfer time per prompt), then `pdserve plan --calibrate` on that file
# with the measured ceilings of step 4 (the planner's model of this checkpoint on an H200 against
# the measurement). The checkpoint has no tokenizer: the embedded model's renders ids, and the
# prompts stay below its 4096 ids.
serve_rc=0
if [[ ${PD_GPU_CHECK_SERVE:-1} != 0 && -f "$bench_model/config.json" ]]; then
  serve_rc=1
  up_log="$log_dir/up-cuda.log"
  timeout --kill-after=10 420 "$build_dir/tools/pdserve" up --device "${PD_GPU_CHECK_SERVE_DEVICE:-cuda}" \
    --model.path "$bench_model" \
    --model.tokenizer models/tiny-dsv3 --router.port 0 --decode.num_blocks 2048 --log.level warn >"$up_log" 2>&1 &
  up_pid=$!
  for _ in $(seq 1 240); do
    grep -q '^PDSERVE_READY' "$up_log" 2>/dev/null && break
    kill -0 "$up_pid" 2>/dev/null || break
    sleep 1
  done
  url=$(sed -n 's/^PDSERVE_READY .*url=//p' "$up_log")
  pages=$(sed -n 's/^PDSERVE_CHILD name=\(prefill\|decode\)-[0-9]* .*url=/\1 /p' "$up_log" | awk '{print $2}' | paste -sd, -)
  if [[ -n "$url" && -n "$pages" ]]; then
    say "gpu-check: up --device cuda ready at $url (workers' pages $pages)"
    if step bench-serve 300 "$build_dir/tools/pdserve" bench serve --url "$url" --metrics_url "$pages" \
      --concurrency 1,4,16,64 --input_tokens 256 --output_tokens 32 --token_id_max 4096 --quiet \
      --json "$log_dir/bench-serve.json"; then
      serve_rc=0
      sed -n '/^| concurrency/,/^$/p' "$log_dir/bench-serve.log" | tee -a "$summary"
      # The calibration input: the serve levels plus the measured ceilings (bench-engine.json).
      if python3 - "$log_dir/bench-serve.json" "$log_dir/bench-engine.json" "$log_dir/calibrate-input.json" <<'PY'
import json, sys
serve = json.load(open(sys.argv[1]))
try:
    engine = json.load(open(sys.argv[2]))
except (OSError, ValueError):
    engine = {}
for key in ("read_bandwidth_gbs", "gemm_bf16_tflops"):
    if engine.get(key):
        serve[key] = engine[key]
serve["hardware"] = "h200"
serve["note"] = "gpu-check: pdserve up --device cuda on one GPU, a make-model checkpoint"
json.dump(serve, open(sys.argv[3], "w"))
PY
      then
        step plan-calibrate 60 "$build_dir/tools/pdserve" plan --calibrate "$log_dir/calibrate-input.json" \
          --model "$bench_model" --decode-tp 1 --nodes 1 --input-len 256 --output-len 32 || serve_rc=1
        sed 's/^/  /' "$log_dir/plan-calibrate.log" | tee -a "$summary"
      fi
    fi
  else
    say "gpu-check: up --device cuda did not become ready (log $up_log):"
    tail -20 "$up_log" | sed 's/^/  /' | tee -a "$summary"
  fi
  kill -TERM "$up_pid" 2>/dev/null
  wait "$up_pid" 2>/dev/null
  mkdir -p "$log_dir/checkpoint" && cp "$bench_model/config.json" "$log_dir/checkpoint/" 2>/dev/null
fi
rm -rf "$bench_model"

elapsed=$((SECONDS - start))
if ((ran < 53)); then
  fail "only $ran gpu tests ran (expected at least 53: the CUDA handles and graphs, one per kernel, the memory plan, bad shapes, device weights, device decode and its graphs, cuda engine, tensor parallelism, up --device cuda, staging, one-rank NCCL)"
fi
if ((skipped > 0)); then fail "$skipped gpu tests skipped: the device was not usable by the tests"; fi
if ((gpu_rc != 0 || failed > 0)); then fail "$failed gpu tests failed (details in $gpu_log)"; fi
if ((generate_rc != 0)); then fail "pdserve generate --model.device cuda (logs generate-*.log)"; fi
if ((bench_rc != 0)); then fail "bench engine --device cuda (details in $log_dir/make-model.log, bench-engine.log)"; fi
if ((serve_rc != 0)); then fail "up --device cuda + bench serve + plan --calibrate (details in $log_dir/up-cuda.log, bench-serve.log, plan-calibrate.log)"; fi
say "gpu-check: PASS in $elapsed s; logs in $log_dir"
