"""KV events from Python against a real kvmeshd."""

import pytest

import kvmesh
from conftest import Daemon


def test_events_arrive_in_order_and_a_snapshot_continues_them(client):
    ns = client.register_namespace("py-events", 65536, "t")
    w = client.watch_events(ns)
    keys = [kvmesh.key(i) for i in (1, 2, 3)]
    s = client.put(ns, [(k, bytes(65536)) for k in keys])
    assert s.stored == 3
    assert client.remove(ns, keys[:1]) == [True]
    got = []
    while len(got) < 4:
        b = w.next_batch(timeout=10)
        assert b is not None, "events within 10 s"
        assert not b.snapshot and b.node_id == 1
        got.extend(b.events)
    assert [(e.kind, e.key, e.seq) for e in got] == [
        ("stored", keys[0], 1),
        ("stored", keys[1], 2),
        ("stored", keys[2], 3),
        ("removed", keys[0], 4),
    ]
    with client.watch_events(ns, snapshot=True) as snap:
        b = snap.next_batch(timeout=10)
        assert b.snapshot and b.snapshot_seq == 4 and b.snapshot_done
        assert sorted(e.key for e in b.events) == sorted(keys[1:])
        assert all(e.kind == "snapshot" for e in b.events)
        # Nothing new: a timeout, not an error.
        assert snap.next_batch(timeout=0.2) is None
    w.close()


def test_close_from_another_thread_wakes_a_waiting_reader(client):
    import threading

    ns = client.register_namespace("py-events-close", 65536, "t")
    w = client.watch_events(ns)
    out = []

    def read():
        try:
            w.next_batch()  # waits for ever: nothing is put
        except kvmesh.KvmeshError as e:
            out.append(e)

    t = threading.Thread(target=read)
    t.start()
    import time

    time.sleep(0.2)
    w.close()
    t.join(timeout=10)
    assert not t.is_alive(), "close() woke the reader"
    assert isinstance(out[0], kvmesh.DaemonUnavailable)


def test_a_slow_watcher_is_cut_off():
    d = Daemon(pool_bytes="4MiB", slot="4KiB", extra="[events]\nbuffer_events = 16\n")
    try:
        c = kvmesh.Client(d.socket)
        ns = c.register_namespace("slow", 4096, "t")
        w = c.watch_events(ns)
        for r in range(40):
            c.put(ns, [(kvmesh.key(r * 1000 + i + 1), bytes(4096)) for i in range(256)])
        with pytest.raises(kvmesh.ResourceExhausted, match="cut off"):
            while True:
                assert w.next_batch(timeout=20) is not None
        assert c.stats()["event_watchers_cut_off"] >= 1
        c.close()
    finally:
        d.stop()
