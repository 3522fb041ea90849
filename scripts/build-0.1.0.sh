#!/usr/bin/env bash
# Builds the library of pg_meili_sync 0.1.0 for PostgreSQL 15, from commit 9d87247 (the last
# 0.1.0), for the upgrade test (tests/e2e/tests/upgrade.rs): target/pg_meili_sync-0.1.0/pg_meili_sync.so.
# Keeps one it built before, in the workspace or in the user's cache (keyed by the commit and the
# PostgreSQL 15 build, so that a fresh checkout on the same machine skips a 3-minute build). It
# builds in a target directory of its own: in the workspace's, the old library would be where
# cargo pgrx install reads the new one's SQL from.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/pg-config.sh
commit=9d872474b2b367ae45f182fa787e3283f73b6c4b
out="$PWD/target/pg_meili_sync-0.1.0"
[ -f "$out/pg_meili_sync.so" ] && exit 0
pg_build=$("$(pg_config_of 15)" --version | tr -c 'A-Za-z0-9.\n' '_')
cached="${XDG_CACHE_HOME:-$HOME/.cache}/pg_meili_sync/pg_meili_sync-0.1.0-${commit:0:12}-$pg_build.so"
mkdir -p "$out"
if [ -f "$cached" ]; then
    cp "$cached" "$out/pg_meili_sync.so.tmp"
    mv "$out/pg_meili_sync.so.tmp" "$out/pg_meili_sync.so"
    exit 0
fi
rm -rf "$out/source" "$out/target"
mkdir -p "$out/source"
# A shallow clone lacks the commit: fetch the history first.
git cat-file -e "$commit^{commit}" 2>/dev/null || git fetch --quiet --unshallow
git archive "$commit" | tar -x -C "$out/source"
# Without link-time optimisation: only the upgrade test loads this library.
(cd "$out/source" && CARGO_TARGET_DIR="$out/target" CARGO_PROFILE_RELEASE_LTO=false cargo build --release --lib \
    --no-default-features --features pg15)
cp "$out/target/release/libpg_meili_sync.so" "$out/pg_meili_sync.so.tmp"
mv "$out/pg_meili_sync.so.tmp" "$out/pg_meili_sync.so"
rm -rf "$out/source" "$out/target"
mkdir -p "$(dirname "$cached")"
cp "$out/pg_meili_sync.so" "$cached.tmp"
mv "$cached.tmp" "$cached"
