"""Shared-memory segments of the ``shm`` transport: names, creation, mapping, sweeping.

Segment lifetime (no leaks when either side crashes):

* A segment is named ``topkv-shm-<owner pid>-<connection>-<n>`` (:func:`segment_name`),
  created by the sender (:func:`create_segment`), announced to the receiver, mapped by both
  (:func:`map_segment` on the receiver), then **unlinked at once** by both: from then on it
  lives only as long as some process maps it, so a crash frees it with the process.
* Only the short window between creation and the receiver's mapping leaves a name in
  ``/dev/shm``. The receiver unlinks every announced name when its peer disconnects, and
  :func:`sweep_stale_segments` removes names whose owner pid is dead (run by every new source
  and sink).
* Segments are reused across transfers (pre-faulted memory, like a preallocated buffer). A
  segment is loaned to the receiver from the OK ack until ``ReceivedKV.release()``; an error
  ack returns it at once.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
from pathlib import Path

from topkv.transport.errors import FrameRejected, ResourceExhausted

SEGMENT_DIR = Path("/dev/shm")
SEGMENT_PREFIX = "topkv-shm-"
_SEGMENT_NAME = re.compile(r"^topkv-shm-(\d+)-(\d+)-(\d+)$")
_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)  # no page faults later


def segment_name(owner_pid: int, connection: int, number: int) -> str:
    return f"{SEGMENT_PREFIX}{owner_pid}-{connection}-{number}"


def is_segment_name(name: str) -> bool:
    """True for names :func:`segment_name` makes (a receiver maps nothing else)."""
    return _SEGMENT_NAME.match(name) is not None


def create_segment(path: Path, nbytes: int) -> mmap.mmap:
    """Create ``path`` (mode 0600; it must not exist), reserve ``nbytes`` and map it read-write.

    The name stays until the caller unlinks it, once the receiver has mapped it (or failed).
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as exc:
            raise ResourceExhausted(f"cannot reserve {nbytes} bytes in shm: {exc}") from exc
        return mmap.mmap(fd, nbytes, flags=_MAP_FLAGS)
    finally:
        os.close(fd)


def map_segment(path: Path, nbytes: int) -> mmap.mmap:
    """Map an announced segment of ``nbytes`` read-only, then unlink its name."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise FrameRejected(f"cannot open announced segment {path.name}: {exc}") from exc
    try:
        if os.fstat(fd).st_size != nbytes:
            raise FrameRejected(f"segment {path.name} is not {nbytes} bytes")
        mapping = mmap.mmap(fd, nbytes, flags=_MAP_FLAGS, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    return mapping


def pid_alive(pid: int) -> bool:
    """Is process ``pid`` running (one we may not signal counts as running)?"""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale_segments(directory: Path = SEGMENT_DIR) -> list[str]:
    """Unlink TopKV segments whose owner process is dead; returns the names removed."""
    removed: list[str] = []
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(directory):
            match = _SEGMENT_NAME.match(entry.name)
            if match and not pid_alive(int(match.group(1))):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
                    removed.append(entry.name)
    return removed


def segments_of(pid: int, directory: Path = SEGMENT_DIR) -> list[str]:
    """Names in ``directory`` owned by ``pid`` (for leak checks)."""
    prefix = f"{SEGMENT_PREFIX}{pid}-"
    with contextlib.suppress(FileNotFoundError):
        return sorted(e.name for e in os.scandir(directory) if e.name.startswith(prefix))
    return []
