#!/usr/bin/env bash
# Runs every test tier: the module-cycle check and the pure core crate's tests, the test server
# against the recorded transcripts, the in-Postgres unit tests, the golden SQL files, and the
# end-to-end suite (set MEILI_URL and MEILI_MASTER_KEY to use a real Meilisearch), on PostgreSQL
# 15; then the golden files and an end-to-end set on 16, 17 and 18 (scripts/test-major.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/pg-config.sh
bash scripts/setup.sh
# The tests build with the ci profile: release without link-time optimisation (Cargo.toml).
export PG_MEILI_SYNC_PROFILE=ci

# Builds that no tier needs at once run in the background, at the lowest CPU and I/O priority and
# in target directories of their own (so that they never wait for the foreground's build lock, nor
# it for theirs): they take the cores while the end-to-end tiers wait on PostgreSQL and Meilisearch,
# and yield them whenever a test computes. A failure is reported where the result is needed.
mkdir -p target/background
declare -A background_pid
in_background() {
    local name=$1
    shift
    (
        # Lower priorities only: where one cannot be set, the build runs at the normal one.
        renice -n 19 -p "$BASHPID" > /dev/null 2>&1 || true
        ionice -c 3 -p "$BASHPID" 2> /dev/null || true
        "$@"
    ) > "target/background/$name.log" 2>&1 &
    background_pid[$name]=$!
    echo "== $(date -u +%H:%M:%S) background: $name started"
}
await_background() {
    local name=$1
    if wait "${background_pid[$name]}"; then
        echo "== $(date -u +%H:%M:%S) background: $name done"
    else
        cat "target/background/$name.log"
        echo "== $(date -u +%H:%M:%S) background: $name FAILED (its output is above)"
        exit 1
    fi
}
# On the way out (a failed tier), what still runs in the background stops with the run.
stop_background() {
    local pid
    for pid in "${background_pid[@]}"; do
        pkill -TERM -P "$pid" 2> /dev/null || true
        kill "$pid" 2> /dev/null || true
    done
}
# The Debian package of the extension for 16, 17 and 18 (scripts/package.sh), checked by lintian:
# one build each, which `test-package.sh load` installs into that major before its tiers (an
# install.sh beforehand would only be a second build, which the package's files replace).
build_majors() {
    CARGO_TARGET_DIR="$PWD/target/majors" bash scripts/package.sh 16 17 18
}

echo "== $(date -u +%H:%M:%S) tier 0: no cycle among the modules of the extension and of the core crate"
python3 scripts/check-module-cycles.py

echo "== $(date -u +%H:%M:%S) tier 0: the docs name only what exists, and docs/reference documents every function, view, option and GUC"
python3 scripts/check-docs.py
python3 scripts/check-docs.py --self-test > /dev/null

echo "== $(date -u +%H:%M:%S) tier 0: cargo fmt --check (cargo clippy runs in the background)"
cargo fmt --all --check
# The 0.1.0 library, for the upgrade test in tier 4.
in_background library bash scripts/build-0.1.0.sh

echo "== $(date -u +%H:%M:%S) tier 0b: the pure core crate under plain cargo test (no Postgres)"
cargo test --profile ci -p pg_meili_sync_core

echo "== $(date -u +%H:%M:%S) tier 1a: Meilisearch test server and transcript replay"
cargo test --profile ci -p meili-test-server

echo "== $(date -u +%H:%M:%S) tier 1b+2: the extension's plain #[test]s and #[pg_test]s inside PostgreSQL"
pgdata=$(mktemp -d /tmp/pg_meili_sync_pgrx.XXXXXX)
trap 'rm -rf "$pgdata"; stop_background' EXIT
rmdir "$pgdata"
if [ "$(id -u)" -eq 0 ]; then
    cargo pgrx test pg15 --profile ci --runas postgres --pgdata "$pgdata"
else
    cargo pgrx test pg15 --profile ci
fi

# Tiers 3, 4 and 4b test what the package installs (over the build cargo pgrx test installed), and
# its removal is checked at the end.
echo "== $(date -u +%H:%M:%S) tier 2b: the Debian package for PostgreSQL 15, installed as a user installs it"
bash scripts/package.sh 15
bash scripts/test-package.sh install "$(package_of 15)"
echo "== $(date -u +%H:%M:%S) tier 3: golden SQL files (tests/pg_regress)"
bash scripts/regress.sh

echo "== $(date -u +%H:%M:%S) tier 4: end to end (three tests at a time)"
await_background library
# The packages for 16, 17 and 18, while tier 4 waits (their tiers follow it). Started earlier, at
# the lowest priority all the same, they slowed the compiles of tiers 0b to 2b by 2.5 minutes.
in_background majors build_majors
# Three at a time: the tests mostly wait on PostgreSQL and Meilisearch, and those that measure a
# delay run alone (.config/nextest.toml). Of the search replicas, the publisher of 17 (15 → 18
# and 18 → 18 run in PostgreSQL 18's tier).
cargo nextest run --cargo-profile ci -p pg_meili_sync_e2e --test-threads 3 \
    -E 'not (binary(replica) & test(/_(15|18)_stays_exact$/))'

# PostgreSQL 16, 17 and 18: the extension built for each, the golden SQL files, and an end-to-end
# set (see scripts/test-major.sh).
await_background majors
# The lints, whose result decides only the end.
in_background clippy env CARGO_TARGET_DIR="$PWD/target/clippy" \
    cargo clippy --workspace --release --all-targets -- -D warnings
for major in 16 17 18; do
    echo "== $(date -u +%H:%M:%S) tiers 3 and 4 on PostgreSQL $major, on exactly the files of its package"
    bash scripts/test-package.sh load "$major" "$(package_of "$major")"
    bash scripts/test-major.sh "$major" --installed
done

# With a real Meilisearch binary (MEILI_BIN; .ci/run sets it) and no MEILI_URL: the suite again,
# each test against a real server of its own, but for the files whose outcome depends on the
# Postgres side, or that other files cover on the real server, to keep CI within its time:
# trust.rs and security.rs (who runs what, and as whom; but for its two tests of what is shown of
# a server's key and its errors' texts), versions.rs (slots and failover),
# upgrade.rs (the extension replaced in place, a dump restored), replica.rs (a subscription feeds
# the tables; the tasks are the other files'), databases.rs (workers per
# database), partitions.rs (which partition's changes reach which task), shared.rs (the shared
# decoding pass, whose requests are a task's own), views.rs (rendering views; the documents are
# encoded as tables' are), edges.rs (state changes at their commit) and backfill.rs (every other
# file copies a table first). Of streaming.rs, the million-row transaction (the decoder's
# spilling; a real server's throughput is the load benchmarks'). Fault tests that need the test
# server's knobs skip, so does the crash loop (the Postgres side's), and the outages last 30 s
# instead of 60.
if [ -n "${MEILI_BIN:-}" ] && [ -z "${MEILI_URL:-}" ]; then
    echo "== $(date -u +%H:%M:%S) tier 4b: end to end against the real Meilisearch at $MEILI_BIN"
    skipped="test(=a_million_row_transaction_streams_through)"
    skipped="$skipped | (binary(security) & not test(/^(the_default_api_key|an_errors_text)/))"
    for file in trust versions upgrade databases partitions shared views edges backfill soak replica; do
        skipped="$skipped | binary($file)"
    done
    E2E_MEILI=real E2E_OUTAGE_SECONDS=30 cargo nextest run --cargo-profile ci -p pg_meili_sync_e2e \
        -E "not ($skipped)"
    # Of views.rs, the view task that falls behind its own queued work: how long a real server
    # takes for it is what the test is about.
    E2E_MEILI=real cargo nextest run --cargo-profile ci -p pg_meili_sync_e2e \
        -E 'binary(views) & test(/^a_view_over_a_hot_lookup_table/)'
fi
echo "== $(date -u +%H:%M:%S) the package for PostgreSQL 15 removed"
bash scripts/test-package.sh remove
await_background clippy
echo "== $(date -u +%H:%M:%S) done"
