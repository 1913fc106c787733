"""Exceptions of the kvmesh package.

Every error the daemon or the library reports is a ``KvmeshError``; the
subclasses say what kind it is. A miss is *not* an error for ``lookup`` and
``pin`` (they report presence); ``Miss`` is raised only where a block is
required (``Batch.verify`` of a missed entry).
"""

__all__ = [
    "KvmeshError",
    "InvalidArgument",
    "NotFound",
    "Miss",
    "ResourceExhausted",
    "LeaseExpired",
    "Refused",
    "DaemonUnavailable",
    "Released",
    "NoDevice",
]


class KvmeshError(Exception):
    """Base class of every kvmesh error (also: an internal error)."""


class InvalidArgument(KvmeshError, ValueError):
    """A bad argument (wrong key form, wrong buffer size, unknown flag), or
    one the daemon rejects (a namespace registered with another block size)."""


class NotFound(KvmeshError, LookupError):
    """An unknown namespace."""


class Miss(NotFound):
    """A block that is not cached, where one was required."""


class ResourceExhausted(KvmeshError):
    """The pool is full of pinned or pending blocks, or a session limit was
    reached. Release pins or retry later."""


class LeaseExpired(KvmeshError):
    """A pin or allocation lease ended before the operation finished; what
    it covered must not be used. Pin (or allocate) again."""


class Refused(KvmeshError):
    """The daemon or the cluster refused (another write of the key in
    progress, not a serving member, a timeout)."""


class DaemonUnavailable(KvmeshError, ConnectionError):
    """The daemon cannot be reached, the connection broke, or the client was
    closed. Create a new ``Client``."""


class Released(KvmeshError):
    """A batch or allocation was used after ``release()``, ``commit()`` or
    ``abort()``."""


class NoDevice(KvmeshError):
    """A call on GPU memory where there is no CUDA driver, no such device,
    or no NVRTC (the kernels' run-time compiler). The same call on host
    memory works everywhere."""
