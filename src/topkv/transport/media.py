"""Which medium carries each path class, in one place.

The selection policy names *path classes* (``nvlink``, ``nvswitch``, ``xgmi``, ``pcie``,
``rdma``, ``tcp``); a *medium* is a registered transport (:mod:`topkv.transport.catalog`)
that moves the bytes. On one host the same-host classes ride on shared memory and every
other class on TCP; classes faster than host memory are emulated (paced shm), RDMA is
emulated over TCP (no RDMA hardware is assumed).
"""

from __future__ import annotations

from collections.abc import Mapping

#: The real medium under each same-host path class (every other class rides on ``tcp``).
MEDIUM_FOR_MODE: Mapping[str, str] = {
    "nvlink": "shm",
    "nvswitch": "shm",
    "pcie": "shm",
    "xgmi": "shm",
}

#: Registered medium serving each path class by default: NVLink-class paths are emulated
#: (paced shared memory), PCIe-class same-host paths are real shared memory, RDMA is
#: emulated over TCP, TCP is real.
DEFAULT_MEDIA: Mapping[str, str] = {
    "nvlink": "emulated-nvlink",
    "nvswitch": "emulated-nvswitch",
    "xgmi": "emulated-nvlink",
    "pcie": "shm",
    "rdma": "emulated-rdma",
    "tcp": "tcp",
}


def real_medium(path_class: str) -> str:
    """``shm`` or ``tcp``: the real medium under ``path_class`` between processes of one host."""
    return MEDIUM_FOR_MODE.get(path_class, "tcp")
