#!/usr/bin/env bash
# Builds the Debian package of kvmeshd: target/debian/kvmesh_<version>_<arch>.deb
#
#   /usr/bin/kvmeshd, /usr/bin/kvmesh          release binaries (stripped)
#   /lib/systemd/system/kvmeshd.service        deploy/kvmeshd.service, run as
#                                              the kvmesh system user
#   /etc/kvmesh/kvmeshd.toml                   the embedded default config with
#                                              the socket in /run/kvmesh and the
#                                              state in /var/lib/kvmesh (a conffile)
#   /usr/share/doc/kvmesh/                     OPERATING.md, the alert rules and
#                                              the Grafana dashboard
#
# postinst creates the `kvmesh` system user and group and enables the unit
# (it does not start it: configure pools and peers first). prerm stops it
# (a drain). postrm purge removes the user and /var/lib/kvmesh.
#
# Usage: scripts/package-deb.sh [--no-build]   (--no-build: use target/release)
set -euo pipefail
cd "$(dirname "$0")/.."

build=1
for a in "$@"; do
    case "$a" in
        --no-build) build=0 ;;
        *) echo "usage: $0 [--no-build]" >&2; exit 2 ;;
    esac
done
for tool in dpkg-deb dpkg; do
    command -v "$tool" >/dev/null || { echo "package-deb: $tool is missing (Debian package dpkg)" >&2; exit 1; }
done
if [[ $build -eq 1 ]]; then
    cargo build --locked --release -p kvmeshd --bins
fi
for b in kvmeshd kvmesh; do
    [[ -x target/release/$b ]] || { echo "package-deb: target/release/$b not built" >&2; exit 1; }
done

version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
arch=$(dpkg --print-architecture)
ucx_version=$(dpkg-query -W -f='${Version}' libucx0 2>/dev/null | sed 's/-.*//' || true)
name="kvmesh_${version}_${arch}"
root="target/debian/$name"
rm -rf "$root"
install -d "$root/DEBIAN" "$root/usr/bin" "$root/lib/systemd/system" "$root/etc/kvmesh" \
    "$root/usr/share/doc/kvmesh"

install -m 0755 target/release/kvmeshd target/release/kvmesh "$root/usr/bin/"
strip --strip-unneeded "$root/usr/bin/kvmeshd" "$root/usr/bin/kvmesh" 2>/dev/null || true

# The unit: the binary in /usr/bin, run as the kvmesh user.
sed -e 's#^ExecStart=/usr/local/bin/kvmeshd#ExecStart=/usr/bin/kvmeshd#' \
    -e 's#^\[Service\]$#[Service]\nUser=kvmesh\nGroup=kvmesh#' \
    deploy/kvmeshd.service > "$root/lib/systemd/system/kvmeshd.service"
grep -q '^ExecStart=/usr/bin/kvmeshd' "$root/lib/systemd/system/kvmeshd.service" \
    || { echo "package-deb: could not point the unit at /usr/bin/kvmeshd" >&2; exit 1; }

# The config: the embedded default, socket and state where the unit puts them.
target/release/kvmeshd --print-default-config \
    | sed -e 's|^# socket = "/run/kvmesh/kvmeshd.sock"|socket = "/run/kvmesh/kvmeshd.sock"|' \
          -e 's|^# state_dir = "/var/lib/kvmesh"|state_dir = "/var/lib/kvmesh"|' \
    > "$root/etc/kvmesh/kvmeshd.toml"
grep -q '^socket = "/run/kvmesh/kvmeshd.sock"' "$root/etc/kvmesh/kvmeshd.toml" \
    || { echo "package-deb: the default config no longer has the socket line this script sets" >&2; exit 1; }
target/release/kvmeshd --config "$root/etc/kvmesh/kvmeshd.toml" --check-config >/dev/null
chmod 0644 "$root/etc/kvmesh/kvmeshd.toml"

install -m 0644 docs/OPERATING.md deploy/alerts.yml deploy/grafana-dashboard.json "$root/usr/share/doc/kvmesh/"

depends="libc6"
if [[ -n "$ucx_version" ]]; then
    depends="$depends, libucx0 (>= $ucx_version)"
else
    depends="$depends, libucx0"
fi
cat > "$root/DEBIAN/control" <<EOF
Package: kvmesh
Version: $version
Architecture: $arch
Maintainer: kvmesh developers <kvmesh@localhost>
Depends: $depends, adduser
Section: net
Priority: optional
Homepage: https://github.com/kvmesh/kvmesh
Description: distributed KV-cache sharing daemon for LLM inference
 kvmeshd keeps a pool of registered memory holding KV-cache blocks, moves
 blocks between nodes with one-sided UCX RMA, keeps every copy coherent and
 serves blocks zero-copy to the co-located inference engine. This package
 holds the daemon, the kvmesh admin CLI, a systemd unit and a default
 configuration in /etc/kvmesh.
EOF
echo "/etc/kvmesh/kvmeshd.toml" > "$root/DEBIAN/conffiles"

cat > "$root/DEBIAN/postinst" <<'EOF'
#!/bin/sh
set -e
if [ "$1" = "configure" ]; then
    if ! getent group kvmesh >/dev/null; then
        addgroup --system --quiet kvmesh
    fi
    if ! getent passwd kvmesh >/dev/null; then
        adduser --system --quiet --ingroup kvmesh --no-create-home --home /var/lib/kvmesh \
            --shell /usr/sbin/nologin kvmesh
    fi
    install -d -o kvmesh -g kvmesh -m 0700 /var/lib/kvmesh
    if [ -d /run/systemd/system ]; then
        systemctl daemon-reload >/dev/null || true
        systemctl enable kvmeshd.service >/dev/null || true
        echo "kvmesh: kvmeshd.service enabled, not started: edit /etc/kvmesh/kvmeshd.toml, then systemctl start kvmeshd"
    fi
fi
exit 0
EOF
cat > "$root/DEBIAN/prerm" <<'EOF'
#!/bin/sh
set -e
# A stop is a drain: pins end, the daemon leaves its cluster.
if [ -d /run/systemd/system ] && { [ "$1" = "remove" ] || [ "$1" = "upgrade" ]; }; then
    systemctl stop kvmeshd.service >/dev/null 2>&1 || true
fi
exit 0
EOF
cat > "$root/DEBIAN/postrm" <<'EOF'
#!/bin/sh
set -e
if [ -d /run/systemd/system ]; then
    systemctl daemon-reload >/dev/null 2>&1 || true
fi
if [ "$1" = "purge" ]; then
    if [ -d /run/systemd/system ]; then
        systemctl disable kvmeshd.service >/dev/null 2>&1 || true
    fi
    rm -rf /var/lib/kvmesh
    if getent passwd kvmesh >/dev/null; then
        deluser --system --quiet kvmesh >/dev/null 2>&1 || userdel kvmesh || true
    fi
    if getent group kvmesh >/dev/null; then
        delgroup --system --quiet kvmesh >/dev/null 2>&1 || groupdel kvmesh || true
    fi
fi
exit 0
EOF
chmod 0755 "$root/DEBIAN/postinst" "$root/DEBIAN/prerm" "$root/DEBIAN/postrm"

dpkg-deb --root-owner-group --build "$root" "target/debian/$name.deb" >/dev/null
echo "target/debian/$name.deb"
