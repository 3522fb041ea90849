#!/usr/bin/env bash
# Every benchmark, one command: installs what is missing and the extension, then runs the criterion
# micro benchmarks, the load command's end-to-end runs (each beside Meilisearch's own ceiling in
# the same run), Postgres's own decoders against ours, and the sweep of the batching knobs. About
# 15 minutes on two cores. Set MEILI_URL and MEILI_MASTER_KEY to run the load against a real
# Meilisearch (the micro benchmarks and the decoders' SQL side never touch it).
#   bash scripts/bench.sh
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/install.sh
cargo build --release -q -p pg_meili_sync_load
load=target/release/load

echo "== micro benchmarks"
bash scripts/bench-micro.sh
echo "== backfill, 200,000 rows"
"$load" backfill 200000 10000 8 0
echo "== stream, 50,000 rows in 500-row transactions"
"$load" stream 50000 500
echo "== latency, 200 one-row transactions at 10/s"
"$load" latency 200 10
echo "== decoders, 200,000 rows"
"$load" decoders 200000 500
echo "== sweep of the batching knobs, 100,000 rows per run"
bash scripts/bench-sweep.sh 100000
