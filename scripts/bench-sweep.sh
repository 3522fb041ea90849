#!/usr/bin/env bash
# Sweeps the batching knobs with the backfill load (200,000 rows by default) and prints one line per
# setting: docs/s, the ceiling measured in the same run, and the worker's CPU per 100k documents.
# The defaults in the README come from this table. Needs the extension installed (scripts/install.sh).
#   bash scripts/bench-sweep.sh [rows]
set -euo pipefail
cd "$(dirname "$0")/.."
rows=${1:-200000}
cargo build --release -q -p pg_meili_sync_load
printf '%-10s %-9s %-5s %12s %12s %16s\n' batch_size in_flight gzip docs/s ceiling 'CPU s/100k'
for batch in 1000 5000 10000 20000; do
    for inflight in 2 8; do
        for gzip in 0 1; do
            out=$(target/release/load backfill "$rows" "$batch" "$inflight" "$gzip")
            rate=$(awk '/^docs\/s/ {print $2}' <<<"$out")
            ceiling=$(awk '/^ceiling/ {print $2}' <<<"$out")
            cpu=$(sed -n 's/.*(\([0-9.]*\) per 100k docs).*/\1/p' <<<"$out")
            printf '%-10s %-9s %-5s %12s %12s %16s\n' "$batch" "$inflight" "$gzip" "$rate" "$ceiling" "$cpu"
        done
    done
done
