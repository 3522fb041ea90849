#!/usr/bin/env bash
# Builds pg_meili_sync in release mode and installs it into PostgreSQL $PG_MAJOR (15 unless set:
# scripts/pg-config.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/pg-config.sh
sudo=()
[ "$(id -u)" -eq 0 ] || sudo=(--sudo)
cargo pgrx install --release "${sudo[@]}" --pg-config "$PG_CONFIG" \
    --no-default-features --features "pg$PG_MAJOR"
