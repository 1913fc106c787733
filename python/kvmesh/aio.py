"""asyncio face of the hot-path calls: ``lookup``, ``pin``, ``get_into``,
``put`` (and ``release``).

Each call runs the blocking ``Client`` method on a small thread pool owned by
the ``AsyncClient``; the native call releases the GIL while it waits for the
daemon, so the event loop keeps running. Why threads and not a native
coroutine: the daemon answers a local call in tens of microseconds, the
client's own runtime already multiplexes calls from many threads over one
connection, and an executor hop keeps the native module free of any event
loop integration (no dependency on the loop's implementation, uvloop works
the same).

    client = kvmesh.aio.AsyncClient()
    n = await client.lookup(ns, keys)
    batch = await client.pin(ns, keys[:n])
    ...
    await client.release(batch)
"""

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable, List, Optional, Sequence, Tuple

from . import Batch, Client, KeyLike, Location, NamespaceLike, PutSummary

__all__ = ["AsyncClient"]


class AsyncClient:
    """An async wrapper of ``kvmesh.Client`` (``client`` given, or a new one
    on ``socket``). ``sync`` is the wrapped client, for the other calls."""

    def __init__(self, socket: Optional[str] = None, client: Optional[Client] = None, max_workers: int = 4):
        self.sync = client if client is not None else Client(socket)
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="kvmesh-aio")

    async def _run(self, f, *args, **kw):
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(f, *args, **kw))

    async def lookup(self, ns: NamespaceLike, keys: Sequence[KeyLike]) -> int:
        return await self._run(self.sync.lookup, ns, keys)

    async def locate(self, ns: NamespaceLike, keys: Sequence[KeyLike], local_only: bool = False) -> Location:
        return await self._run(self.sync.locate, ns, keys, local_only)

    async def pin(self, ns: NamespaceLike, keys: Sequence[KeyLike], lease_ms: int = 0, stop_at_first_miss: bool = False) -> Batch:
        return await self._run(self.sync.pin, ns, keys, lease_ms, stop_at_first_miss)

    async def release(self, batch: Batch) -> None:
        await self._run(batch.release)

    async def get_into(self, ns: NamespaceLike, keys: Sequence[KeyLike], buffer) -> List[bool]:
        return await self._run(self.sync.get_into, ns, keys, buffer)

    async def put(self, ns: NamespaceLike, blocks: Iterable[Tuple[KeyLike, object]]) -> PutSummary:
        return await self._run(self.sync.put, ns, list(blocks))

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.sync.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()
