#!/usr/bin/env bash
# Builds pg_meili_sync in release mode and installs it into PostgreSQL $PG_MAJOR (15 unless set:
# scripts/pg-config.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/pg-config.sh
sudo=()
[ "$(id -u)" -eq 0 ] || sudo=(--sudo)
# PG_MEILI_SYNC_PROFILE picks the cargo profile: release unless set (the tests use ci).
cargo pgrx install --profile "${PG_MEILI_SYNC_PROFILE:-release}" "${sudo[@]}" --pg-config "$PG_CONFIG" \
    --no-default-features --features "pg$PG_MAJOR"
# The install scripts of earlier versions, which cargo pgrx install leaves out (it copies the update
# scripts only): CREATE EXTENSION pg_meili_sync VERSION '0.1.0' then works, and updates.
as_root=()
[ "$(id -u)" -eq 0 ] || as_root=(sudo)
for script in sql/pg_meili_sync--*.sql; do
    case "$(basename "$script")" in
        *--*--*) ;;
        *) "${as_root[@]}" install -m 644 "$script" "$("$PG_CONFIG" --sharedir)/extension/" ;;
    esac
done
