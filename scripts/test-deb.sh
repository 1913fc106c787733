#!/usr/bin/env bash
# Builds the Debian package, installs it on this machine (dpkg -i), starts
# the daemon from it as the kvmesh user on the installed config, checks that
# it serves (a put and a get through the installed CLI, /metrics), drains it
# with SIGTERM, and purges the package (user, config and state gone).
#
# Needs root (or passwordless sudo). Without it, or when a kvmesh package is
# already installed here (an operator's: never touched), it says SKIPPED and
# exits 0 — except under CI=true, where a skip is a failure.
set -euo pipefail
cd "$(dirname "$0")/.."

skip() {
    echo "SKIPPED: Debian package install test: $*" >&2
    if [[ "${CI:-}" == "true" ]]; then
        echo "(CI=true: a skipped check is a failure)" >&2
        exit 1
    fi
    exit 0
}

if [[ $(id -u) -ne 0 ]]; then
    sudo -n true 2>/dev/null || skip "needs root or passwordless sudo"
fi
if dpkg-query -W -f='${Status}' kvmesh 2>/dev/null | grep -q "install ok installed"; then
    skip "a kvmesh package is already installed on this machine (left alone)"
fi
for tool in setpriv python3; do
    command -v "$tool" >/dev/null || skip "$tool is missing"
done

if [[ -z "${KVMESH_DEB:-}" ]]; then
    KVMESH_DEB=$(scripts/package-deb.sh "$@" | tail -1)
fi
deb=$KVMESH_DEB
if [[ $(id -u) -ne 0 ]]; then
    # The package is built as this user; the install part runs as root.
    exec sudo -n env CI="${CI:-}" KVMESH_DEB="$deb" bash "$0"
fi
echo "== package: $deb ($(du -h "$deb" | cut -f1))" >&2
dpkg-deb --info "$deb" | sed -n 's/^ \(Package\|Version\|Depends\):/  \1:/p' >&2

pid=""
cleanup() {
    if [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null; then
        kill -KILL "$pid" || true
    fi
    # Whatever still runs as the package's user would keep it from being
    # removed.
    local uid
    uid=$(id -u kvmesh 2>/dev/null) || uid=""
    if [[ -n "$uid" ]]; then
        for st in /proc/[0-9]*/status; do
            if awk -v u="$uid" '$1 == "Uid:" && $2 == u { found = 1 } END { exit !found }' "$st" 2>/dev/null; then
                p=${st#/proc/}
                kill -KILL "${p%/status}" 2>/dev/null || true
            fi
        done
        sleep 0.2
    fi
    dpkg --purge kvmesh >/dev/null 2>&1 || true
    rm -rf /run/kvmesh
}
trap cleanup EXIT

fail() {
    echo "deb test: $*" >&2
    [[ -f /tmp/kvmesh-deb-test.log ]] && tail -20 /tmp/kvmesh-deb-test.log >&2
    exit 1
}

dpkg -i "$deb" >/dev/null || fail "dpkg -i failed"
[[ -x /usr/bin/kvmeshd && -x /usr/bin/kvmesh ]] || fail "binaries not installed"
[[ -f /etc/kvmesh/kvmeshd.toml ]] || fail "config not installed"
[[ -f /lib/systemd/system/kvmeshd.service ]] || fail "unit not installed"
getent passwd kvmesh >/dev/null || fail "no kvmesh user"
[[ $(stat -c %U /var/lib/kvmesh) == kvmesh ]] || fail "/var/lib/kvmesh is not the kvmesh user's"
grep -q '^User=kvmesh' /lib/systemd/system/kvmeshd.service || fail "the unit does not run as kvmesh"
if command -v systemd-analyze >/dev/null; then
    systemd-analyze verify /lib/systemd/system/kvmeshd.service || fail "systemd-analyze verify failed"
fi
/usr/bin/kvmeshd --config /etc/kvmesh/kvmeshd.toml --check-config >/dev/null || fail "installed config rejected"

# What the unit's RuntimeDirectory= would make, then the daemon as the unit
# runs it (systemd itself is not running on test machines: that part is
# `systemd-analyze verify` above).
python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 9433))' 2>/dev/null \
    || fail "port 9433 (the installed config's metrics port) is in use on this machine"
install -d -o kvmesh -g kvmesh -m 0700 /run/kvmesh
as_kvmesh() { setpriv --reuid=kvmesh --regid=kvmesh --init-groups -- "$@"; }
# setpriv execs (no fork): $! is the daemon itself.
setpriv --reuid=kvmesh --regid=kvmesh --init-groups -- /usr/bin/kvmeshd --config /etc/kvmesh/kvmeshd.toml \
    2>/tmp/kvmesh-deb-test.log &
pid=$!
for _ in $(seq 1 200); do
    test -S /run/kvmesh/kvmeshd.sock && break
    sleep 0.05
done
test -S /run/kvmesh/kvmeshd.sock || fail "the installed daemon did not bind /run/kvmesh/kvmeshd.sock"
# The daemon runs as kvmesh.
[[ $(stat -c %U "/proc/$pid") == kvmesh ]] || fail "the daemon does not run as the kvmesh user"

cli() { as_kvmesh /usr/bin/kvmesh --socket /run/kvmesh/kvmeshd.sock "$@"; }
block=$(mktemp)
head -c 4096 /dev/urandom > "$block"
chmod 0644 "$block"
key=0123456789abcdef0123456789abcdef
cli put --namespace deb --block-size 4096 "$key" "$block" >/dev/null || fail "put through the installed CLI"
cli get --namespace deb "$key" "/tmp/kvmesh-deb-get" >/dev/null || fail "get through the installed CLI"
cmp "$block" /tmp/kvmesh-deb-get || fail "the block read back differs"
rm -f /tmp/kvmesh-deb-get "$block"
cli stats --json | python3 -c 'import json,sys; s=json.load(sys.stdin); assert s["commits"]==1 and s["hits"]>=1, s' \
    || fail "stats after the put and get"
python3 - <<'EOF' || fail "/metrics"
import urllib.request
t = urllib.request.urlopen("http://127.0.0.1:9433/metrics", timeout=5).read().decode()
assert "kvmesh_commits_total 1" in t, t[:2000]
EOF
# Another user cannot reach the socket (directory 0700, socket 0600).
if getent passwd nobody >/dev/null; then
    if setpriv --reuid=nobody --regid=nogroup --clear-groups -- /usr/bin/kvmesh --socket /run/kvmesh/kvmeshd.sock stats >/dev/null 2>&1; then
        fail "another user reached the daemon's socket"
    fi
fi

# Stop = drain.
kill -TERM "$pid"
rc=0
wait "$pid" || rc=$?
pid=""
[[ $rc -eq 0 ]] || fail "the daemon exited $rc after SIGTERM"
grep -q "drained in" /tmp/kvmesh-deb-test.log || fail "no drain in the log"
test -e /run/kvmesh/kvmeshd.sock && fail "socket left behind"

dpkg --purge kvmesh >/dev/null || fail "dpkg --purge failed"
[[ ! -e /usr/bin/kvmeshd && ! -e /etc/kvmesh/kvmeshd.toml && ! -e /var/lib/kvmesh ]] || fail "files left after purge"
getent passwd kvmesh >/dev/null && fail "kvmesh user left after purge"
rm -f /tmp/kvmesh-deb-test.log
echo "deb test: installed, served a put and a get as the kvmesh user, drained, purged" >&2
