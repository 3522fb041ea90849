#!/usr/bin/env bash
# Sweeps the batching knobs with the backfill load and prints one line per setting: docs/s, the
# ceiling measured in the same run (the same documents, all enqueued at once), the worker's CPU
# per 100k documents, and how many batches Meilisearch made of the copy. The defaults in the README
# come from this table. Against a real Meilisearch when one is found (MEILI_BIN,
# or `meilisearch` on PATH; each run starts its own), else the test
# server; MEILI_URL/MEILI_MASTER_KEY pick a running one. Needs the extension installed
# (scripts/install.sh).
#   bash scripts/bench-sweep.sh [rows]      (default 100000)
set -euo pipefail
cd "$(dirname "$0")/.."
rows=${1:-100000}
cargo build --release -q -p pg_meili_sync_load
if [ -z "${MEILI_URL:-}" ]; then
    if [ -z "${MEILI_BIN:-}" ] && command -v meilisearch > /dev/null; then
        MEILI_BIN=$(command -v meilisearch)
    fi
    if [ -n "${MEILI_BIN:-}" ]; then
        export MEILI_BIN E2E_MEILI=real
        echo "against a real Meilisearch: $MEILI_BIN"
    fi
fi
printf '%-10s %-9s %-5s %-6s %10s %10s %6s %12s %8s\n' batch_size in_flight gzip depth docs/s ceiling ratio 'CPU s/100k' batches
# batch_size in_flight gzip snapshot_depth
for setting in "10000 8 0 32" "5000 8 0 32" "20000 8 0 32" "10000 4 0 32" "10000 16 0 32" "10000 8 1 32" "10000 8 0 8" "10000 8 0 64"; do
    read -r batch inflight gzip depth <<<"$setting"
    out=$(target/release/load backfill "$rows" "$batch" "$inflight" "$gzip" "$depth")
    rate=$(awk '/^docs\/s/ {print $2}' <<<"$out")
    ceiling=$(awk '/^ceiling +[0-9]/ {print $2}' <<<"$out")
    ratio=$(awk '/^backfill\/ceiling/ {print $2}' <<<"$out")
    cpu=$(sed -n 's/.*(\([0-9.]*\) per 100k docs).*/\1/p' <<<"$out")
    batches=$(awk '/^meilisearch / {print $2}' <<<"$out")
    printf '%-10s %-9s %-5s %-6s %10s %10s %6s %12s %8s\n' "$batch" "$inflight" "$gzip" "$depth" "$rate" "$ceiling" "$ratio" "$cpu" "${batches:--}"
done
