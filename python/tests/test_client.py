"""The kvmesh Python package against a real kvmeshd."""

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import kvmesh
from kvmesh.aio import AsyncClient

BS = 65536


def rand_blocks(n, size=BS):
    return [os.urandom(size) for _ in range(n)]


def fresh_keys(n):
    """Keys no other test uses (random 16 bytes)."""
    return [os.urandom(16) for _ in range(n)]


def wait_for(pred, timeout=10.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return pred()


@pytest.fixture
def ns(client):
    return client.register_namespace("pytest", BS, "layout=pytest")


def test_round_trip_of_random_blocks_in_every_key_form(client, ns):
    blocks = rand_blocks(6)
    raw = fresh_keys(6)
    forms = [raw[0], int.from_bytes(raw[1], "big"), raw[2].hex(), raw[3], raw[4].hex().upper(), raw[5]]
    s = client.put(ns, zip(forms, blocks))
    assert s.stored == 6 and s.existed == 0, s
    assert client.put(ns, zip(raw, blocks)).existed == 6
    assert client.lookup(ns, raw) == 6
    assert client.lookup("pytest", forms) == 6, "namespace by name, keys in any form"
    # Where: a single daemon answers from its own copies, with its node id.
    loc = client.locate(ns, raw[:2] + fresh_keys(1) + raw[2:3])
    assert loc.prefix_len == 2 and not loc.cluster_wide and loc.complete, loc
    assert loc.nodes[2] is None and loc.nodes[0] == loc.nodes[1] == loc.nodes[3] is not None, loc
    assert client.locate(ns, raw, local_only=True).prefix_len == 6
    with client.pin(ns, raw) as batch:
        assert len(batch) == 6 and batch.hits == 6
        assert batch.keys == raw
        for i, b in enumerate(blocks):
            view = batch[i]
            assert view.readonly and view.nbytes == BS
            assert view == b
            batch.verify(i)
    # get_into: bytearray, numpy array, memoryview slice of a larger buffer.
    out = bytearray(6 * BS)
    assert client.get_into(ns, raw, out) == [True] * 6
    assert bytes(out) == b"".join(blocks)
    arr = np.zeros(6 * BS, dtype=np.uint8)
    assert all(client.get_into(ns, raw, arr))
    assert arr.tobytes() == b"".join(blocks)
    big = bytearray(8 * BS)
    assert all(client.get_into(ns, raw[:2], memoryview(big)[BS : 3 * BS]))
    assert bytes(big[BS : 3 * BS]) == blocks[0] + blocks[1]
    # numpy blocks as input (read in place, no copy made by the wrapper).
    k = fresh_keys(1)
    src = np.frombuffer(os.urandom(BS), dtype=np.uint8).copy()
    assert client.put(ns, [(k[0], src)]).stored == 1
    one = bytearray(BS)
    client.get_into(ns, k, one)
    assert bytes(one) == src.tobytes()


def test_misses_are_not_errors(client, ns):
    raw = fresh_keys(4)
    blocks = rand_blocks(4)
    client.put(ns, [(raw[0], blocks[0]), (raw[1], blocks[1]), (raw[3], blocks[3])])
    assert client.lookup(ns, raw) == 2
    assert client.contains(ns, raw) == [True, True, False, True]
    with client.pin(ns, raw) as b:
        assert b.present == [True, True, False, True]
        assert b[2] is None and b[3] == blocks[3]
        with pytest.raises(kvmesh.Miss):
            b.verify(2)
    with client.pin(ns, raw, stop_at_first_miss=True) as b:
        assert b.present == [True, True, False, False]
    buf = bytearray(b"\xab" * (4 * BS))
    assert client.get_into(ns, raw, buf) == [True, True, False, True]
    assert buf[2 * BS : 3 * BS] == b"\xab" * BS, "a miss leaves the destination untouched"


def test_zero_copy_views_share_the_pool_across_clients(daemon, client, ns):
    """Write a block in place through one client's allocation view, read it
    in place through another client's pin; two pins of a key in one client
    are views of the same pool address."""
    other = kvmesh.Client(daemon.socket)
    try:
        k = fresh_keys(1)
        payload = np.frombuffer(os.urandom(BS), dtype=np.uint8)
        with client.allocate(ns, k) as a:
            assert a.status == ["allocated"]
            view = a[0]
            w = np.frombuffer(view, dtype=np.uint8)  # writable numpy array over the slot
            w[:] = payload
            del w
            view.release()
            assert a.commit() == ["stored"]
        with other.pin(ns, k) as b1, other.pin(ns, k) as b2:
            v1 = np.frombuffer(b1[0], dtype=np.uint8)
            v2 = np.frombuffer(b2[0], dtype=np.uint8)
            assert v1.__array_interface__["data"][0] == v2.__array_interface__["data"][0]
            assert not v1.flags.writeable
            assert np.array_equal(v1, payload)
            del v1, v2
    finally:
        other.close()


def test_pressure_errors_and_eviction(small_daemon):
    c = kvmesh.Client(small_daemon.socket)
    ns = c.register_namespace("pressure", BS, "x")
    slots = c.stats()["pools"][0]["slots"]
    assert slots >= 4
    keys = fresh_keys(slots)
    assert c.put(ns, zip(keys, rand_blocks(slots))).stored == slots
    with c.pin(ns, keys) as pinned:
        assert pinned.hits == slots
        with pytest.raises(kvmesh.ResourceExhausted) as e:
            c.put(ns, [(fresh_keys(1)[0], os.urandom(BS))])
        assert "pinned" in str(e.value)
        with pytest.raises(kvmesh.ResourceExhausted):
            c.allocate(ns, fresh_keys(1))
    # Unpinned: new puts evict old blocks instead of failing.
    more = fresh_keys(slots)
    assert c.put(ns, zip(more, rand_blocks(slots))).stored == slots
    assert c.lookup(ns, more) == slots
    assert not any(c.contains(ns, keys[:1])) or c.stats()["evictions"] > 0
    assert c.stats()["evictions"] >= slots - 1
    c.close()


CHILD = r"""
import os, sys, time, kvmesh
c = kvmesh.Client(sys.argv[1])
ns = c.register_namespace("pytest", 65536, "layout=pytest")
keys = [os.urandom(16) for _ in range(4)]
c.put(ns, [(k, os.urandom(65536)) for k in keys])
batch = c.pin(ns, keys)
view = batch[0]
alloc = c.allocate(ns, [os.urandom(16) for _ in range(3)])
print("holding", flush=True)
time.sleep(600)
"""


def test_killed_process_holding_pins_leaves_nothing_behind(daemon, client):
    before = client.stats()
    child = subprocess.Popen([sys.executable, "-c", CHILD, daemon.socket], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "holding"
        during = client.stats()
        assert during["pins_outstanding"] >= before["pins_outstanding"] + 4
        assert during["allocations_outstanding"] >= before["allocations_outstanding"] + 3
        child.send_signal(signal.SIGKILL)
        child.wait()
    finally:
        if child.poll() is None:
            child.kill()
    assert wait_for(
        lambda: client.stats()["pins_outstanding"] == before["pins_outstanding"]
        and client.stats()["allocations_outstanding"] == before["allocations_outstanding"]
        and client.stats()["sessions"] == before["sessions"]
    ), client.stats()


def test_bad_input_of_every_argument_raises_never_crashes(daemon, client, ns):
    good = fresh_keys(1)
    client.put(ns, [(good[0], os.urandom(BS))])
    with pytest.raises(kvmesh.DaemonUnavailable) as e:
        kvmesh.Client("/nonexistent/kvmesh.sock")
    assert "/nonexistent/kvmesh.sock" in str(e.value)
    with pytest.raises((TypeError, kvmesh.InvalidArgument)):
        kvmesh.Client(42)
    # keys
    for bad in ([b"short"], [-1], [2**128], ["xyz"], ["0" * 31], [1.5], [None], [object()]):
        with pytest.raises(kvmesh.InvalidArgument):
            client.lookup(ns, bad)
    for bad in (good[0], good[0].hex(), 5, None):
        with pytest.raises(kvmesh.InvalidArgument):
            client.lookup(ns, bad)
    # namespaces
    with pytest.raises(kvmesh.NotFound):
        client.lookup("no-such-namespace", good)
    with pytest.raises(kvmesh.InvalidArgument):
        client.lookup(12, good)
    with pytest.raises(kvmesh.InvalidArgument):
        client.register_namespace("pytest", BS * 2, "layout=pytest")
    with pytest.raises(kvmesh.InvalidArgument):
        client.register_namespace("", BS, "x")
    with pytest.raises(kvmesh.InvalidArgument):
        client.register_namespace("zero", 0, "x")
    with pytest.raises(OverflowError):
        client.register_namespace("neg", -1, "x")
    # buffers
    with pytest.raises(kvmesh.InvalidArgument):
        client.get_into(ns, good, bytearray(BS - 1))
    with pytest.raises(kvmesh.InvalidArgument):
        client.get_into(ns, good, bytes(BS))  # read-only
    with pytest.raises(kvmesh.InvalidArgument):
        client.get_into(ns, good, np.zeros((2, BS), dtype=np.uint8)[:, ::2])  # not contiguous
    with pytest.raises(kvmesh.InvalidArgument):
        client.get_into(ns, good, "not a buffer")
    with pytest.raises(kvmesh.InvalidArgument):
        client.put(ns, [(fresh_keys(1)[0], b"too short")])
    with pytest.raises(kvmesh.InvalidArgument):
        client.put(ns, [(fresh_keys(1)[0], 12345)])
    with pytest.raises((TypeError, ValueError)):
        client.put(ns, [b"not a pair"])
    # batches, indexes, leases
    with client.pin(ns, good) as b:
        with pytest.raises(IndexError):
            b[1]
        assert b[-1] is not None
    with pytest.raises(OverflowError):
        client.pin(ns, good, lease_ms=-5)
    with pytest.raises(kvmesh.InvalidArgument):
        client.lookup(ns, [os.urandom(16) for _ in range(client.batch_keys_max + 1)])
    # token ids
    with pytest.raises(kvmesh.InvalidArgument):
        kvmesh.prefix_keys([1, 2, 3], 0)
    with pytest.raises(OverflowError):
        kvmesh.prefix_keys([2**32], 1)
    with pytest.raises(TypeError):
        kvmesh.prefix_keys(["a"], 1)
    # The client still works after all of that.
    assert client.lookup(ns, good) == 1


def test_a_view_keeps_its_pins_after_its_batch_and_client_are_gone(daemon, client, ns):
    # The daemon releases a connection's pins when it closes: a view must
    # keep the connection of its batch open, or the slot it reads (or an
    # allocation view writes) could be reused under it.
    k = fresh_keys(1)
    blocks = rand_blocks(1)
    client.put(ns, zip(k, blocks))
    base = client.stats()["pins_outstanding"]
    other = kvmesh.Client(daemon.socket)
    b = other.pin(other.namespace("pytest"), k)
    view = b[0]
    del b
    other.close()
    del other
    assert view == blocks[0]
    time.sleep(0.2)
    assert client.stats()["pins_outstanding"] == base + 1, "the pin went with the connection"
    del view
    assert wait_for(lambda: client.stats()["pins_outstanding"] == base)


def test_use_after_release_raises_and_live_views_keep_the_pins(client, ns):
    k = fresh_keys(2)
    blocks = rand_blocks(2)
    client.put(ns, zip(k, blocks))
    base = client.stats()["pins_outstanding"]
    b = client.pin(ns, k)
    view = b[0]
    b.release()
    assert b.released
    with pytest.raises(kvmesh.Released):
        b[1]
    with pytest.raises(kvmesh.Released):
        b.verify(0)
    # The view taken before the release still reads the block: its pins stay.
    assert view == blocks[0]
    assert client.stats()["pins_outstanding"] >= base + 2
    del view
    client.pin(ns, []).release()  # carries queued unpins
    assert wait_for(lambda: client.stats()["pins_outstanding"] == base)
    b.release()  # idempotent


def test_allocation_lifecycle(client, ns):
    k = fresh_keys(3)
    client.put(ns, [(k[2], os.urandom(BS))])
    a = client.allocate(ns, k)
    assert a.status == ["allocated", "allocated", "exists"]
    assert a[2] is None
    v0 = a[0]
    v0[:] = b"\x01" * BS
    with pytest.raises(kvmesh.InvalidArgument) as e:
        a.commit()
    assert "view" in str(e.value)
    del v0
    v1 = a[1]
    v1[:4] = b"abcd"
    v1.release()
    assert a.commit() == ["stored", "stored", "exists"]
    with pytest.raises(kvmesh.Released):
        a[0]
    with pytest.raises(kvmesh.Released):
        a.commit()
    out = bytearray(2 * BS)
    assert client.get_into(ns, k[:2], out) == [True, True]
    assert out[:BS] == b"\x01" * BS and out[BS : BS + 4] == b"abcd"
    # Abort (also by the context manager): nothing stored.
    k2 = fresh_keys(2)
    with client.allocate(ns, k2) as a2:
        a2[0][:] = b"\x02" * BS
    assert client.lookup(ns, k2) == 0
    # Overwrite a cached key.
    with client.allocate(ns, k[:1], overwrite=True) as a3:
        assert a3.status == ["allocated"]
        v = a3[0]
        v[:] = b"\x03" * BS
        del v
        assert a3.commit() == ["stored"]
    client.get_into(ns, k[:1], memoryview(out)[:BS])
    assert out[:BS] == b"\x03" * BS
    s = client.put_overwrite(ns, [(k[0], b"\x04" * BS)])
    assert s.stored == 1
    client.get_into(ns, k[:1], memoryview(out)[:BS])
    assert out[:BS] == b"\x04" * BS


def test_lease_expiry_is_reported(client, ns):
    k = fresh_keys(1)
    client.put(ns, [(k[0], os.urandom(BS))])
    b = client.pin(ns, k, lease_ms=100)
    time.sleep(0.3)
    assert b.lease_remaining_ms == 0
    with pytest.raises(kvmesh.LeaseExpired):
        b[0]
    b.release()


def test_invalidate_remove_and_stats(client, ns):
    k = fresh_keys(3)
    client.put(ns, zip(k, rand_blocks(3)))
    s = client.invalidate(ns, k[:1])
    assert s.invalidated == 1 and s.failed == 0
    assert client.remove(ns, k[1:]) == [True, True]
    assert client.remove(ns, k[1:]) == [False, False]
    assert client.lookup(ns, k) == 0
    ns2 = client.register_namespace("pytest-inv", 4096, "")
    kk = fresh_keys(5)
    client.put(ns2, [(x, os.urandom(4096)) for x in kk])
    assert client.invalidate_namespace(ns2).invalidated == 5
    assert client.lookup(ns2, kk) == 0
    st = client.stats()
    assert st["pools"][0]["slots"] > 0 and st["commits"] > 0 and "pins_outstanding" in st


def test_key_derivation_is_fixed_and_independent_of_the_hash_seed():
    assert kvmesh.chain_key(None, [1, 2, 3, 4]).hex() == "03874a2e9a827a5210e073f5d377b7b9"
    k = kvmesh.prefix_keys([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    assert [x.hex() for x in k] == ["03874a2e9a827a5210e073f5d377b7b9", "7e8cd2980a866481ae4126a9ed4d27a5"]
    assert kvmesh.chain_key(k[0], [5, 6, 7, 8]) == k[1]
    assert kvmesh.chain_key(int.from_bytes(k[0], "big"), [5, 6, 7, 8]) == k[1]
    assert kvmesh.key(k[1].hex()) == k[1]
    tokens = list(range(1000, 1200))
    mine = [x.hex() for x in kvmesh.prefix_keys(tokens, 16)]
    code = "import kvmesh; print(','.join(x.hex() for x in kvmesh.prefix_keys(list(range(1000, 1200)), 16)))"
    for seed in ("0", "1", "12345", "random"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip().split(",") == mine


def test_threads_share_one_client(client, ns):
    keys = fresh_keys(16)
    blocks = rand_blocks(16)
    client.put(ns, zip(keys, blocks))
    errors = []

    def work(t):
        try:
            buf = bytearray(BS)
            for r in range(40):
                i = (t * 7 + r) % 16
                assert client.get_into(ns, keys[i : i + 1], buf) == [True]
                assert buf == blocks[i]
                with client.pin(ns, keys) as b:
                    assert b[(i + 1) % 16] == blocks[(i + 1) % 16]
                own = fresh_keys(1)
                assert client.put(ns, [(own[0], blocks[i])]).stored == 1
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_a_forked_child_cannot_use_the_parents_client(client, ns):
    """A child made by fork() shares the client's socket and its frame ids:
    were it to read, it could take the parent's answers. Its calls are
    refused at once, and the parent's client keeps working."""
    import warnings

    keys = fresh_keys(2)
    client.put(ns, zip(keys, rand_blocks(2)))
    assert client.lookup(ns, keys) == 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads running
        pid = os.fork()
    if pid == 0:
        code = 1
        try:
            client.lookup(ns, keys)
        except kvmesh.DaemonUnavailable as e:
            code = 0 if "forked" in str(e) else 2
        except BaseException:  # noqa: BLE001 - the exit code says it
            code = 3
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, status
    for _ in range(20):
        assert client.lookup(ns, keys) == 2


def test_a_forked_child_has_no_view_of_the_pool(client, ns):
    """The pool is mapped out of forked children (MADV_DONTFORK): a view
    the child inherited faults instead of reading a block the daemon may
    reuse once the parent's pins end, or writing into a slot it gave to
    another block after the parent's allocation ended. The parent's views
    keep working."""
    import faulthandler
    import signal
    import warnings

    k = fresh_keys(2)
    payload = os.urandom(BS)
    client.put(ns, [(k[0], payload)])
    with client.pin(ns, k[:1]) as pinned, client.allocate(ns, k[1:]) as alloc:
        views = {"read": pinned[0], "write": alloc[0]}
        for what, view in views.items():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads running
                pid = os.fork()
            if pid == 0:
                faulthandler.disable()  # die of the signal itself, quietly
                if what == "read":
                    _ = view[0]
                else:
                    view[0] = 1
                os._exit(0)
            _, status = os.waitpid(pid, 0)
            assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGSEGV, (what, status)
        for view in views.values():
            view.release()
        del views, view
        assert bytes(pinned[0]) == payload
        w = alloc[0]
        w[:] = payload
        w.release()
        assert alloc.commit() == ["stored"]
    out = bytearray(BS)
    assert client.get_into(ns, k[1:], out) == [True]
    assert bytes(out) == payload


def test_calls_release_the_gil(tmp_path):
    """While a call waits in native code, other Python threads run. The
    "daemon" here accepts the connection and says nothing for 1 s, so
    `Client()` blocks 1 s in the handshake: a spinning thread counts
    millions meanwhile only if the call released the GIL (holding it, the
    spinner would get at most one 5 ms switch slice, ~10^5 counts)."""
    import socket as _socket

    path = str(tmp_path / "silent.sock")
    srv = _socket.socket(_socket.AF_UNIX)
    srv.bind(path)
    srv.listen(1)

    def serve():
        conn, _ = srv.accept()
        time.sleep(1.0)
        conn.close()

    server = threading.Thread(target=serve)
    server.start()
    stop = threading.Event()
    count = [0]

    def spin():
        while not stop.is_set():
            count[0] += 1

    spinner = threading.Thread(target=spin)
    spinner.start()
    time.sleep(0.05)
    n0 = count[0]
    with pytest.raises(kvmesh.DaemonUnavailable):
        kvmesh.Client(path)
    n = count[0] - n0
    stop.set()
    spinner.join()
    server.join()
    srv.close()
    assert n > 2_000_000, n
    print(f"spinner counted {n} during the blocked call")


def test_asyncio_client(daemon, ns):
    async def main():
        async with AsyncClient(daemon.socket) as ac:
            keys = fresh_keys(8)
            blocks = rand_blocks(8)
            s = await ac.put(ns.name, zip(keys, blocks))
            assert s.stored == 8
            lens = await asyncio.gather(*(ac.lookup(ns.name, keys[: i + 1]) for i in range(8)))
            assert lens == list(range(1, 9))
            batch = await ac.pin(ns.name, keys)
            assert bytes(batch[7]) == blocks[7]
            await ac.release(batch)
            buf = bytearray(8 * BS)
            assert await ac.get_into(ns.name, keys, buf) == [True] * 8
            assert bytes(buf) == b"".join(blocks)

    asyncio.run(main())


def test_closed_client_raises(daemon):
    c = kvmesh.Client(daemon.socket)
    ns = c.register_namespace("pytest", BS, "layout=pytest")
    c.close()
    with pytest.raises(kvmesh.DaemonUnavailable):
        c.lookup(ns, fresh_keys(1))


def test_version_and_abi():
    assert kvmesh.__version__
    assert kvmesh.KEY_SEED == 0x6B766D657368


def test_readme_example_runs(daemon):
    here = os.path.dirname(os.path.abspath(__file__))
    example = os.path.join(here, "..", "examples", "basic.py")
    out = subprocess.run([sys.executable, example, daemon.socket], capture_output=True, text=True, check=True).stdout
    assert "cached prefix: 4 of 4 blocks" in out
    assert out.count("matches: True") == 4
    assert "copied: [True, True, True, True]" in out
