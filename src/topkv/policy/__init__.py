"""Pure, clock-injected decision policies shared by the live runtime and the simulator.

Nothing here imports the topology model, sockets or asyncio: callers reduce their state to
the snapshots in :mod:`topkv.policy.view` and get a decision back.
"""

from topkv.policy.admission import Admission, AdmissionLimits, admit
from topkv.policy.adp.pool import (
    DEFAULT_ADP,
    AdaptiveDecoderPool,
    ADPConfig,
    ConversionPlan,
    RushDetector,
    Signals,
    TokenVelocity,
    WorkerView,
    plan_conversions,
)
from topkv.policy.bandwidth import (
    BandwidthEstimator,
    BandwidthReader,
    BandwidthReading,
    NominalBandwidth,
)
from topkv.policy.clock import Clock, ManualClock, MonotonicClock
from topkv.policy.errors import NoPathError, PolicyError, PolicyInputError
from topkv.policy.estimate import CandidateEstimate, estimate_path
from topkv.policy.pairs import pair_view_from_facts
from topkv.policy.route import DecodeWorkerView, RouteDecision, RouteScore, RoutingPolicy
from topkv.policy.select import (
    CostPolicy,
    PaperPolicy,
    Selection,
    TransportSelector,
    UniformPolicy,
    next_after_failure,
    policy_from_name,
)
from topkv.policy.view import (
    NO_LOAD,
    Endpoint,
    LinkLoad,
    LinkLoadTracker,
    PairView,
    PathCandidate,
    TransferRequest,
)

__all__ = [
    "DEFAULT_ADP",
    "NO_LOAD",
    "ADPConfig",
    "AdaptiveDecoderPool",
    "Admission",
    "AdmissionLimits",
    "BandwidthEstimator",
    "BandwidthReader",
    "BandwidthReading",
    "CandidateEstimate",
    "Clock",
    "ConversionPlan",
    "CostPolicy",
    "DecodeWorkerView",
    "Endpoint",
    "LinkLoad",
    "LinkLoadTracker",
    "ManualClock",
    "MonotonicClock",
    "NoPathError",
    "NominalBandwidth",
    "PairView",
    "PaperPolicy",
    "PathCandidate",
    "PolicyError",
    "PolicyInputError",
    "RouteDecision",
    "RouteScore",
    "RoutingPolicy",
    "RushDetector",
    "Selection",
    "Signals",
    "TokenVelocity",
    "TransferRequest",
    "TransportSelector",
    "UniformPolicy",
    "WorkerView",
    "admit",
    "estimate_path",
    "next_after_failure",
    "pair_view_from_facts",
    "plan_conversions",
    "policy_from_name",
]
