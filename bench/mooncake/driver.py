#!/usr/bin/env python3
"""Mooncake Store read benchmark driver (TCP transport, loopback only).

Run it with the interpreter of the venv made by bench/mooncake/setup.sh:

    "$(bench/mooncake/setup.sh)"/bin/python bench/mooncake/driver.py

Layout (everything on 127.0.0.1):
  * a mooncake_master child process (free ports picked here),
  * a "holder" child process (this file, --role holder): a store client
    that mounts a segment and puts the benchmark blocks into it,
  * this process as the "reader": a store client that mounts no segment
    and reads the blocks from the holder's segment over the TCP transport
    with get_into (batch 1) / batch_get_into (batch > 1) into a registered
    buffer.

Protocol (stdout carries JSON lines only; logs go to stderr):
  first line  {"ready":true,"version":"<mooncake package version>",...}
  stdin       run <block_bytes> <batch> <samples>  -> one JSON result line
              quit                                  -> exits (also EOF,
                                                       SIGTERM, SIGINT, SIGHUP)
  on failure  {"error":"..."} (fatal ones exit non-zero, after killing the
              master and the holder)
"""

import argparse
import collections
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

SYSTEM = "mooncake-tcp"
KEY_PREFIX = "kvmesh-bench"
MIB = 1 << 20
PR_SET_PDEATHSIG = 1

# The protocol channel: a private copy of the original stdout. fd 1 itself is
# pointed at stderr so that anything the native libraries print cannot mix
# with the JSON lines.
_proto = None


def _claim_stdout():
    global _proto
    if _proto is None:
        _proto = os.fdopen(os.dup(1), "w", buffering=1)
        sys.stdout.flush()
        os.dup2(2, 1)
    return _proto


def emit(obj):
    out = _claim_stdout()
    out.write(json.dumps(obj, separators=(",", ":")) + "\n")
    out.flush()


def log(*args):
    # One write per line so it does not interleave with the children's logs.
    sys.stderr.write("[mooncake-driver] " + " ".join(str(a) for a in args) + "\n")
    sys.stderr.flush()


def die_with_parent(expected_ppid):
    """Ask the kernel to SIGKILL us when our parent exits (Linux only)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except Exception:  # not Linux, or no prctl: rely on stdin EOF / kills
        return
    if expected_ppid and os.getppid() != expected_ppid:
        os._exit(1)  # parent already gone before prctl took effect


def mooncake_version():
    try:
        from importlib import metadata
    except ImportError:
        return "unknown"
    names = []
    for dist in metadata.distributions():
        name = (dist.metadata.get("Name") or "").lower()
        if name.startswith("mooncake-transfer-engine") or name == "mooncake":
            names.append((name, dist.version))
    if not names:
        return "unknown"
    names.sort()
    return names[0][1]


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env():
    env = dict(os.environ)
    # Features that would serve reads from a local copy instead of the
    # holder's segment: keep them off whatever the caller's environment says.
    for k in list(env):
        if k.startswith("MC_STORE_LOCAL_HOT"):
            del env[k]
    return env


# --------------------------------------------------------------------------
# Block contents: key i of size B holds P_B xor k_i, where P_B is a
# pseudo-random pattern seeded by B and k_i a per-key 64-bit word. Cheap to
# produce on both sides, position dependent and distinct per key.
# --------------------------------------------------------------------------

_patterns = {}


def base_pattern(np, block):
    p = _patterns.get(block)
    if p is None:
        words = (block + 7) // 8
        rng = np.random.default_rng(0x6B766D657368 ^ block)
        p = rng.integers(0, 2**63, size=words, dtype=np.uint64)
        p ^= rng.integers(0, 2**63, size=words, dtype=np.uint64) << np.uint64(1)
        _patterns.clear()  # keep one block size around
        _patterns[block] = p
    return p


def key_word(i):
    # splitmix64 of the key index
    z = (i + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return z ^ (z >> 31)


def expected_block(np, block, i):
    return (base_pattern(np, block) ^ np.uint64(key_word(i))).view(np.uint8)[:block]


def count_wrong(np, got, block, i):
    """Number of bytes of `got` (uint8 view, len block) that differ."""
    if block % 8 == 0:
        d = got.view(np.uint64) ^ base_pattern(np, block)
        d ^= np.uint64(key_word(i))
        if not d.any():
            return 0
        return int(np.count_nonzero(d.view(np.uint8)))
    return int(np.count_nonzero(got != expected_block(np, block, i)))


def block_key(block, i):
    return "%s/%d/%d" % (KEY_PREFIX, block, i)


def import_store():
    from mooncake.store import MooncakeDistributedStore, ReplicateConfig  # noqa

    return MooncakeDistributedStore, ReplicateConfig


# --------------------------------------------------------------------------
# Holder role
# --------------------------------------------------------------------------


def holder_main(args):
    proto = _claim_stdout()
    die_with_parent(args.parent_pid)

    def reply(obj):
        proto.write(json.dumps(obj, separators=(",", ":")) + "\n")
        proto.flush()

    try:
        import numpy as np

        Store, ReplicateConfig = import_store()
    except Exception as e:  # noqa
        reply({"error": "holder: cannot import mooncake.store/numpy: %s" % e})
        return 1

    store = Store()
    seg = args.segment_mib * MIB
    rc = store.setup("127.0.0.1", args.metadata, seg, args.local_buffer_mib * MIB,
                     "tcp", "", args.master)
    if rc != 0:
        reply({"error": "holder: store.setup failed with code %d" % rc})
        return 1
    me = store.get_hostname()
    cfg = ReplicateConfig()
    cfg.replica_num = 1
    cfg.preferred_segment = me
    cfg.with_hard_pin = True  # never evicted; removed explicitly
    staging_box = []

    def stage(block):
        """Registered staging buffer that holds at least one block."""
        import mmap

        want = max(block, 64 * MIB)
        if staging_box and staging_box[0][1].size >= block:
            return staging_box[0][1]
        if staging_box:
            old_mm, old_arr = staging_box.pop()
            store.unregister_buffer(old_arr.ctypes.data)
            del old_arr
            old_mm.close()
        mm = mmap.mmap(-1, want)
        arr = np.frombuffer(mm, dtype=np.uint8)
        arr[:] = 0
        rc = store.register_buffer(arr.ctypes.data, want)
        if rc != 0:
            raise RuntimeError("holder: register_buffer(%d) failed with code %d" % (want, rc))
        staging_box.append((mm, arr))
        return arr

    reply({"ready": True, "hostname": me, "segment_bytes": seg})

    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        try:
            cmd = json.loads(line)
        except ValueError:
            reply({"error": "holder: bad command %r" % line})
            continue
        op = cmd.get("op")
        if op == "quit":
            break
        if op == "fill":
            block, n = int(cmd["block"]), int(cmd["n"])
            t0 = time.monotonic()
            staging = stage(block)
            per = max(1, min(512, staging.size // block))
            bad = None
            done = 0
            while done < n and bad is None:
                m = min(per, n - done)
                keys = []
                for j in range(m):
                    staging[j * block:(j + 1) * block] = expected_block(np, block, done + j)
                    keys.append(block_key(block, done + j))
                base = staging.ctypes.data
                res = store.batch_put_from(keys, [base + j * block for j in range(m)], [block] * m, cfg)
                for k, r in zip(keys, res):
                    if r != 0:
                        bad = "holder: put %s (%d bytes) failed with code %d" % (k, block, r)
                        break
                done += m
            if bad:
                store.batch_remove([block_key(block, i) for i in range(done)], True)
                reply({"error": bad, "fill_failed": True})
                continue
            desc = store.get_replica_desc(block_key(block, 0))
            endpoints = []
            for r in desc:
                if r.is_memory_replica():
                    endpoints.append(r.get_memory_descriptor().buffer_descriptor.transport_endpoint)
            reply({"ok": True, "n": n, "secs": round(time.monotonic() - t0, 3),
                   "endpoints": endpoints})
        elif op == "remove":
            block, n = int(cmd["block"]), int(cmd["n"])
            res = store.batch_remove([block_key(block, i) for i in range(n)], True)
            failed = [r for r in res if r != 0]
            reply({"ok": not failed, "failed": len(failed)})
        else:
            reply({"error": "holder: unknown op %r" % op})
    try:
        store.close()
    except Exception:
        pass
    sys.stderr.flush()
    os._exit(0)


# --------------------------------------------------------------------------
# Driver / reader role
# --------------------------------------------------------------------------


class Fatal(Exception):
    pass


class Child:
    """A child process whose stderr (and stdout unless piped for protocol)
    is copied to our stderr with a prefix, keeping the last lines."""

    def __init__(self, name, argv, proto=False):
        self.name = name
        self.tail = collections.deque(maxlen=40)
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE if proto else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=child_env(),
            start_new_session=True,
            close_fds=True,
        )
        self.proto = proto
        self._threads = [threading.Thread(target=self._pump, args=(self.proc.stderr,), daemon=True)]
        if not proto:
            self._threads.append(threading.Thread(target=self._pump, args=(self.proc.stdout,), daemon=True))
        for t in self._threads:
            t.start()

    def _pump(self, f):
        for raw in iter(f.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\n")
            self.tail.append(line)
            try:
                sys.stderr.write("[%s] %s\n" % (self.name, line))
                sys.stderr.flush()
            except Exception:
                pass

    def alive(self):
        return self.proc.poll() is None

    def last_lines(self, n=5):
        return " | ".join(list(self.tail)[-n:])

    def send(self, obj, timeout):
        if not self.alive():
            raise Fatal("%s exited (rc=%s): %s" % (self.name, self.proc.returncode, self.last_lines()))
        try:
            self.proc.stdin.write((json.dumps(obj) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as e:
            raise Fatal("%s: cannot send command: %s" % (self.name, e))
        return self.recv(timeout)

    def recv(self, timeout):
        result = {}

        def reader():
            result["line"] = self.proc.stdout.readline()

        t = threading.Thread(target=reader, daemon=True)
        t.start()
        t.join(timeout)
        if t.is_alive():
            raise Fatal("%s: no answer within %ss: %s" % (self.name, timeout, self.last_lines()))
        line = result.get("line", b"")
        if not line:
            self.proc.wait(timeout=5)
            raise Fatal("%s exited (rc=%s): %s" % (self.name, self.proc.returncode, self.last_lines()))
        try:
            return json.loads(line)
        except ValueError:
            raise Fatal("%s: bad reply %r" % (self.name, line[:200]))

    def stop(self, grace):
        p = self.proc
        if p.poll() is None:
            if self.proto:
                try:
                    p.stdin.write(b'{"op":"quit"}\n')
                    p.stdin.flush()
                    p.stdin.close()
                except Exception:
                    pass
                try:
                    p.wait(timeout=grace)
                except subprocess.TimeoutExpired:
                    pass
            # Then SIGTERM, then SIGKILL, to the whole process group.
            for sig, fallback, wait in ((signal.SIGTERM, p.terminate, grace), (signal.SIGKILL, p.kill, 10)):
                if p.poll() is not None:
                    break
                try:
                    os.killpg(p.pid, sig)
                except (ProcessLookupError, PermissionError):
                    fallback()
                try:
                    p.wait(timeout=wait)
                except subprocess.TimeoutExpired:
                    pass
        # A process group may outlive its leader; sweep it.
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def on_server_cpus(argv):
    """argv run under taskset on the serving side's CPUs when the bench
    splits them (`kvmesh-bench peers --split-cpus SERVER:CLIENT`)."""
    cpus = os.environ.get("KVMESH_PEERS_SERVER_CPUS")
    if not cpus:
        return list(argv)
    taskset = shutil.which("taskset")
    if not taskset:
        raise Fatal("KVMESH_PEERS_SERVER_CPUS is set but taskset (util-linux) is not installed")
    return [taskset, "--cpu-list", cpus] + list(argv)


def pdeathsig_launcher(argv):
    """argv prefixed with a tiny python launcher that sets PR_SET_PDEATHSIG
    and then execs argv (so the master dies with us even on SIGKILL)."""
    code = (
        "import ctypes,os,signal,sys\n"
        "try:\n"
        "    ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)\n"
        "except Exception:\n"
        "    pass\n"
        "if os.getppid() != int(sys.argv[1]):\n"
        "    os._exit(1)\n"
        "os.execv(sys.argv[2], sys.argv[2:])\n"
    )
    return [sys.executable, "-c", code, str(os.getpid())] + list(argv)


def find_master_binary():
    try:
        import mooncake

        cand = os.path.join(os.path.dirname(os.path.abspath(mooncake.__file__)), "mooncake_master")
        if os.path.isfile(cand):
            if not os.access(cand, os.X_OK):
                os.chmod(cand, os.stat(cand).st_mode | 0o111)
            return cand
    except Exception:
        pass
    cand = os.path.join(os.path.dirname(sys.executable), "mooncake_master")
    if os.path.isfile(cand):
        return cand
    return None


def wait_port(port, child, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not child.alive():
            return False
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return True
        except OSError:
            time.sleep(0.1)
    return False


class Bench:
    def __init__(self, args):
        self.args = args
        self.master = None
        self.holder = None
        self.store = None
        self.np = None
        self.filled = None  # (block, n)
        self.cursor = 0
        self.buf = None  # (mmap, ndarray, size)
        self.holder_endpoints = []

    # ---- setup ---------------------------------------------------------
    def start(self):
        a = self.args
        binary = a.master_binary or find_master_binary()
        if not binary:
            raise Fatal("mooncake_master executable not found in the mooncake package")
        if not (os.path.isfile(binary) and os.access(binary, os.X_OK)):
            raise Fatal("mooncake_master %s is not an executable file" % binary)
        last = ""
        for attempt in range(3):
            rpc, metrics, http = free_port(), free_port(), free_port()
            argv = [binary,
                    "--rpc_address=127.0.0.1", "--rpc_port=%d" % rpc,
                    "--metrics_host=127.0.0.1", "--metrics_port=%d" % metrics,
                    "--enable_metric_reporting=false",
                    "--rpc_thread_num=%d" % a.master_threads]
            if a.metadata == "http":
                argv += ["--enable_http_metadata_server=true",
                         "--http_metadata_server_host=127.0.0.1",
                         "--http_metadata_server_port=%d" % http]
            log("starting master:", " ".join(argv))
            self.master = Child("master", pdeathsig_launcher(on_server_cpus(argv)))
            ok = wait_port(rpc, self.master, a.start_timeout)
            if ok and a.metadata == "http":
                ok = wait_port(http, self.master, a.start_timeout)
            if ok:
                break
            last = "master did not come up (rc=%s): %s" % (self.master.proc.poll(), self.master.last_lines())
            log(last)
            self.master.stop(2)
            self.master = None
        if self.master is None:
            raise Fatal(last)
        self.master_addr = "127.0.0.1:%d" % rpc
        self.metadata = "P2PHANDSHAKE" if a.metadata == "p2p" else "http://127.0.0.1:%d/metadata" % http

        argv = [sys.executable, os.path.abspath(__file__), "--role", "holder",
                "--parent-pid", str(os.getpid()),
                "--master", self.master_addr, "--metadata-url", self.metadata,
                "--segment-mib", str(a.segment_mib),
                "--local-buffer-mib", str(a.local_buffer_mib)]
        if a.verbose:
            argv.append("--verbose")
        self.holder = Child("holder", on_server_cpus(argv), proto=True)
        r = self.holder.recv(a.start_timeout)
        if not r.get("ready"):
            raise Fatal(r.get("error") or "holder failed to start: %r" % r)
        self.holder_name = r["hostname"]
        log("holder up as", self.holder_name)

        import numpy as np

        Store, _ = import_store()
        self.np = np
        self.store = Store()
        # Mount no segment here: every block must live in the holder.
        rc = self.store.setup("127.0.0.1", self.metadata, 0, a.local_buffer_mib * MIB,
                              "tcp", "", self.master_addr)
        if rc != 0:
            raise Fatal("reader: store.setup failed with code %d" % rc)
        self.reader_name = self.store.get_hostname()
        log("reader up as", self.reader_name)

    # ---- data ----------------------------------------------------------
    def ensure_filled(self, block, batch):
        a = self.args
        n = max(-(-a.fill_mib * MIB // block), batch)
        if self.filled and self.filled[0] == block and self.filled[1] >= n:
            return self.filled[1]
        usable = int(a.segment_mib * MIB * 0.85)
        if n * block > usable:
            raise ValueError("need %d blocks of %d bytes (%.0f MiB) but the holder segment "
                             "allows %.0f MiB; raise --segment-mib or lower the batch"
                             % (n, block, n * block / MIB, usable / MIB))
        if self.filled:
            old_b, old_n = self.filled
            r = self.holder.send({"op": "remove", "block": old_b, "n": old_n}, a.op_timeout)
            if not r.get("ok"):
                log("warning: removing %d-byte blocks: %r" % (old_b, r))
            self.filled = None
        log("filling %d blocks of %d bytes (%.0f MiB) in the holder" % (n, block, n * block / MIB))
        r = self.holder.send({"op": "fill", "block": block, "n": n}, a.op_timeout)
        if r.get("fill_failed"):
            raise ValueError(r.get("error"))
        if not r.get("ok"):
            raise Fatal(r.get("error") or "fill failed: %r" % r)
        self.holder_endpoints = r.get("endpoints", [])
        log("filled in %ss; replica endpoints %s" % (r.get("secs"), self.holder_endpoints))
        # Check from the reader side that the data sits in the holder's segment.
        probe = self.store.get_replica_desc(block_key(block, n - 1))
        eps = [d.get_memory_descriptor().buffer_descriptor.transport_endpoint
               for d in probe if d.is_memory_replica()]
        if not eps or any(e not in self.holder_endpoints for e in eps):
            raise Fatal("replica placement unexpected: %s vs holder %s" % (eps, self.holder_endpoints))
        self.filled = (block, n)
        self.cursor = 0
        return n

    def dest(self, size):
        np = self.np
        if self.buf is not None and self.buf[2] >= size:
            return self.buf[1]
        import mmap

        if self.buf is not None:
            old_mm, old_arr, _ = self.buf
            self.store.unregister_buffer(old_arr.ctypes.data)
            self.buf = None
            del old_arr
            old_mm.close()
        cap = max(size, 64 * MIB)
        mm = mmap.mmap(-1, cap)
        arr = np.frombuffer(mm, dtype=np.uint8)
        arr[:] = 0  # fault the pages in before registering
        rc = self.store.register_buffer(arr.ctypes.data, cap)
        if rc != 0:
            raise Fatal("register_buffer(%d bytes) failed with code %d" % (cap, rc))
        self.buf = (mm, arr, cap)
        return arr

    # ---- benchmark -----------------------------------------------------
    def run(self, block, batch, samples):
        np = self.np
        n = self.ensure_filled(block, batch)
        buf = self.dest(block * batch)
        base = buf.ctypes.data
        ptrs = [base + j * block for j in range(batch)]
        sizes = [block] * batch
        views = [buf[j * block:(j + 1) * block] for j in range(batch)]
        region = buf[:block * batch]
        store = self.store
        clock = time.perf_counter_ns

        lat = []
        wrong = 0
        errors = 0
        for c in range(self.args.warmup + samples):
            idx = [(self.cursor + j) % n for j in range(batch)]
            self.cursor = (self.cursor + batch) % n
            keys = [block_key(block, i) for i in idx]
            region.fill(0)
            if batch == 1:
                t0 = clock()
                r = store.get_into(keys[0], base, block)
                t1 = clock()
                res = [r]
            else:
                t0 = clock()
                res = store.batch_get_into(keys, ptrs, sizes)
                t1 = clock()
            if c < self.args.warmup:
                continue
            lat.append(t1 - t0)
            for j, i in enumerate(idx):
                if res[j] != block:
                    errors += 1
                wrong += count_wrong(np, views[j], block, i)
        total_ns = sum(lat)
        moved = samples * batch * block
        lat_us = np.array(lat, dtype=np.float64) / 1e3
        return {
            "system": SYSTEM,
            "block_bytes": block,
            "batch": batch,
            "gbps": round(moved / (total_ns / 1e9) / 1e9, 4) if total_ns else 0.0,
            "p50_us": round(float(np.percentile(lat_us, 50)), 2),
            "p99_us": round(float(np.percentile(lat_us, 99)), 2),
            "samples": samples,
            "wrong": wrong,
            "errors": errors,
            # Every timed call, so a caller merges rounds into one histogram.
            "lat_us": [round(float(x), 1) for x in lat_us],
        }

    def check_children(self):
        for ch in (self.master, self.holder):
            if ch is not None and not ch.alive():
                raise Fatal("%s exited (rc=%s): %s" % (ch.name, ch.proc.returncode, ch.last_lines()))

    # ---- teardown ------------------------------------------------------
    def stop(self):
        t0 = time.monotonic()
        if self.store is not None:
            store, self.store = self.store, None
            try:
                if self.buf is not None:
                    store.unregister_buffer(self.buf[1].ctypes.data)
            except Exception:
                pass
            done = threading.Event()

            def close():
                try:
                    store.close()
                except Exception:
                    pass
                done.set()

            threading.Thread(target=close, daemon=True).start()
            if not done.wait(10):
                log("warning: reader store.close() did not return in 10s")
            log("reader closed after %.1fs" % (time.monotonic() - t0))
        for ch in (self.holder, self.master):
            if ch is not None:
                try:
                    ch.stop(5)
                    log("%s stopped after %.1fs (rc=%s)" % (ch.name, time.monotonic() - t0, ch.proc.returncode))
                except Exception as e:
                    log("warning: stopping %s: %s" % (ch.name, e))
        self.holder = self.master = None


def parse_run(parts):
    if len(parts) != 4:
        raise ValueError("usage: run <block_bytes> <batch> <samples>")
    block, batch, samples = (int(x) for x in parts[1:])
    if block <= 0 or batch <= 0 or samples <= 0:
        raise ValueError("block_bytes, batch and samples must be positive")
    return block, batch, samples


def driver_main(args):
    _claim_stdout()
    try:
        import numpy  # noqa: F401

        import_store()
    except Exception as e:
        emit({"error": "cannot import mooncake.store / numpy (%s: %s); run bench/mooncake/setup.sh "
                       "and start this driver with that venv's python" % (type(e).__name__, e)})
        return 2

    def on_signal(signum, _frame):
        raise SystemExit(128 + signum)

    for s in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, on_signal)

    bench = Bench(args)
    code = 0
    try:
        bench.start()
        emit({"ready": True, "version": mooncake_version(), "system": SYSTEM,
              "metadata": bench.metadata, "master": bench.master_addr,
              "holder": bench.holder_name, "reader": bench.reader_name})
        for line in sys.stdin:
            parts = line.split()
            if not parts or parts[0].startswith("#"):
                continue
            if parts[0] in ("quit", "exit"):
                break
            if parts[0] != "run":
                emit({"error": "unknown command %r (expected: run <block_bytes> <batch> <samples> | quit)"
                               % parts[0]})
                continue
            try:
                block, batch, samples = parse_run(parts)
            except ValueError as e:
                emit({"error": str(e)})
                continue
            bench.check_children()
            try:
                emit(bench.run(block, batch, samples))
            except ValueError as e:
                emit({"error": str(e), "block_bytes": block, "batch": batch})
            bench.check_children()
    except Fatal as e:
        emit({"error": str(e)})
        code = 1
    except KeyboardInterrupt:
        code = 130
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except Exception as e:  # unexpected: report, still clean up
        import traceback

        traceback.print_exc()
        emit({"error": "%s: %s" % (type(e).__name__, e)})
        code = 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        bench.stop()
        log("bye")
    return code


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--role", choices=("driver", "holder"), default="driver", help=argparse.SUPPRESS)
    ap.add_argument("--parent-pid", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--master", help=argparse.SUPPRESS)
    ap.add_argument("--metadata-url", help=argparse.SUPPRESS)
    ap.add_argument("--metadata", choices=("p2p", "http"), default="p2p",
                    help="transfer-engine metadata: P2PHANDSHAKE (default) or the master's "
                         "embedded HTTP metadata server")
    ap.add_argument("--segment-mib", type=int, default=1024,
                    help="holder segment size in MiB (default 1024)")
    ap.add_argument("--fill-mib", type=int, default=320,
                    help="bytes of distinct blocks put per block size, in MiB (default 320; > L3)")
    ap.add_argument("--local-buffer-mib", type=int, default=16,
                    help="store local_buffer_size of each client in MiB (default 16)")
    ap.add_argument("--warmup", type=int, default=2,
                    help="untimed calls before the timed ones of each run (default 2)")
    ap.add_argument("--master-binary", help="mooncake_master to run (default: the one in the package)")
    ap.add_argument("--master-threads", type=int, default=2, help="master rpc_thread_num (default 2)")
    ap.add_argument("--start-timeout", type=float, default=60, help="seconds for master/holder start")
    ap.add_argument("--op-timeout", type=float, default=600, help="seconds for one holder fill/remove")
    ap.add_argument("--verbose", action="store_true", help="keep Mooncake INFO logs (stderr)")
    args = ap.parse_args()

    if not args.verbose:
        # Mooncake reads MC_LOG_LEVEL (transfer engine) and glog GLOG_* when
        # it loads: set both before importing it; children inherit them.
        os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
        os.environ.setdefault("GLOG_minloglevel", "1")
    if args.role == "holder":
        args.metadata = args.metadata_url
        return holder_main(args)
    return driver_main(args)


if __name__ == "__main__":
    sys.exit(main())
