#!/usr/bin/env bash
# Golden SQL tests (tier 3): runs tests/pg_regress/sql/*.sql with PostgreSQL's pg_regress against a
# throwaway cluster that preloads the installed extension, and compares with
# tests/pg_regress/expected/*.out. The files follow `cargo pgrx regress`'s layout (setup.sql runs
# first); this runner exists because cargo pgrx regress cannot start Postgres when run as root.
#
#   bash scripts/regress.sh            run them (the extension must be installed: scripts/install.sh)
#   PG_MAJOR=17 bash scripts/regress.sh   the same against PostgreSQL 17 (15 unless set)
#   bash scripts/regress.sh --accept   also copy every result over its expected file (then review the diff)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/pg-config.sh
bindir=$("$PG_CONFIG" --bindir)
pg_regress=$(dirname "$("$PG_CONFIG" --pgxs)")/../test/regress/pg_regress
accept=false
[ "${1:-}" = "--accept" ] && accept=true

work=$(mktemp -d /tmp/pg_meili_sync_regress.XXXXXX)
as_pg=()
if [ "$(id -u)" -eq 0 ]; then
    as_pg=(runuser -u postgres --)
    chown postgres:postgres "$work"
fi
port=$(( 20000 + RANDOM % 20000 ))
stop() {
    "${as_pg[@]}" "$bindir/pg_ctl" -D "$work/data" -m immediate stop >/dev/null 2>&1 || true
    rm -rf "$work"
}
trap stop EXIT

"${as_pg[@]}" "$bindir/initdb" -D "$work/data" -A trust -U postgres >/dev/null
"${as_pg[@]}" "$bindir/pg_ctl" -D "$work/data" -l "$work/server.log" -w start -o "-p $port -k $work -c listen_addresses='' \
    -c shared_preload_libraries=pg_meili_sync -c wal_level=logical -c meili_sync.database=regress \
    -c meili_sync.naptime=200ms -c lc_messages=C -c fsync=off" >/dev/null
"${as_pg[@]}" "$bindir/createdb" -h "$work" -p "$port" -U postgres regress

# pg_regress reads and writes as the postgres user: give it its own copy of the files.
cp -r tests/pg_regress "$work/suite"
mkdir -p "$work/suite/expected"
for file in tests/pg_regress/sql/*.sql; do
    # A new test has no expected output yet: compare it with nothing (it fails until accepted).
    touch "$work/suite/expected/$(basename "$file" .sql).out"
done
[ "$(id -u)" -eq 0 ] && chown -R postgres:postgres "$work/suite"
tests=(setup)
for file in tests/pg_regress/sql/*.sql; do
    name=$(basename "$file" .sql)
    [ "$name" = setup ] || tests+=("$name")
done

status=0
(cd "$work/suite" && "${as_pg[@]}" "$pg_regress" --bindir="$bindir" --host="$work" --port="$port" --user=postgres \
    --use-existing --dbname=regress --inputdir=. --outputdir=. "${tests[@]}") || status=$?
if $accept; then
    mkdir -p tests/pg_regress/expected
    for name in "${tests[@]}"; do
        cp "$work/suite/results/$name.out" "tests/pg_regress/expected/$name.out"
    done
    echo "expected outputs replaced by this run's results; review them with git diff"
elif [ "$status" -ne 0 ]; then
    cat "$work/suite/regression.diffs" 2>/dev/null || true
    echo "--- server log tail ---"
    tail -n 40 "$work/server.log" || true
    exit "$status"
fi
