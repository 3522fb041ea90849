#!/usr/bin/env bash
# Every benchmark, one command: installs what is missing and the extension, then runs the criterion
# micro benchmarks, the load command's end-to-end runs (each beside Meilisearch's own ceiling in
# the same run), Postgres's own decoders against ours, and the sweep of the batching knobs.
#
# The load runs go to the bundled test server (what the extension alone costs and can push) and,
# when a real Meilisearch binary is found (MEILI_BIN, or `meilisearch`
# on PATH), again to a real server of their own started from it: the figures that count. Set
# MEILI_URL and MEILI_MASTER_KEY to use a running Meilisearch instead. About 15 minutes on two
# cores with the test server alone, 30 with a real server.
#   bash scripts/bench.sh
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The search mode measures the direct side with wrk, a C client faster than the server.
if ! command -v wrk > /dev/null; then
    if [ "$(id -u)" = 0 ]; then apt-get install -y -q wrk; else sudo apt-get install -y -q wrk; fi
fi
bash scripts/install.sh
cargo build --release -q -p pg_meili_sync_load
load=target/release/load

real=""
if [ -z "${MEILI_URL:-}" ]; then
    if [ -n "${MEILI_BIN:-}" ]; then
        real=$MEILI_BIN
    elif command -v meilisearch > /dev/null; then
        real=$(command -v meilisearch)
    fi
fi

# One load run on the test server (or MEILI_URL), then on a real server of its own if there is one.
run_load() {
    echo "-- ${MEILI_URL:-test server}"
    env -u E2E_MEILI "$load" "$@"
    if [ -n "$real" ]; then
        echo "-- real Meilisearch ($real)"
        E2E_MEILI=real MEILI_BIN=$real "$load" "$@"
    fi
}

echo "== micro benchmarks"
bash scripts/bench-micro.sh
echo "== backfill, 200,000 rows"
run_load backfill 200000 10000 8 0 32
echo "== stream, 50,000 rows in 500-row transactions"
run_load stream 50000 500
echo "== latency, 200 one-row transactions at 10/s"
run_load latency 200 10
echo "== a view of products with brand, tags and reviews: backfill of 100,000, stream of 20,000"
run_load view 100000 20000
echo "== fan-out: 1,000 parents x 20 children, children updated in 500-row transactions"
run_load fanout 1000 20 500
echo "== hot rows: 1,000 rows updated 100 times each in a burst"
run_load hotrow 1000 100
echo "== a column dropped from a synced table of 200,000 rows, then one added: until every document is in the new shape"
run_load schema 200000
echo "== search: through SQL (pgbench -c 10) against straight HTTP (wrk -c 10), 5,000 and 200,000 products, 5 s per query"
run_load search 5000 5 10
run_load search 200000 5 10
echo "== 0 and 50 idle shared tasks beside one busy table, 200,000 rows"
run_load tasks 0 200000 1
run_load tasks 50 200000 1
echo "== 8 busy shared tasks at once, 50,000 rows each: the decoder's memory with a 16 MB budget and the default"
run_load busy 8 50000 16
run_load busy 8 50000 256
echo "== decoders, 200,000 rows"
"$load" decoders 200000 500
echo "== sweep of the batching knobs, 100,000 rows per run"
bash scripts/bench-sweep.sh 100000
