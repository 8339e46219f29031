"""The arena transports (nixl, mooncake, cuda): availability, factory, registration.

The only module that imports their libraries (:mod:`~topkv.transport.arena.nixl`,
:mod:`~topkv.transport.arena.mooncake`, :mod:`~topkv.transport.arena.cuda`), lazily, once
their package is known to load: ``make_source`` / ``make_sink`` build one,
:func:`missing_package` says why one cannot be built here, and :func:`register_all` adds them
to :mod:`topkv.transport.catalog`.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from topkv.transport import catalog
from topkv.transport.arena.protocol import INSTALL_HINT
from topkv.transport.base import TransferSink, TransferSource, TransportMode
from topkv.transport.errors import TransportUnavailable

ARENA_TRANSPORTS: dict[str, tuple[TransportMode, str]] = {
    "nixl": (TransportMode.RDMA, "NIXL agent, UCX backend (optional extra)"),
    "mooncake": (TransportMode.TCP, "Mooncake Transfer Engine, TCP protocol (optional extra)"),
    "cuda": (TransportMode.NVLINK, "CUDA peer copies and IPC through PyTorch (needs a GPU)"),
}


def missing_package(transport: str) -> str | None:
    """None when ``transport``'s library package is importable, else why it is not."""
    module = {"nixl": "nixl_cu12", "mooncake": "mooncake.engine", "cuda": "torch"}[transport]
    try:
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        return f"{transport}: Python module {module} is not installed ({INSTALL_HINT})"
    if transport != "cuda":
        try:  # installed but unloadable (e.g. Mooncake without libibverbs1) counts as absent
            importlib.import_module(module)
        except (ImportError, OSError) as exc:
            return f"{transport}: {module} does not load ({exc}; {INSTALL_HINT})"
    if transport == "cuda":
        import torch

        if not torch.cuda.is_available():
            return "cuda: torch.cuda.is_available() is False (no GPU or no CUDA build of torch)"
    return None


def _driver_classes(
    transport: str,
) -> tuple[Callable[..., TransferSource], Callable[..., TransferSink]]:
    """``transport``'s source and sink classes, imported once its package is known to load
    (TransportUnavailable with the reason when it is not)."""
    reason = missing_package(transport)
    if reason is not None:
        raise TransportUnavailable(reason)
    if transport == "nixl":
        from topkv.transport.arena.nixl import NixlSink, NixlSource

        return NixlSource, NixlSink
    if transport == "mooncake":
        from topkv.transport.arena.mooncake import MooncakeSink, MooncakeSource

        return MooncakeSource, MooncakeSink
    from topkv.transport.arena.cuda import CudaSink, CudaSource

    return CudaSource, CudaSink


def make_source(transport: str, secret: bytes, **options: Any) -> TransferSource:
    """A source of ``transport`` (nixl | mooncake | cuda); TransportUnavailable if absent."""
    source, _ = _driver_classes(transport)
    return source(secret, **options)


def make_sink(transport: str, secret: bytes, **options: Any) -> TransferSink:
    """A sink of ``transport`` (nixl | mooncake | cuda); TransportUnavailable if absent."""
    _, sink = _driver_classes(transport)
    return sink(secret, **options)


def register_all(
    *,
    host: str = "127.0.0.1",
    capacity_bytes: int | None = None,
    available_only: bool = False,
    names: Iterable[str] | None = None,
) -> dict[str, str | None]:
    """Add nixl, mooncake and cuda to :mod:`topkv.transport.catalog`; idempotent.

    Returns ``{name: None}`` for each transport that can run here and ``{name: reason}``
    (what is missing and how to install it) for the others. A missing one is still registered
    (its description says why it is unavailable, and making its source or sink raises
    ``TransportUnavailable`` with the reason) unless ``available_only``. The registered
    factories take only the shared secret: sinks listen on ``host`` (also the local address
    of Mooncake's Transfer Engine) with an arena of ``capacity_bytes`` (each transport's
    default, 1 GiB, when None). ``names``: only these transports (default: all three); a
    caller that does not offer ``cuda`` leaves it out, since probing it imports torch.
    """
    sink_options: dict[str, Any] = {"host": host}
    if capacity_bytes is not None:
        sink_options["capacity_bytes"] = capacity_bytes
    wanted = set(ARENA_TRANSPORTS if names is None else names)
    unknown = wanted - set(ARENA_TRANSPORTS)
    if unknown:
        known = ", ".join(ARENA_TRANSPORTS)
        raise TransportUnavailable(
            f"no arena transport {', '.join(sorted(unknown))}; known: {known}"
        )
    reasons: dict[str, str | None] = {}
    for name, (mode, description) in ARENA_TRANSPORTS.items():
        if name not in wanted:
            continue
        reason = reasons[name] = missing_package(name)
        if reason is not None and available_only:
            continue
        source_options: dict[str, Any] = {"host": host} if name == "mooncake" else {}
        catalog.register(
            catalog.TransportInfo(
                name=name,
                mode=mode,
                emulated=False,
                make_source=_factory(make_source, name, source_options),
                make_sink=_factory(make_sink, name, sink_options),
                description=description + (f" - unavailable: {reason}" if reason else ""),
            )
        )
    return reasons


def _factory(
    make: Callable[..., Any], name: str, options: Mapping[str, Any]
) -> Callable[[bytes], Any]:
    return lambda secret: make(name, secret, **options)
