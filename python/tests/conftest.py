"""A real kvmeshd per test module, on a private socket.

The daemon binary: $KVMESHD, else target/debug/kvmeshd, else
target/release/kvmeshd of this repository (scripts/test.sh builds it).
"""

import os
import pathlib
import shutil
import socket as _socket
import subprocess
import tempfile
import time

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


def kvmeshd_binary() -> str:
    env = os.environ.get("KVMESHD")
    if env:
        return env
    for profile in ("debug", "release"):
        p = REPO / "target" / profile / "kvmeshd"
        if p.exists():
            return str(p)
    pytest.fail("no kvmeshd binary: build it (cargo build -p kvmeshd) or set KVMESHD")


class Daemon:
    def __init__(self, pool_bytes: str = "32MiB", slot: str = "64KiB", extra: str = ""):
        self.dir = tempfile.mkdtemp(prefix="kvmesh-pytest-")
        self.socket = os.path.join(self.dir, "kvmeshd.sock")
        cfg = os.path.join(self.dir, "kvmeshd.toml")
        with open(cfg, "w") as f:
            f.write(
                f'[server]\nsocket = "{self.socket}"\n[metrics]\nlisten = ""\n'
                f'[[pools]]\nname = "host0"\nbytes = "{pool_bytes}"\nslot_payload_bytes = "{slot}"\nmlock = false\n'
                f"{extra}"
            )
        self.log = open(os.path.join(self.dir, "kvmeshd.log"), "w")
        self.proc = subprocess.Popen([kvmeshd_binary(), "--config", cfg], stdout=subprocess.DEVNULL, stderr=self.log)
        deadline = time.time() + 20
        while True:
            try:
                s = _socket.socket(_socket.AF_UNIX)
                s.connect(self.socket)
                s.close()
                break
            except OSError:
                if time.time() > deadline or self.proc.poll() is not None:
                    raise RuntimeError("kvmeshd did not come up: " + open(self.log.name).read())
                time.sleep(0.02)

    def stop(self):
        self.proc.kill()
        self.proc.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def daemon():
    d = Daemon()
    yield d
    d.stop()


@pytest.fixture
def small_daemon():
    """A pool of 16 slots of 64 KiB, for pressure tests."""
    d = Daemon(pool_bytes="1MiB", slot="64KiB")
    yield d
    d.stop()


@pytest.fixture
def client(daemon):
    import kvmesh

    c = kvmesh.Client(daemon.socket)
    yield c
    c.close()
