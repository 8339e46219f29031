"""Real workers in this event loop: :class:`~topkv.service.worker.service.WorkerService` instances,
each with its sinks, KV store and control API, registered straight into one registry.

This is how tests and ``topkv chaos --mode inprocess`` run a cluster without processes: the
workers are the same class as ``topkv worker`` (started in-process, not a second
implementation), so a :class:`~topkv.service.orchestrator.executor.RemoteExecutor` drives them over
their control APIs on loopback and their KV really crosses shared memory or TCP.

:meth:`InProcessCluster.kill` crashes one worker: it leaves the registry at once (as a
supervisor that saw a process die removes it), so the orchestrator abandons every attempt to
it, and then dies the way a crashed worker dies (:meth:`WorkerService.kill`: no goodbye to
the registry, its control API and sinks close, every copy it held is lost).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from dataclasses import dataclass, field

from topkv.errors import TopKVError
from topkv.relay.registry.memory import MemoryRegistry, WorkerRegistry
from topkv.relay.workers import Role, WorkerInfo
from topkv.service.compute.engines import EngineSpec
from topkv.service.errors import ServiceError
from topkv.service.http.auth import Credentials, ServerAuth, new_token
from topkv.service.kvstore import HeldKV
from topkv.service.worker.registrar import DirectRegistrar
from topkv.service.worker.service import WorkerConfig, WorkerFaults, WorkerService

__all__ = ["InProcessCluster", "SharedRegistrar", "WorkerSpec"]


class SharedRegistrar(DirectRegistrar):
    """A :class:`~topkv.service.worker.registrar.DirectRegistrar` into a registry another party
    owns: it registers on the calling (event-loop) thread, so the orchestrator's view sees
    the change at once; ``close`` leaves the registry open (the cluster owns it) and
    :meth:`forget` removes the worker now."""

    def __init__(self, registry: WorkerRegistry) -> None:
        super().__init__(registry, in_thread=False, owns_registry=False)

    def forget(self) -> None:
        """Deregister now (idempotent)."""
        registration, self._registration = self._registration, None
        if registration is not None:
            with contextlib.suppress(TopKVError):
                registration.deregister()


@dataclass(frozen=True)
class WorkerSpec:
    """One in-process worker: where it is and what it does (see :class:`WorkerConfig`)."""

    role: Role
    node: str
    gpu: int
    worker_id: str = ""
    host_id: str = "inprocess"
    capacity: int = 8
    faults: WorkerFaults = field(default_factory=WorkerFaults)
    media: tuple[str, ...] = ("tcp", "shm")
    engine: EngineSpec = field(default_factory=EngineSpec)
    nvlink_domain: str | None = None


class InProcessCluster:
    """Workers (:class:`WorkerService`) started in the running event loop, sharing one
    transport secret and one registry (a :class:`MemoryRegistry` unless given)."""

    def __init__(
        self,
        registry: WorkerRegistry | None = None,
        *,
        ttl_s: float = 10.0,
        secret: bytes | None = None,
        authenticate: bool = True,
        admin_token: str | None = None,
    ) -> None:
        """``authenticate``: the workers' control APIs accept only :attr:`admin_token`
        (``admin_token``, else minted here; hand it to the executor); false runs them open,
        on purpose."""
        self.registry: WorkerRegistry = registry if registry is not None else MemoryRegistry()
        self.ttl_s = ttl_s
        self.secret = secret if secret is not None else secrets.token_bytes(32)
        self.admin_token: str | None = (admin_token or new_token()) if authenticate else None
        self.workers: dict[str, WorkerService] = {}
        self.killed: dict[str, WorkerService] = {}
        self._registrars: dict[str, SharedRegistrar] = {}
        self._dying: set[asyncio.Task[None]] = set()

    async def start_worker(self, spec: WorkerSpec) -> WorkerService:
        """Start one worker and register it; returns the running service."""
        config = WorkerConfig(
            role=spec.role,
            node=spec.node,
            secret=self.secret,
            gpus=(spec.gpu,),
            worker_id=spec.worker_id,
            host_id=spec.host_id,
            capacity=spec.capacity,
            ttl_s=self.ttl_s,
            faults=spec.faults,
            engine=spec.engine,
            media=spec.media,
            nvlink_domain=spec.nvlink_domain,
            auth=(
                ServerAuth(Credentials.of(admin=[self.admin_token]))
                if self.admin_token is not None
                else None
            ),
        )
        registrar = SharedRegistrar(self.registry)
        service = WorkerService(config, registrar=registrar)
        if service.worker_id in self.workers:
            raise ServiceError(f"worker {service.worker_id} is already running here")
        try:
            await service.start()
        except BaseException:
            await service.stop()
            raise
        self.workers[service.worker_id] = service
        self._registrars[service.worker_id] = registrar
        return service

    async def start(self, specs: list[WorkerSpec]) -> list[WorkerService]:
        """Start ``specs`` in order (one at a time: their engines and sinks start cheaply)."""
        return [await self.start_worker(spec) for spec in specs]

    def info(self, worker_id: str) -> WorkerInfo:
        """The registration of a running worker."""
        info = self.workers[worker_id].info
        assert info is not None, "started workers have their info"
        return info

    def held(self, worker_id: str) -> list[int]:
        """The request ids whose KV ``worker_id`` (running or killed) holds."""
        service = self.workers.get(worker_id) or self.killed[worker_id]
        return sorted(kv.request_id for kv in service.store.all())

    def take(self, worker_id: str, request_id: int) -> HeldKV | None:
        """Decode takes the KV ``worker_id`` holds for ``request_id`` out of its store (the
        caller frees it); None when it holds none."""
        return self.workers[worker_id].store.pop(request_id)

    def kill(self, worker_id: str) -> asyncio.Task[None]:
        """Crash ``worker_id``: it leaves the registry now (before this returns, so no
        delivery to it can be handed to decode after this call), then dies like a crashed
        worker. Await the returned task to wait until it is gone."""
        service = self.workers.pop(worker_id)
        self.killed[worker_id] = service
        self._registrars.pop(worker_id).forget()
        task = asyncio.ensure_future(service.kill())
        self._dying.add(task)
        task.add_done_callback(self._dying.discard)
        return task

    async def stop(self) -> None:
        """Stop every worker (they deregister) and wait for the killed ones to be gone."""
        services, self.workers = list(self.workers.values()), {}
        self._registrars = {}
        for service in reversed(services):
            with contextlib.suppress(ServiceError):
                await service.stop()
        if self._dying:
            await asyncio.wait(set(self._dying))

    async def __aenter__(self) -> InProcessCluster:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
