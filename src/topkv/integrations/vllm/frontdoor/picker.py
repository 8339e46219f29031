"""Which prefill and which decode instance serve a request: TopKV's registry and policies.

Prefill: the registered prefill instance with the fewest requests in flight here (then by
id). Decode: :class:`~topkv.policy.route.RoutingPolicy` over every registered decode
instance (cheapest transfer by :class:`~topkv.policy.select.CostPolicy` on the pair's paths
from :func:`~topkv.relay.pairs.pair_view_for_workers`, then least loaded, then id); free
slots are the registration's capacity less the requests in flight. The chosen path class
becomes a medium (:func:`.media.pair_medium`): the first of the class's media (an engine
medium for rdma, shm for a same-host class, tcp) that both registrations offer; a request
may restrict the media (``media``, the front door's ``X-TopKV-Medium``).

KV already held (:mod:`topkv.policy.prefix_affinity`): given the request's prefix block
hashes (:func:`prompt_hashes`), the prefill instance is the one that last served the
longest prefix of it (vLLM's prefix cache then computes only the tail), within a load gap
of the least loaded; the decode instance likewise, among those whose transfer costs the
same as the routing policy's choice and have a free slot. :meth:`Picker.served` records
what each instance was sent. When the decode instance holds a token-id prompt's prefix,
the prefill instance sends only the rest (:func:`held_tokens`, ``skip_tokens``).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from topkv.integrations.vllm.connector.media import pair_medium, sink_address
from topkv.integrations.vllm.connector.params import shm_socket_path
from topkv.policy.clock import Clock, MonotonicClock
from topkv.policy.prefix_affinity import AffinityConfig, Candidate, PrefixAffinity, prefix_hashes
from topkv.policy.route import DecodeWorkerView, RouteScore, RoutingPolicy
from topkv.policy.select import CostPolicy
from topkv.policy.view import TransferRequest
from topkv.relay.pairs import endpoint_of, pair_view_for_workers
from topkv.relay.registry.base import WorkerRegistry
from topkv.relay.workers import Role, WorkerInfo
from topkv.service.worker.media import check_medium


@dataclass(frozen=True)
class Route:
    prefill: WorkerInfo
    decode: WorkerInfo
    medium: str  # shm | tcp | nixl | mooncake
    destination: str  # where the prefill instance sends the KV
    path_class: str
    rationale: str
    #: Leading prefix blocks the chosen instances are believed to hold (prefill, decode).
    affinity: tuple[int, int] = (0, 0)


class NoInstance(Exception):
    """No registered instance of a role can take the request (the front door answers 503)."""


#: Text prompts are hashed by their UTF-8 bytes, this many per block (about 32 tokens).
TEXT_BLOCK_BYTES = 128
#: Tokens per block of a token-id prompt: the instances' vLLM ``--block-size``.
BLOCK_TOKENS = 32


def held_tokens(body: Mapping[str, Any], blocks: int, block_tokens: int = BLOCK_TOKENS) -> int:
    """Leading prompt tokens an instance holding ``blocks`` of the prompt's block hashes
    has cached, as far as the prompt's tokens are known (a token-id prompt; else 0), short
    of the last token (vLLM always computes it)."""
    prompt = body.get("prompt")
    if not blocks or not isinstance(prompt, list) or not prompt:
        return 0
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return 0
    return min(blocks * block_tokens, (len(prompt) - 1) // block_tokens * block_tokens)


def prompt_hashes(body: Mapping[str, Any], block_tokens: int = BLOCK_TOKENS) -> tuple[bytes, ...]:
    """The request's prefix block hashes: a token-id prompt by ``block_tokens`` tokens, a
    text prompt or chat messages by :data:`TEXT_BLOCK_BYTES` bytes of its UTF-8 text
    (the messages as canonical JSON). Empty when the prompt is not one of those (a batch)."""
    prompt = body.get("prompt")
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        return prefix_hashes(prompt, block_tokens)
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if isinstance(prompt, str):
        text = prompt
    elif isinstance(body.get("messages"), list):
        text = json.dumps(body["messages"], sort_keys=True, separators=(",", ":"))
    else:
        return ()
    return prefix_hashes(list(text.encode()), TEXT_BLOCK_BYTES)


class Picker:
    def __init__(
        self,
        registry: WorkerRegistry,
        shm_dir: str,
        *,
        affinity: bool = True,
        clock: Clock | None = None,
        affinity_config: AffinityConfig | None = None,
        pools: Callable[[Role], list[WorkerInfo]] | None = None,
    ) -> None:
        """``pools``: the instances that take new work of a role now (the front door's
        ADP, :meth:`.pools.FrontDoorADP.workers`); None: the registry's roles."""
        self.registry = registry
        self.pools = pools
        self.shm_dir = shm_dir
        self.in_flight: Counter[str] = Counter()
        self._routing = RoutingPolicy()
        self._selector = CostPolicy()
        #: None: prefix affinity off (the least loaded instances, as before).
        self.affinity = (
            PrefixAffinity(clock or MonotonicClock(), affinity_config) if affinity else None
        )

    def served(self, instance_id: str, hashes: Sequence[bytes]) -> None:
        """``instance_id`` computed (prefill) or loaded (decode) a prompt of ``hashes``."""
        if self.affinity is not None and hashes:
            self.affinity.record(instance_id, hashes)

    def forget(self, instance_id: str) -> None:
        if self.affinity is not None:
            self.affinity.forget(instance_id)

    def _held(
        self, workers: Sequence[WorkerInfo], hashes: Sequence[bytes]
    ) -> tuple[str, int] | None:
        if self.affinity is None:
            return None
        candidates = [Candidate(w.worker_id, float(self.in_flight[w.worker_id])) for w in workers]
        choice = self.affinity.choose(candidates, hashes)
        return None if choice is None else (choice.instance_id, choice.matched_blocks)

    def _workers(self, role: Role) -> list[WorkerInfo]:
        return self.pools(role) if self.pools is not None else self.registry.workers(role)

    def fallback_decode(self, exclude: Collection[str]) -> WorkerInfo | None:
        """A decode instance to continue a broken stream on (no KV moves): the least
        loaded registered one not in ``exclude`` (None: none left)."""
        decodes = [w for w in self._workers("decode") if w.worker_id not in exclude]
        if not decodes:
            return None
        return min(decodes, key=lambda w: (self.in_flight[w.worker_id], w.worker_id))

    def pick(
        self,
        kv_bytes: int,
        exclude: Collection[str] = (),
        hashes: Sequence[bytes] = (),
        media: Sequence[str] | None = None,
    ) -> Route:
        """``media``: only these media may carry the KV (None: any both sides offer); a
        decode instance that none of them reaches from the prefill is not a candidate."""
        prefills = [w for w in self._workers("prefill") if w.worker_id not in exclude]
        if not prefills:
            raise NoInstance("no prefill instance is registered")
        prefill = min(prefills, key=lambda w: (self.in_flight[w.worker_id], w.worker_id))
        held = self._held(prefills, hashes)
        if held is not None:
            prefill = next(w for w in prefills if w.worker_id == held[0])
        prefill_matched = held[1] if held is not None else 0
        decodes = {
            w.worker_id: w
            for w in self._workers("decode")
            if w.worker_id not in exclude and w.address
        }
        if not decodes:
            raise NoInstance("no decode instance is registered")
        if media is not None:
            reachable = {
                wid: w
                for wid, w in decodes.items()
                if any(check_medium(m, prefill, w) is None for m in media)
            }
            if not reachable:
                raise NoInstance(
                    f"no registered decode instance is reachable over {', '.join(media)}"
                )
            decodes = reachable
        request = TransferRequest(nbytes=max(kv_bytes, 1))
        source = endpoint_of(prefill)
        scores: list[RouteScore] = []
        for worker in decodes.values():  # one lookup per worker: endpoints may coincide
            scores += RoutingPolicy.score(
                source,
                [(worker.worker_id, endpoint_of(worker))],
                lambda _s, _d, w=worker: pair_view_for_workers(prefill, w),  # type: ignore[misc]
                request,
                self._selector,
            )
        scores.sort(key=lambda s: (s.cost, s.worker_id))
        views = {
            wid: DecodeWorkerView(
                wid,
                endpoint_of(w),
                free_slots=max(w.capacity - self.in_flight[wid], 0),
                load=float(self.in_flight[wid]),
            )
            for wid, w in decodes.items()
        }
        decision = self._routing.choose_scored(scores, views, self._selector, request)
        if decision is None:
            raise NoInstance("every decode instance is full (capacity reached)")
        decode_matched = 0
        best = min(s.cost for s in scores if s.worker_id == decision.worker_id)
        peers = [
            decodes[s.worker_id]
            for s in scores
            if s.cost <= best and views[s.worker_id].free_slots > 0
        ]
        held = self._held(peers, hashes)
        if held is not None and held[0] != decision.worker_id:
            others = set(decodes) - {held[0]}
            warm = self._routing.choose_scored(
                scores, views, self._selector, request, exclude=others
            )
            if warm is not None:
                decision = warm
        if held is not None and held[0] == decision.worker_id:
            decode_matched = held[1]
        decode = decodes[decision.worker_id]
        path = decision.selection.choice
        medium, why = pair_medium(path, prefill, decode, media)
        if medium is None:
            raise NoInstance(f"{prefill.worker_id} -> {decode.worker_id}: {why}")
        if medium == "shm":
            destination: str | None = "shm://" + shm_socket_path(self.shm_dir, decode.worker_id)
        else:
            destination = sink_address(decode, medium)
        if destination is None:
            raise NoInstance(f"{decode.worker_id} offers {medium} but lists no {medium} sink")
        return Route(
            prefill, decode, medium, destination, path, f"{decision.rationale}; {why}",
            (prefill_matched, decode_matched),
        )  # fmt: skip
