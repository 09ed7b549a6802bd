#!/usr/bin/env bash
# Packs what scripts/gpu-check.sh needs to run on a bare GPU machine that cannot build pdserve (the
# lent device machines: CUDA, CMake and Python, but none of Debian 12's Boost 1.81, UCX, yaml-cpp,
# fmt or gtest, and no network): the gpu-labelled test binaries and pdserve from a CUDA build
# here, stripped, with the shared libraries they load that such a machine lacks, the test list
# (commands, working folders, skip codes, time limits as ctest has them) and the build's absolute
# source folder. The host tests of the kernels' arithmetic are left out: they are the same x86
# code that CI runs. libcrypto.so.3 is left out too (OpenSSL 3, which the machine's Python links). The embedded default model's
# weights are zeroed in the packed copies (15 MB that do not compress; the check never loads the
# default model, and a binary that tried would fail its sha256 check). CUDA's own libraries
# (cudart, cuBLAS, NCCL) are not packed: gpu-check finds the device machine's.
#
# usage: scripts/gpu-bundle.sh [OUT_DIR]     (default build-bundle; writes OUT_DIR/gpu-bundle.tar.xz)
#   PD_BUILD_DIR   the CUDA build to pack (default build); its gpu targets are built first
# Then, on the device machine (carry OUT_DIR): PD_GPU_BUNDLE=OUT_DIR/gpu-bundle.tar.xz scripts/gpu-check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir=${PD_BUILD_DIR:-build}
out_dir=${1:-build-bundle}
if [[ ! -f "$build_dir/CMakeCache.txt" ]] || ! grep -q '^PD_WITH_CUDA:BOOL=ON' "$build_dir/CMakeCache.txt"; then
  echo "gpu-bundle: $build_dir is not a CUDA build (configure with -DPD_WITH_CUDA=ON and nvcc present)" >&2
  exit 1
fi
targets=(test_kernel_parity test_device_weights test_device_decode test_cuda_engine test_cuda_tp test_up_device test_cuda_handles
  test_staging_device test_nccl_device pdserve)
cmake --build "$build_dir" -j "${PD_JOBS:-$(nproc)}" --target "${targets[@]}"

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/lib/ucx" "$out_dir"
abs_build=$(cd "$build_dir" && pwd -P)
abs_src=$(pwd -P)
printf '%s\n%s\n' "$abs_src" "$abs_build" >"$stage/origin"

# The test lists: NAME<TAB>WORKING_DIR<TAB>SKIP_RETURN_CODE<TAB>TIMEOUT<TAB>COMMAND (shell-quoted).
list_tests() {  # list_tests OUT_FILE CTEST_ARGS...
  local file=$1
  shift
  ctest --test-dir "$build_dir" "$@" --show-only=json-v1 | python3 -c '
import json, shlex, sys
for t in json.load(sys.stdin)["tests"]:
    props = {p["name"]: p["value"] for p in t.get("properties", [])}
    print("\t".join([t["name"], props.get("WORKING_DIRECTORY", "."), str(props.get("SKIP_RETURN_CODE", "-")),
                     str(int(props.get("TIMEOUT", 280))), shlex.join(t["command"])]))
' >"$file"
}
list_tests "$stage/gpu-tests.tsv" -L gpu
echo "gpu-bundle: $(wc -l <"$stage/gpu-tests.tsv") gpu tests"

# Every binary the lists run, and pdserve, at their paths under the build folder.
mapfile -t binaries < <(cut -f5 "$stage/gpu-tests.tsv" |
  python3 -c 'import shlex, sys; print("\n".join(sorted({shlex.split(l)[0] for l in sys.stdin if l.strip()})))')
binaries+=("$abs_build/tools/pdserve")
for bin in "${binaries[@]}"; do
  rel=${bin#"$abs_build"/}
  if [[ "$rel" == "$bin" || ! -x "$bin" ]]; then
    echo "gpu-bundle: $bin is not an executable under $abs_build" >&2
    exit 1
  fi
  mkdir -p "$stage/build/$(dirname "$rel")"
  strip -o "$stage/build/$rel" "$bin"
  # Zero the embedded default model's weights in the copy (same size: the layout is unchanged).
  python3 - "$bin" "$stage/build/$rel" <<'EOF'
import subprocess, sys
src, dst = sys.argv[1], sys.argv[2]
syms = {}
for line in subprocess.run(["nm", src], capture_output=True, text=True).stdout.splitlines():
    parts = line.split()
    if len(parts) == 3 and parts[2] in ("pd_default_model_safetensors", "pd_default_model_safetensors_end"):
        syms[parts[2]] = int(parts[0], 16)
if len(syms) != 2:
    sys.exit(0)  # this binary does not embed the default model
begin, end = syms["pd_default_model_safetensors"], syms["pd_default_model_safetensors_end"]
out = subprocess.run(["readelf", "-SW", dst], capture_output=True, text=True).stdout
for line in out.splitlines():
    f = line.replace("[ ", "[").split()
    if len(f) > 6 and f[0].startswith("[") and f[0] != "[Nr]":
        addr, off, size = int(f[3], 16), int(f[4], 16), int(f[5], 16)
        if f[2] != "NOBITS" and addr <= begin and end <= addr + size:
            with open(dst, "r+b") as fh:
                fh.seek(off + begin - addr)
                fh.write(bytes(end - begin))
            sys.exit(0)
sys.exit("gpu-bundle: the embedded model of %s lies in no section of its copy" % src)
EOF
done

# The shared libraries the binaries load, except the C/C++ runtime and CUDA's (the device's own).
skip='^(linux-vdso|ld-linux|libc\.|libm\.|libstdc\+\+|libgcc_s|libpthread|libdl|librt|libcudart|libcublas|libnccl|libcuda\.|libcrypto\.so\.3)'
for bin in "${binaries[@]}"; do
  ldd "$bin" | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}' | while read -r name path; do
    if [[ ! "$name" =~ $skip && ! -e "$stage/lib/$name" ]]; then cp -L "$path" "$stage/lib/$name"; fi
  done
done
# UCX's transport modules it loads at run time (cma: shared memory between processes).
module=/usr/lib/x86_64-linux-gnu/ucx/libuct_cma.so.0
if [[ -e "$module" ]]; then cp -L "$module" "$stage/lib/ucx/"; fi

tar -C "$stage" -cf - . | xz -T0 -6 >"$out_dir/gpu-bundle.tar.xz"
bundle_bytes=$(stat -c %s "$out_dir/gpu-bundle.tar.xz")
tree_bytes=$(git ls-files -z | xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')
limit=$((64 * 1024 * 1024))
echo "gpu-bundle: $out_dir/gpu-bundle.tar.xz: $((bundle_bytes / 1024)) KiB; the tracked tree is $((tree_bytes / 1024)) KiB;" \
  "together $(((bundle_bytes + tree_bytes) * 100 / limit)) % of the device tool's 64 MiB"
if ((bundle_bytes + tree_bytes > limit)); then
  echo "gpu-bundle: too large to travel with the tree" >&2
  exit 1
fi
