#!/usr/bin/env bash
# Criterion micro benchmarks (crates/core/benches/micro.rs): the value encoder per type, one products
# document, NDJSON batching, gzip levels, and the pipeline alone (pgoutput Insert bytes → documents
# → batches, no HTTP). About three minutes on two cores; then a summary table.
#
#   bash scripts/bench-micro.sh                          # everything
#   bash scripts/bench-micro.sh pipeline                 # a criterion name filter (regex)
#   bash scripts/bench-micro.sh --measurement-time 10    # any criterion option
#
# Builds the core crate with the release profile in target/ (set CARGO_TARGET_DIR to build
# elsewhere). Needs neither PostgreSQL nor pgrx: the stages measured are in the pure core crate.
set -euo pipefail
cd "$(dirname "$0")/.."

log=$(mktemp)
trap 'rm -f "$log"' EXIT
cargo bench -p pg_meili_sync_core --bench micro -- "$@" | tee "$log"

echo
echo "== summary (criterion's estimate per iteration; documents/s for document groups)"
printf '%-40s %14s %22s\n' benchmark time throughput
# Criterion prints `<id> time: [low estimate high]` (the id alone on the line before when it is
# long), then `thrpt: [...]`; lines with % are comparisons with the previous run.
awk '
    /^[^ ]/ { name = $1 }
    /time:|thrpt:/ && !/%/ {
        line = $0
        sub(/^[^[]*\[/, "", line)
        split(line, estimate, " ")
        value = estimate[3]; unit = estimate[4]
    }
    /time:/ && !/%/ { time = value " " unit }
    /thrpt:/ && !/%/ {
        scale["B/s"] = 1e-6; scale["KB/s"] = 1e-3; scale["MB/s"] = 1; scale["GB/s"] = 1e3
        scale["elem/s"] = 1; scale["Kelem/s"] = 1e3; scale["Melem/s"] = 1e6; scale["Gelem/s"] = 1e9
        if (unit ~ /B\/s$/) {
            rate = sprintf("%.1f MB/s", value * scale[unit])
        } else {
            what = (name ~ /^pgoutput\//) ? "messages/s" : "docs/s"
            rate = sprintf("%.0f %s", value * scale[unit], what)
        }
        printf "%-40s %14s %22s\n", name, time, rate
    }
' "$log"
echo
grep '^# ' "$log" | grep -v '^# products document' || true
