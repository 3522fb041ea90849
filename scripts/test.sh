#!/usr/bin/env bash
# Runs every test tier: the module-cycle check and the pure core crate's tests, the test server
# against the recorded transcripts, the in-Postgres unit tests, the golden SQL files, and the
# end-to-end suite (set MEILI_URL and MEILI_MASTER_KEY to use a real Meilisearch), on PostgreSQL
# 15; then the golden files and an end-to-end set on 16, 17 and 18 (scripts/test-major.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The tests build with the ci profile: release without link-time optimisation (Cargo.toml).
export PG_MEILI_SYNC_PROFILE=ci

echo "== $(date -u +%H:%M:%S) tier 0: no cycle among the modules of the extension and of the core crate"
python3 scripts/check-module-cycles.py

echo "== $(date -u +%H:%M:%S) tier 0: the docs name only what exists, and docs/reference documents every function, view, option and GUC"
python3 scripts/check-docs.py
python3 scripts/check-docs.py --self-test > /dev/null

echo "== $(date -u +%H:%M:%S) tier 0: cargo fmt --check and cargo clippy -D warnings, every crate of the workspace"
cargo fmt --all --check
cargo clippy --workspace --release --all-targets -- -D warnings

echo "== $(date -u +%H:%M:%S) tier 0b: the pure core crate under plain cargo test (no Postgres)"
cargo test --profile ci -p pg_meili_sync_core

echo "== $(date -u +%H:%M:%S) tier 1a: Meilisearch test server and transcript replay"
cargo test --profile ci -p meili-test-server

echo "== $(date -u +%H:%M:%S) tier 1b+2: the extension's plain #[test]s and #[pg_test]s inside PostgreSQL"
pgdata=$(mktemp -d /tmp/pg_meili_sync_pgrx.XXXXXX)
trap 'rm -rf "$pgdata"' EXIT
rmdir "$pgdata"
if [ "$(id -u)" -eq 0 ]; then
    cargo pgrx test pg15 --runas postgres --pgdata "$pgdata"
else
    cargo pgrx test pg15
fi

# The 0.1.0 library for the upgrade test, built before this build's install (which then puts its own
# library back in target/release).
bash scripts/build-0.1.0.sh
bash scripts/install.sh
echo "== $(date -u +%H:%M:%S) tier 3: golden SQL files (tests/pg_regress)"
bash scripts/regress.sh

echo "== $(date -u +%H:%M:%S) tier 4: end to end (two tests at a time: .config/nextest.toml)"
cargo nextest run --cargo-profile ci -p pg_meili_sync_e2e

# PostgreSQL 16, 17 and 18: the extension built for each, the golden SQL files, and an end-to-end
# set (see scripts/test-major.sh).
for major in 16 17 18; do
    echo "== $(date -u +%H:%M:%S) tiers 3 and 4 on PostgreSQL $major"
    bash scripts/test-major.sh "$major"
done

# With a real Meilisearch binary (MEILI_BIN; .ci/run sets it) and no MEILI_URL: the suite again,
# each test against a real server of its own, but for the files whose outcome depends on the
# Postgres side, or that other files cover on the real server, to keep CI within its time:
# trust.rs, versions.rs (slots and failover),
# upgrade.rs (the extension replaced in place, a dump restored), shared.rs (the shared decoding
# pass, whose requests are a task's own), views.rs (rendering views; the documents are encoded as
# tables' are), edges.rs (state changes at their commit) and backfill.rs (every other file copies
# a table first). Fault tests that need the test server's knobs skip, so does the crash loop (the
# Postgres side's), and the outages last 30 s instead of 60.
if [ -n "${MEILI_BIN:-}" ] && [ -z "${MEILI_URL:-}" ]; then
    echo "== $(date -u +%H:%M:%S) tier 4b: end to end against the real Meilisearch at $MEILI_BIN"
    skipped=""
    for file in trust versions upgrade shared views edges backfill soak; do
        skipped="$skipped | binary($file)"
    done
    E2E_MEILI=real E2E_OUTAGE_SECONDS=30 cargo nextest run --cargo-profile ci -p pg_meili_sync_e2e \
        -E "not (${skipped# | })"
    # Of views.rs, the view task that falls behind its own queued work: how long a real server
    # takes for it is what the test is about.
    E2E_MEILI=real cargo nextest run --cargo-profile ci -p pg_meili_sync_e2e \
        -E 'binary(views) & test(/^a_view_over_a_hot_lookup_table/)'
fi
echo "== $(date -u +%H:%M:%S) done"
