#!/usr/bin/env bash
# The packages of scripts/package.sh, installed as a user installs them (scripts/test.sh runs the
# suite on what they install):
#
#   bash scripts/test-package.sh install DEB   PostgreSQL 15 (Debian's): the source build's files
#                                              are removed, then dpkg installs the package
#   bash scripts/test-package.sh remove        dpkg removes it, and no file of it is left
#   bash scripts/test-package.sh load MAJOR DEB   16, 17 or 18, which Debian 12 has no server
#                                              package for: exactly the package's files replace
#                                              what that major's build has installed
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/pg-config.sh
as_root=()
[ "$(id -u)" -eq 0 ] || as_root=(sudo)

# The extension's files in a PostgreSQL install, whoever put them there.
installed_files() {
    local pg_config=$1
    find "$("$pg_config" --pkglibdir)" "$("$pg_config" --sharedir)/extension" -maxdepth 1 \
        -name 'pg_meili_sync*' -type f 2> /dev/null | sort
}

package_name() {
    dpkg-deb --field "$1" Package
}

case "${1:-}" in
    install)
        deb=$2
        pg_config=$(pg_config_of 15)
        # The source build (scripts/install.sh, cargo pgrx test) goes first: what is tested is only
        # what the package installs.
        installed_files "$pg_config" | xargs -r "${as_root[@]}" rm -f
        "${as_root[@]}" dpkg -i "$deb"
        package=$(package_name "$deb")
        # Every file the package lists is on disk, and nothing of the extension is there that the
        # package does not list.
        dpkg -L "$package" | while read -r path; do
            [ -e "$path" ] || { echo "test-package: $path is listed by $package but missing" >&2; exit 1; }
        done
        unlisted=$(comm -23 <(installed_files "$pg_config") <(dpkg -L "$package" | sort))
        if [ -n "$unlisted" ]; then
            echo "test-package: files of the extension that $package does not hold: $unlisted" >&2
            exit 1
        fi
        echo "test-package: $package $(dpkg-query -W -f='${Version}' "$package") installed, $(dpkg -L "$package" | grep -c 'pg_meili_sync') files of the extension"
        ;;
    remove)
        pg_config=$(pg_config_of 15)
        package=postgresql-15-pg-meili-sync
        listed=$(dpkg -L "$package")
        "${as_root[@]}" dpkg --purge "$package"
        left=$(
            for path in $listed "/usr/share/doc/$package"; do
                if [ -f "$path" ] || [ "$path" = "/usr/share/doc/$package" ] && [ -e "$path" ]; then
                    echo "$path"
                fi
            done
            installed_files "$pg_config"
        )
        if [ -n "$left" ]; then
            echo "test-package: removing $package left files behind:" >&2
            echo "$left" >&2
            exit 1
        fi
        echo "test-package: $package removed, no file of it left"
        ;;
    load)
        major=$2
        deb=$3
        pg_config=$(pg_config_of "$major")
        unpacked=$(mktemp -d)
        trap 'rm -rf "$unpacked"' EXIT
        dpkg-deb --extract "$deb" "$unpacked"
        installed_files "$pg_config" | xargs -r "${as_root[@]}" rm -f
        "${as_root[@]}" install -m 644 "$unpacked/usr/lib/postgresql/$major/lib/pg_meili_sync.so" \
            "$("$pg_config" --pkglibdir)/"
        "${as_root[@]}" install -m 644 "$unpacked/usr/share/postgresql/$major/extension/"* \
            "$("$pg_config" --sharedir)/extension/"
        echo "test-package: the files of $(package_name "$deb") loaded into $("$pg_config" --version)"
        ;;
    *)
        echo "usage: $0 install DEB | remove | load MAJOR DEB" >&2
        exit 2
        ;;
esac
