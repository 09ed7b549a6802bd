#!/usr/bin/env bash
# Fetches the official OpenAI Node SDK (npm package openai@6.30.1, pinned: the newest release
# without a Node >= 22 requirement; it has no dependencies) into DEST (default:
# ~/.cache/pdserve/node/openai-6.30.1) and checks the tarball's sha256, so that
# tests/e2e/openai_sdk.mjs can import DEST/node_modules/openai. Idempotent: a verified copy is kept.
set -euo pipefail

version=6.30.1
sha256=175f3e017a9bc14d36dc0f57d2596ee1c7134d7fa181b7d83b2716f69076b03e
dest=${1:-${PDSERVE_CACHE_DIR:-$HOME/.cache/pdserve}/node/openai-$version}
tarball="$dest/openai-$version.tgz"
marker="$dest/node_modules/openai/.pdserve-verified"

if [[ -f "$tarball" && -f "$marker" && $(cat "$marker") == "$sha256" ]] &&
  [[ $(sha256sum "$tarball" | cut -d' ' -f1) == "$sha256" ]]; then
  echo "fetch-openai-sdk: $dest is present and verified"
  exit 0
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$work" && npm pack --silent "openai@$version" >/dev/null)
got=$(sha256sum "$work/openai-$version.tgz" | cut -d' ' -f1)
if [[ $got != "$sha256" ]]; then
  echo "fetch-openai-sdk: sha256 mismatch for openai@$version: got $got, want $sha256" >&2
  exit 1
fi
mkdir -p "$dest/node_modules"
extract=$(mktemp -d "$dest/.extract.XXXXXX")
trap 'rm -rf "$work" "$extract"' EXIT
tar -xzf "$work/openai-$version.tgz" -C "$extract"
echo "$sha256" >"$extract/package/.pdserve-verified"
# Swap the verified copy in by renames on one file system (the marker comes with it).
rm -rf "$dest/node_modules/openai.old"
if [[ -d "$dest/node_modules/openai" ]]; then mv "$dest/node_modules/openai" "$dest/node_modules/openai.old"; fi
mv "$extract/package" "$dest/node_modules/openai"
rm -rf "$dest/node_modules/openai.old"
cp "$work/openai-$version.tgz" "$tarball.tmp" && mv "$tarball.tmp" "$tarball"
echo "fetch-openai-sdk: openai@$version -> $dest (sha256 verified)"
