"""The deployment ``topkv demo`` stands for, as the simulator describes it.

``topkv demo --stand-in MODEL[@CLUSTER]`` names it: a catalog model (``topkv models``) on a
cluster ``topkv sim --cluster`` takes (default ``4x-dgx-h100``). Its tensor parallelism and
prefill times come from the simulator's roofline compute model
(:class:`topkv.sim.compute.ComputeModel`, through :class:`topkv.sim.runner.SimConfig` as
``topkv sim`` builds it), its paths from the simulated cluster
(:class:`topkv.sim.cluster.SimCluster`). This module sits above both the demo and the
simulator (neither imports the other): it hands the demo a
:class:`~topkv.demo.emulation.StandIn` (the figures the time dilation is derived from) and
the sim check (:mod:`topkv.harness.sim_check`) the cluster to simulate.

The cluster is simulated *in the demo's shape*: two prefill and two decode instances, each
node holding one of each when two instances fit in a node (the first ``2 * tp`` GPUs of a
node with their rail NICs), else one instance per node on four nodes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from topkv.demo.emulation import StandIn
from topkv.errors import ConfigError, TopKVError
from topkv.kv import UnknownModelError, catalog, get_model
from topkv.kv.spec import ModelSpec
from topkv.sim.cluster import ClusterSpec, SimCluster, load_cluster_spec
from topkv.sim.compute import ComputeModel
from topkv.sim.runner import SimConfig

#: What the demo's emulated topology (two 8x H100 NV18 nodes, a NIC per GPU) stands for.
DEFAULT_STAND_IN = "Llama-3-70B@4x-dgx-h100"
DEFAULT_CLUSTER = "4x-dgx-h100"
#: The demo's pools: two prefill and two decode workers.
DEMO_INSTANCES = 4


class StandInError(ConfigError):
    """``--stand-in`` names no deployment the demo can stand for."""


@dataclass(frozen=True)
class Deployment:
    """A model on a cluster, with the simulator's compute model of one instance."""

    text: str
    model: ModelSpec
    cluster: ClusterSpec
    compute: ComputeModel

    @property
    def tp(self) -> int:
        return self.compute.tp

    @classmethod
    def parse(cls, text: str) -> Deployment:
        """``MODEL[@CLUSTER]``: a catalog model on a cluster ``topkv sim`` knows."""
        name, _, cluster_name = text.strip().partition("@")
        if not name:
            raise StandInError(f"--stand-in {text!r}: expected MODEL[@CLUSTER], e.g. "
                               f"{DEFAULT_STAND_IN}")  # fmt: skip
        try:
            model = get_model(name)
        except UnknownModelError:
            known = ", ".join(spec.name for spec in catalog())
            raise StandInError(
                f"--stand-in {text!r}: unknown model {name!r}; known models: {known}"
            ) from None
        try:
            cluster = load_cluster_spec(cluster_name or DEFAULT_CLUSTER)
            if len(cluster.node_groups) != 1:
                raise StandInError(f"{cluster.name}: a stand-in cluster has one node group")
            if not cluster.node_groups[0].nics_per_node:
                raise StandInError(
                    f"{cluster.name} has no RDMA NICs: the demo's cross-node RDMA path has "
                    "no counterpart there"
                )
            config = SimConfig(model=model, cluster=cluster)
            compute = config.compute_model(config.resolved_tp())
            deployment = cls(text, model, cluster, compute)
            deployment.simulated_cluster()  # the demo's shape must be buildable
        except TopKVError as exc:
            raise StandInError(f"--stand-in {text!r}: {exc}") from None
        return deployment

    def demo_shaped(self) -> ClusterSpec:
        """The cluster with just the demo's two prefill and two decode instances."""
        group = self.cluster.node_groups[0]
        per_node = group.gpus_per_node // self.tp
        if per_node >= 2:
            gpus = 2 * self.tp
            nics = max(1, group.nics_per_node * gpus // group.gpus_per_node)
            shaped = group.model_copy(update={"count": 2, "gpus_per_node": gpus,
                                              "nics_per_node": nics})  # fmt: skip
        else:
            shaped = group.model_copy(update={"count": DEMO_INSTANCES})
        return self.cluster.model_copy(
            update={"name": f"{self.cluster.name} (demo-shaped)", "node_groups": [shaped]}
        )

    def simulated_cluster(self) -> SimCluster:
        return SimCluster.build(self.demo_shaped(), self.tp, (1, 1))

    def stand_in(self, prompt_lens: Sequence[int]) -> StandIn:
        """What the demo's dilation is derived from, over the run's prompt lengths."""
        if not prompt_lens:
            raise StandInError("no prompts to rate the stand-in's prefill on")
        group = self.cluster.node_groups[0]
        cluster = self.simulated_cluster()
        prefill = cluster.prefill[0]
        nics = {gpu.nic for gpu in prefill.gpus}
        # the shards of one instance share its GPUs' rail NICs
        cross = group.nic_gb_s * 1e9 * len(nics) / self.tp
        same_node = any(d.gpus[0].node == prefill.gpus[0].node for d in cluster.decode)
        mode = "pcie" if group.nvlink == "none" else "nvlink"
        same_gb_s = group.pcie_gb_s if mode == "pcie" else group.nvlink_gb_s
        kv = sum(self.compute.kv_bytes(n) for n in prompt_lens)
        seconds = sum(self.compute.prefill_s([n]) for n in prompt_lens)
        return StandIn(
            model=self.model.name,
            cluster=self.cluster.name,
            tp=self.tp,
            kv_bytes_per_prefill_s=kv / seconds,
            cross_node_bytes_per_s=cross,
            same_node_mode=mode if same_node else None,
            same_node_bytes_per_s=same_gb_s * 1e9 if same_node else None,
        )
