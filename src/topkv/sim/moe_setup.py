"""What an MoE simulation is made of: expert sizes, activation profiles, EP placement.

* **Sizes.** With expert parallelism an instance holds the dense part of the model and its
  share of the routed experts. One expert's parameters (all layers) are
  ``(total - active) / (experts - experts_per_token)`` (the active count holds
  ``experts_per_token`` of them), the dense part the rest; DeepSeek-V3: 2.56 B per expert,
  16.6 B dense. Weights are FP8 (1 byte per parameter, as DeepSeek-V3 ships).
* **Activations.** Each request decodes with the expert histogram of one real sequence:
  ``topkv/data/moe_esft_expert_counts.csv`` (213 sequences of DeepSeek-V2-Lite-architecture
  routing over four tasks, 64 experts; data/README.md), the sequence drawn per request id
  by a seeded generator. A model with ``E`` experts maps source expert ``j`` to the experts
  ``e`` with ``e % 64 == j`` (sharing its count equally) when ``E >= 64``, and folds
  ``j -> j % E`` when fewer.
* **Placement** (EPLB-style, static): the decode instances of each NVLink domain form one
  expert-parallel group holding a full replica of the experts when they have the memory;
  otherwise consecutive domains are merged until they do. Inside a group the experts go,
  heaviest first (by the mean of all profiles), to the host with the least load so far
  (greedy longest-processing-time, which is what EPLB's balanced packing does).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from topkv.inputs import read_text
from topkv.kv.spec import ModelSpec
from topkv.packaged import DATA_DIR
from topkv.sim.cluster import Instance
from topkv.sim.compute import ComputeModel, GPUSpec
from topkv.sim.errors import SimError

EXPERT_COUNTS = DATA_DIR / "moe_esft_expert_counts.csv"
#: FP8 weights (DeepSeek-V3's released format).
MOE_WEIGHT_BYTES = 1.0
#: Share of an instance's memory the weights may take (the rest holds KV).
WEIGHT_SHARE = 0.7


@dataclass(frozen=True)
class ExpertSizes:
    """Parameter counts of an MoE model, split into the dense part and one expert."""

    experts: int
    per_token: int
    moe_layers: int
    expert_params: float
    dense_params: float
    expert_step_share: float

    @classmethod
    def of(cls, model: ModelSpec) -> ExpertSizes:
        if not model.is_moe or model.experts_per_token <= 0:
            raise SimError(f"{model.name} is not a mixture-of-experts model")
        total = float(model.num_params or 0)
        active = float(model.active_params or 0)
        e, k = model.num_experts, model.experts_per_token
        if not (total > active > 0) or e <= k:
            raise SimError(f"{model.name}: needs total > active parameters and experts > top-k")
        expert = (total - active) / (e - k)
        dense = max(total - e * expert, 0.0)
        return cls(e, k, model.num_layers, expert, dense, min(1.0, k * expert / active))

    def instance_params(self, experts_hosted: int) -> float:
        return self.dense_params + experts_hosted * self.expert_params


def ep_compute(model: ModelSpec, gpu: GPUSpec, tp: int, group_size: int) -> ComputeModel:
    """The compute model of an instance hosting ``experts / group_size`` experts."""
    sizes = ExpertSizes.of(model)
    hosted = math.ceil(sizes.experts / group_size)
    shard = replace(model, num_params=round(sizes.instance_params(hosted)))
    return ComputeModel(shard, gpu, tp=tp, weight_bytes_per_param=MOE_WEIGHT_BYTES)


def min_group_size(model: ModelSpec, gpu: GPUSpec, tp: int, limit: int) -> int:
    """Fewest instances whose memory holds one replica of every expert (up to ``limit``)."""
    sizes = ExpertSizes.of(model)
    budget = WEIGHT_SHARE * tp * gpu.hbm_bytes / MOE_WEIGHT_BYTES
    for g in range(1, limit + 1):
        if sizes.instance_params(math.ceil(sizes.experts / g)) <= budget:
            return g
    raise SimError(
        f"{model.name}: {limit} decode instances of {tp}x {gpu.name} cannot hold one replica "
        "of its experts; use a larger cluster"
    )


def load_profiles(experts: int) -> np.ndarray:
    """Every packaged sequence's activation shares over ``experts`` (rows sum to 1)."""
    counts: list[list[float]] = []
    lines = read_text(EXPERT_COUNTS, what="the MoE expert-load sample").splitlines()
    for line in lines[1:]:
        if not line.strip():
            continue
        fields = line.split(",")
        counts.append([float(v) for v in fields[2:]])
    source = np.array(counts)
    width = source.shape[1]
    if experts >= width:
        mapped = np.zeros((source.shape[0], experts))
        copies = np.bincount(np.arange(experts) % width, minlength=width)
        for e in range(experts):
            mapped[:, e] = source[:, e % width] / copies[e % width]
    else:
        mapped = np.zeros((source.shape[0], experts))
        for j in range(width):
            mapped[:, j % experts] += source[:, j]
    shares: np.ndarray = mapped / mapped.sum(axis=1, keepdims=True)
    return shares


@dataclass
class EPGroup:
    """Decode instances holding one full replica of the experts between them."""

    gid: int
    hosts: list[Instance]
    #: Index into ``hosts`` of each expert's host.
    host_of: np.ndarray


def place(decodes: list[Instance], group_size: int, mean_profile: np.ndarray) -> list[EPGroup]:
    """EP groups over the decode instances and their static placement (module doc)."""
    by_domain: dict[str, list[Instance]] = {}
    for inst in decodes:
        g = inst.gpus[0]
        by_domain.setdefault(g.domain or g.node, []).append(inst)
    groups: list[list[Instance]] = []
    pending: list[Instance] = []
    for members in by_domain.values():
        pending.extend(members)
        if len(pending) >= group_size:
            groups.append(pending)
            pending = []
    if pending:
        if not groups:
            raise SimError(
                f"{len(pending)} decode instances cannot hold the experts (need {group_size})"
            )
        groups[-1].extend(pending)
    placed: list[EPGroup] = []
    order = np.argsort(-mean_profile, kind="stable")
    for gid, hosts in enumerate(groups):
        load = np.zeros(len(hosts))
        host_of = np.zeros(len(mean_profile), dtype=int)
        for e in order:
            h = int(np.argmin(load))
            host_of[e] = h
            load[h] += mean_profile[e]
        placed.append(EPGroup(gid, hosts, host_of))
    return placed
