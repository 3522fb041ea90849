#!/usr/bin/env bash
# Installs what a fresh Debian 12 machine lacks to build and test pg_meili_sync; skips what is there.
set -euo pipefail

PG_MAJOR=15
PG_CONFIG=/usr/lib/postgresql/$PG_MAJOR/bin/pg_config
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"

packages=(postgresql-$PG_MAJOR postgresql-server-dev-$PG_MAJOR postgresql-$PG_MAJOR-wal2json libclang-dev clang sudo build-essential pkg-config libssl-dev)
missing=()
for package in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" || missing+=("$package")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "setup: installing ${missing[*]}"
    $SUDO apt-get update -q
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q "${missing[@]}"
fi

if ! cargo pgrx --version 2>/dev/null | grep -q "0.18.1"; then
    echo "setup: installing cargo-pgrx 0.18.1 (takes several minutes)"
    cargo install cargo-pgrx --version =0.18.1 --locked
fi

if ! grep -qs "pg$PG_MAJOR" "${PGRX_HOME:-$HOME/.pgrx}/config.toml"; then
    cargo pgrx init --pg$PG_MAJOR "$PG_CONFIG"
fi
