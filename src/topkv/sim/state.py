"""Per-request and per-decode-instance state of a simulation run."""

from __future__ import annotations

import math
from collections import deque

from topkv.policy.view import PathCandidate
from topkv.sim.cluster import Instance
from topkv.traces import Request


class ReqState:
    __slots__ = (
        "decode",
        "e2e",
        "exposed",
        "finish",
        "kv_bytes",
        "mem",
        "path",
        "prefill_end",
        "prefill_start",
        "req",
        "transport",
        "ttft",
        "xfer_end",
        "xfer_start",
    )

    def __init__(self, req: Request) -> None:
        self.req = req
        self.prefill_start = math.nan
        self.prefill_end = math.nan
        self.xfer_start = math.nan
        self.xfer_end = math.nan
        self.finish = math.nan
        self.ttft = math.nan
        self.e2e = math.nan
        self.exposed = math.nan
        self.transport = ""
        self.kv_bytes = 0
        self.mem = 0.0
        self.path: PathCandidate | None = None
        self.decode: DecodeState | None = None


class DecodeState:
    """A decode instance's continuous batch, advanced as a fluid in 'steps'."""

    __slots__ = (
        "capacity",
        "closed",
        "extra_step_s",
        "inst",
        "last_t",
        "members",
        "n",
        "pending",
        "released",
        "reserved",
        "seq",
        "step_s",
        "steps",
        "sum_input",
        "sum_join",
        "version",
        "waiting",
    )

    def __init__(self, inst: Instance, capacity: float) -> None:
        self.inst = inst
        self.capacity = capacity
        self.reserved = 0.0
        #: KV bytes freed by finished sequences since the start (the ADP's KV outflow)
        self.released = 0.0
        self.steps = 0.0
        self.last_t = 0.0
        self.step_s = 0.0
        self.members: list[tuple[float, int, ReqState]] = []
        self.n = 0
        self.sum_input = 0.0
        self.sum_join = 0.0
        self.version = 0
        self.seq = 0
        self.waiting: deque[ReqState] = deque()
        #: Requests routed here whose KV has not arrived yet (KV not acknowledged).
        self.pending = 0
        #: Closed to routing by the Adaptive Decoder Pool (fenced for, or in, conversion to
        #: prefill): no new requests are routed here.
        self.closed = False
        #: Added to each decode step while chunked prefill runs here (one chunk per step).
        self.extra_step_s = 0.0
