"""Shared files in /dev/shm that ranks of one host map: created with their space reserved, mapped populated.

Used by models/shm_allreduce.py and models/shm_handoff.py. The space is reserved
with `posix_fallocate`, so a full tmpfs fails at creation (the caller then keeps
gloo) instead of with SIGBUS at the first touch of a page; the mapping is
populated at once, so the first hot-path use does not pay the page faults.
"""

from __future__ import annotations

import mmap
import os
import tempfile
from typing import Optional

__all__ = ["create_shm_file", "map_shm_file"]


def create_shm_file(directory: str, prefix: str, nbytes: int) -> Optional[str]:
    """A new zero-filled file of nbytes in `directory` (named prefix + random), or None where that fails."""
    try:
        fd, path = tempfile.mkstemp(prefix=prefix, dir=directory)
    except OSError:
        return None
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError:
        os.close(fd)
        os.unlink(path)
        return None
    os.close(fd)
    return path


def map_shm_file(path: str, nbytes: int) -> Optional[mmap.mmap]:
    """A shared, populated mapping of the file at `path`, or None where it is missing or not nbytes long."""
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return None
    try:
        if os.fstat(fd).st_size != nbytes:
            return None
        return mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    except OSError:
        return None
    finally:
        os.close(fd)
