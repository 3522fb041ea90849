#!/usr/bin/env bash
# Builds pg_meili_sync in release mode and installs it into the system PostgreSQL 15.
set -euo pipefail
cd "$(dirname "$0")/.."
PG_CONFIG=/usr/lib/postgresql/15/bin/pg_config
if [ "$(id -u)" -eq 0 ]; then
    cargo pgrx install --release --pg-config "$PG_CONFIG"
else
    cargo pgrx install --release --sudo --pg-config "$PG_CONFIG"
fi
