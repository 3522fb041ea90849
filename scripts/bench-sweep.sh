#!/usr/bin/env bash
# Sweeps the batching knobs with the backfill load and prints one line per setting: docs/s, the
# ceiling measured in the same run, and the worker's CPU per 100k documents. The defaults in the
# README come from this table. Needs the extension installed (scripts/install.sh).
#   bash scripts/bench-sweep.sh [rows]      (default 100000)
set -euo pipefail
cd "$(dirname "$0")/.."
rows=${1:-100000}
cargo build --release -q -p pg_meili_sync_load
printf '%-10s %-9s %-5s %10s %10s %6s %12s\n' batch_size in_flight gzip docs/s ceiling ratio 'CPU s/100k'
# batch_size in_flight gzip
for setting in "1000 8 0" "5000 8 0" "10000 8 0" "20000 8 0" "10000 2 0" "10000 16 0" "10000 8 1"; do
    read -r batch inflight gzip <<<"$setting"
    out=$(target/release/load backfill "$rows" "$batch" "$inflight" "$gzip")
    rate=$(awk '/^docs\/s/ {print $2}' <<<"$out")
    ceiling=$(awk '/^ceiling/ {print $2}' <<<"$out")
    ratio=$(awk '/^backfill\/ceiling/ {print $2}' <<<"$out")
    cpu=$(sed -n 's/.*(\([0-9.]*\) per 100k docs).*/\1/p' <<<"$out")
    printf '%-10s %-9s %-5s %10s %10s %6s %12s\n' "$batch" "$inflight" "$gzip" "$rate" "$ceiling" "$ratio" "$cpu"
done
