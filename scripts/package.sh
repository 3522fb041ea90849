#!/usr/bin/env bash
# Builds one Debian package per PostgreSQL major, named as PGDG names extension packages:
#
#   bash scripts/package.sh              15, 16, 17 and 18
#   bash scripts/package.sh 15 17        those majors
#
# into target/packages/postgresql-<major>-pg-meili-sync_<version>-1_amd64.deb. Each holds the
# library, the control file, every install and update script and bin/pg_meili_sync_replica, in
# Debian's layout for its major (/usr/lib/postgresql/<major>/lib and bin,
# /usr/share/postgresql/<major>/extension), and depends on that
# major's server package, postgresql-<major>, as PGDG's and Debian's builds of it provide. lintian
# checks each package when it is installed, and a package with an error in it fails the script.
#
# The files come from `cargo pgrx package`, which builds exactly what `cargo pgrx install` installs
# (scripts/install.sh); dpkg-deb puts them in a package, and dpkg-shlibdeps says which libraries it
# needs. PG_MEILI_SYNC_PROFILE picks the cargo profile (release unless set; CI packages its ci
# builds); CARGO_TARGET_DIR is honoured, so a major's build in the tests is packaged without a
# second build.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/pg-config.sh

majors=("$@")
[ ${#majors[@]} -gt 0 ] || majors=(15 16 17 18)
profile=${PG_MEILI_SYNC_PROFILE:-release}
version=$(sed -n 's/^version = "\(.*\)"$/\1/p' Cargo.toml | head -n 1)
revision=1  # package_of (scripts/pg-config.sh) names the file with it
maintainer="pg_meili_sync maintainers <maintainers@users.noreply.a-seed-4478357d.example>"
out=$PWD/target/packages
work=$out/build
mkdir -p "$out" "$work"

# The Debian copyright file, in the machine-readable format, with the license's text.
copyright() {
    cat << EOF
Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/
Upstream-Name: pg_meili_sync

Files: *
Copyright: 2026 The pg_meili_sync developers
License: PostgreSQL
EOF
    sed -e 's/^$/./' -e 's/^/ /' LICENSE | sed -n '3,$p'
}

# The Debian changelog of this build, compressed as Debian policy asks (no name, no time stamp).
changelog() {
    local package=$1 major=$2
    cat << EOF | gzip -9n
pg-meili-sync ($version-$revision) unstable; urgency=medium

  * pg_meili_sync $version for PostgreSQL $major, built with cargo pgrx package.

 -- $maintainer  $(date -u -R -d "@$(git log -1 --format=%ct 2> /dev/null || date +%s)")
EOF
}

# What the library needs of the system, as dpkg-shlibdeps reads it (libc6, libgcc-s1).
shared_library_depends() {
    local library=$1 scratch
    scratch=$(mktemp -d)
    mkdir "$scratch/debian"
    printf 'Source: pg-meili-sync\n\nPackage: pg-meili-sync\nArchitecture: any\n' \
        > "$scratch/debian/control"
    (cd "$scratch" && dpkg-shlibdeps -O "$library") | sed -n 's/^shlibs:Depends=//p'
    rm -rf "$scratch"
}

for major in "${majors[@]}"; do
    pg_config=$(pg_config_of "$major")
    package=postgresql-$major-pg-meili-sync
    built=$work/pgrx-$major
    root=$work/$package
    rm -rf "$built" "$root"
    echo "== package: PostgreSQL $major ($profile build)"
    cargo pgrx package --profile "$profile" --pg-config "$pg_config" --out-dir "$built" \
        --no-default-features --features "pg$major"

    # cargo pgrx package lays the files out as that pg_config's install does; a package has
    # Debian's layout whatever the build's PostgreSQL was.
    library=$(find "$built" -name pg_meili_sync.so -print -quit)
    control=$(find "$built" -name pg_meili_sync.control -print -quit)
    if [ -z "$library" ] || [ -z "$control" ]; then
        echo "package: cargo pgrx package left no library or control file in $built" >&2
        exit 1
    fi
    libdir=$root/usr/lib/postgresql/$major/lib
    bindir=$root/usr/lib/postgresql/$major/bin
    extdir=$root/usr/share/postgresql/$major/extension
    docdir=$root/usr/share/doc/$package
    install -d "$libdir" "$bindir" "$extdir" "$docdir" "$root/DEBIAN"
    # The search replica's helper, beside the major's own programs (README: Managed PostgreSQL).
    install -m 755 bin/pg_meili_sync_replica "$bindir/"
    install -m 644 "$library" "$libdir/"
    strip --strip-unneeded --remove-section=.comment --remove-section=.note "$libdir/pg_meili_sync.so"
    install -m 644 "$control" "$(dirname "$control")"/pg_meili_sync--*.sql "$extdir/"
    # The install scripts of earlier versions, which cargo pgrx leaves out (as scripts/install.sh
    # does): CREATE EXTENSION pg_meili_sync VERSION '0.1.0' then works, and updates.
    for script in sql/pg_meili_sync--*.sql; do
        case "$(basename "$script")" in
            *--*--*) ;;
            *) install -m 644 "$script" "$extdir/" ;;
        esac
    done
    copyright > "$docdir/copyright"
    changelog "$package" "$major" > "$docdir/changelog.Debian.gz"
    chmod 644 "$docdir/copyright" "$docdir/changelog.Debian.gz"

    depends="postgresql-$major, $(shared_library_depends "$libdir/pg_meili_sync.so")"
    installed_size=$(du -k -s --exclude=DEBIAN "$root" | cut -f 1)
    cat > "$root/DEBIAN/control" << EOF
Package: $package
Source: pg-meili-sync
Version: $version-$revision
Architecture: amd64
Maintainer: $maintainer
Installed-Size: $installed_size
Depends: $depends
Section: database
Priority: optional
Description: Meilisearch indexes kept in step with PostgreSQL $major tables
 pg_meili_sync is a PostgreSQL extension that keeps Meilisearch indexes in
 step with tables, views and partitioned tables, from inside the database:
 its background workers copy a table, then stream its changes by logical
 decoding, and searches run from SQL.
 .
 This package holds the extension for PostgreSQL $major. It needs
 shared_preload_libraries = 'pg_meili_sync' and wal_level = logical.
EOF
    (cd "$root" && find usr -type f -print0 | sort -z | xargs -0 md5sum) > "$root/DEBIAN/md5sums"
    chmod 644 "$root/DEBIAN/control" "$root/DEBIAN/md5sums"

    deb=$(package_of "$major")
    dpkg-deb --root-owner-group -Zxz --build "$root" "$deb" > /dev/null
    if command -v lintian > /dev/null; then
        # Errors fail the package; warnings are shown. The copyright file is ours, not Debian's.
        lintian --fail-on error --suppress-tags initial-upload-closes-no-bugs "$deb"
    else
        echo "package: lintian is not installed; $deb was not checked" >&2
    fi
    echo "== package: $deb"
done
