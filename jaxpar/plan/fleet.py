"""The machine a plan is for: devices per node, peak FLOP/s, memory, and α-β links.

A collective over a group of devices costs α + bytes/β: α the start-up latency, β the
bus bandwidth each device achieves per direction (nccl-tests' busbw convention, so the
bytes are what each device sends: (n-1)/n of the buffer for an all-gather or a
reduce-scatter, 2(n-1)/n for an all-reduce). Devices are numbered node-major, like
`jaxpar.mesh.make_mesh` lays out `jax.devices()`: a group whose devices span at most one
node runs on NVLink; a wider one crosses the scale-out network (InfiniBand), where NCCL
spreads the traffic over the NICs of every GPU the group holds in each node (one ring or
channel per NIC): a group with g GPUs per node gets g x the per-GPU NIC bandwidth, capped
by NVLink, which carries it inside the node. An NCCL maintainer reports 192 GB/s all-reduce
busbw across DGX-A100 nodes with 8 x 200 Gb/s NICs (8 x 25 GB/s; NCCL issue 812).

GPU clusters take the datasheet figures of `jaxpar.measure.hardware` times an achieved
fraction (an assumption, stated in `LINK_EFFICIENCY`); the CPU "cluster" (N virtual
devices of one process) takes α and β measured by `jaxpar bench collectives` and the
compute rate of the host probe.
"""
from __future__ import annotations

import dataclasses
import math

from jaxpar.config import ConfigError
from jaxpar.measure.hardware import ALPHA_INFINIBAND_S, ALPHA_NVLINK_S, LINK_EFFICIENCY  # noqa: F401 (re-exported)
from jaxpar.units import GB

GPUS = {   # --gpu name -> jaxpar.measure.hardware.ACCELERATORS key
    "h100": "H100-SXM", "h100-sxm": "H100-SXM", "h100-pcie": "H100-PCIe", "h200": "H200-SXM",
    "a100": "A100-SXM-80GB", "a100-80gb": "A100-SXM-80GB", "a100-40gb": "A100-SXM-40GB",
}
# The link assumptions (LINK_EFFICIENCY of the datasheet achieved, α per link) live with the hardware table, which
# the schedule replay (measure/overlap.py) shares.


# ALPHA_NVLINK_S / ALPHA_INFINIBAND_S are one collective's small-message latency over REFERENCE_GROUP GPUs (inside one
# node, or one GPU in each of that many nodes). A collective pays a start-up per step of its algorithm, so α grows
# with the group: a ring all-gather or reduce-scatter takes p-1 steps, an all-to-all p-1 sends, a permute one, an
# all-reduce 2(p-1) as a ring or 2·log2(p) as NCCL's (double binary) tree, which NCCL picks where latency
# dominates: the planner charges the smaller. As in NCCL's own tuning model, a ring's steps between nodes cost the
# network's latency and its steps inside a node NVLink's; a step costs α / (the steps of a REFERENCE_GROUP collective).
REFERENCE_GROUP = 8


def latency_steps(op: str, group: int, nodes: int = 1) -> tuple[float, float]:
    """(steps inside nodes, steps between nodes) of one collective `op` over `group` devices on `nodes` nodes."""
    if group <= 1:
        return 0.0, 0.0
    if op == "permute":
        return (0.0, 1.0) if nodes > 1 else (1.0, 0.0)
    if op == "all-reduce":
        ring = (2.0 * (group - nodes), 2.0 * (nodes - 1))
        depth, across = math.ceil(math.log2(group)), math.ceil(math.log2(nodes)) if nodes > 1 else 0
        tree = (2.0 * (depth - across), 2.0 * across)
        return min(ring, tree, key=sum)
    return float(group - nodes), float(nodes - 1)


def collective_alpha(op: str, group: int, nodes: int, alpha_nvlink: float, alpha_network: float) -> float:
    """Start-up latency of one collective `op` over `group` devices spread over `nodes` nodes (see REFERENCE_GROUP)."""
    inside, between = latency_steps(op, group, nodes)
    reference = sum(latency_steps(op, REFERENCE_GROUP))
    return (inside * alpha_nvlink + between * alpha_network) / reference


@dataclasses.dataclass(frozen=True)
class Link:
    """α-β model of one kind of link; `per_op` holds measured (α, β) per collective where known (CPU bench)."""

    name: str
    alpha_s: float
    bus_bw: float                          # bytes/s per device per direction, achieved
    per_op: tuple = ()                     # ((op, alpha_s, bus_bw), ...)

    def params(self, op: str) -> tuple[float, float]:
        for name, alpha, beta in self.per_op:
            if name == op:
                return alpha, beta
        return self.alpha_s, self.bus_bw

    def time(self, op: str, bytes_sent: float, count: float) -> float:
        """Seconds for `count` collectives of kind `op` that together send `bytes_sent` from each device."""
        alpha, beta = self.params(op)
        return count * alpha + bytes_sent / beta


@dataclasses.dataclass(frozen=True)
class Cluster:
    """Nodes x devices per node of one kind, and everything the planner divides by."""

    name: str
    platform: str                          # "gpu" or "cpu" (what the compiled program does differs, see comm.py)
    nodes: int
    per_node: int
    peaks: tuple                           # ((compute dtype, dense FLOP/s per device), ...)
    hbm_bytes: float                       # memory per device
    mem_bw: float                          # memory bandwidth per device, bytes/s
    scaleup: Link
    scaleout: Link | None
    price_per_gpu_hour: float | None = None
    accelerator: str | None = None         # measure.hardware.ACCELERATORS key
    source: str = ""

    @property
    def devices(self) -> int:
        return self.nodes * self.per_node

    def peak(self, dtype: str) -> float:
        return dict(self.peaks)[dtype]

    def link(self, span: int, size: int | None = None) -> Link:
        """The link a collective group of `size` devices (default: `span`) spanning `span` consecutive device ids
        crosses; across nodes, its bandwidth is the group's GPUs per node x the per-GPU NIC's, capped by NVLink."""
        if span <= self.per_node or self.scaleout is None:
            return self.scaleup
        size = span if size is None else size
        stride = max(1, span // size)                 # device ids between neighbours of the group
        per_node = max(1, min(size, self.per_node // stride))
        if per_node == 1:
            return self.scaleout
        bw = min(per_node * self.scaleout.bus_bw, self.scaleup.bus_bw)
        return dataclasses.replace(self.scaleout, name=f"{self.scaleout.name} x{per_node} NICs", bus_bw=bw)

    def axis_link(self, cand, axis: str, op: str = "") -> Link:
        """The link one collective `op` over a candidate's mesh `axis` ("data+expert": both) crosses, with the group
        size its α grows with (GPU links; the CPU's α-β are measured per collective as they are).

        Across nodes an all-gather, reduce-scatter or all-reduce is a ring or tree through every NIC the group holds
        per node (`link`). An all-to-all is not: each device sends its own share to the other nodes through its own
        NIC, (n-g)/n of its buffer for g of the group's n devices on its node, while the (g-1)/n inside the node
        moves over NVLink at the same time; of the bytes it sends, (n-1)/n of the buffer, the NIC carries
        (n-g)/(n-1). A pipeline's permute sends each device's activation through its own NIC too."""
        names = axis.split("+")
        span = max(cand.span(a) for a in names)
        size = math.prod(cand.sizes[a] for a in names)
        link = self.link(span, size)
        if self.platform == "cpu" or self.scaleout is None:
            return link
        here = size if span <= self.per_node else max(1, min(size, self.per_node // max(1, span // size)))
        nodes = -(-size // here)                         # nodes the group spans; `here` of its devices on each
        if nodes > 1 and op in ("all-to-all", "permute"):
            nic = self.scaleout.bus_bw
            bw = min(nic * (size - 1) / (size - here), self.scaleup.bus_bw) if op == "all-to-all" else nic
            link = dataclasses.replace(self.scaleout, name=f"{self.scaleout.name} (each GPU's NIC)", bus_bw=bw)
        if op:
            alpha = collective_alpha(op, size, nodes, self.scaleup.alpha_s, self.scaleout.alpha_s)
            link = dataclasses.replace(link, alpha_s=alpha)
        return link

    def resized(self, nodes: int) -> Cluster:
        return dataclasses.replace(self, nodes=nodes)

    def describe(self) -> str:
        out = f"{self.nodes} x {self.per_node} {self.name}"
        links = f"{self.scaleup.name} {self.scaleup.bus_bw / GB:.0f} GB/s"
        if self.scaleout is not None and self.nodes > 1:
            links += f", {self.scaleout.name} {self.scaleout.bus_bw / GB:.0f} GB/s"
        return f"{out} ({self.hbm_bytes / GB:.0f} GB each; {links} per device, achieved)"


def gpu_cluster(gpu: str, nodes: int, per_node: int, *, nvlink_gbps: float | None = None,
                ib_gbps: float | None = None, price_per_gpu_hour: float | None = None) -> Cluster:
    """A cluster of `nodes` x `per_node` GPUs of type `gpu` (h100, h200, a100, ...); bandwidths in GB/s per
    direction override the datasheet's (before LINK_EFFICIENCY)."""
    from jaxpar.measure import hardware
    key = GPUS.get(str(gpu).lower())
    if key is None:
        raise ConfigError("--gpu", f"unknown GPU type '{gpu}'; valid: {', '.join(GPUS)}")
    for field, value in (("--nodes", nodes), ("--gpus-per-node", per_node)):
        if not isinstance(value, int) or value < 1:
            raise ConfigError(field, f"is {value}; must be a positive whole number")
    for field, rate in (("--nvlink-gbps", nvlink_gbps), ("--ib-gbps", ib_gbps), ("--price", price_per_gpu_hour)):
        if rate is not None and not rate > 0:
            raise ConfigError(field, f"is {rate}; must be positive")
    acc = hardware.ACCELERATORS[key]
    nvlink = (nvlink_gbps * GB if nvlink_gbps else acc.link_bw) * LINK_EFFICIENCY
    ib = (ib_gbps * GB if ib_gbps else acc.scaleout_bw) * LINK_EFFICIENCY
    peaks = (("bfloat16", acc.bf16_flops), ("float8", acc.fp8_flops or acc.bf16_flops), ("float32", acc.tf32_flops))
    return Cluster(name=acc.name, platform="gpu", nodes=nodes, per_node=per_node, peaks=peaks,
                   hbm_bytes=acc.hbm_bytes, mem_bw=acc.hbm_bw,
                   scaleup=Link("NVLink", ALPHA_NVLINK_S, nvlink), scaleout=Link("InfiniBand", ALPHA_INFINIBAND_S, ib),
                   price_per_gpu_hour=price_per_gpu_hour, accelerator=key,
                   source=f"{acc.source}; links x {LINK_EFFICIENCY} achieved (assumption)")


def cpu_cluster(devices: int, fits: dict, host_flops: float, host_copy_bw: float, host_memory: float,
                cores: int = 1) -> Cluster:
    """The CPU "cluster": `devices` virtual devices of one process sharing the host's cores and memory.

    `fits`: α-β per op ({op: {"alpha_us", "beta_bus_GBps"}}: `jaxpar bench collectives`' or plan/cpu_links.py's);
    the peak and memory bandwidth are the host probe's, divided among the devices (they run at once on shared
    cores). The probe's matmul uses every core, its copy one (numpy): the devices' memory-bound passes run on all
    `cores` at once, so they get `cores` x the copy rate (an AdamW update of 8 x 3.4M replicated fp32 parameters
    took 80-94 ms of process CPU time on 2 cores, ~48 bytes per parameter at that rate: steptime.ADAM_BYTES_PER_PARAM).
    """
    per_op = tuple((op, fit["alpha_us"] * 1e-6, fit["beta_bus_GBps"] * GB) for op, fit in fits.items()
                   if fit.get("beta_bus_GBps"))
    measured = {op: (alpha, beta) for op, alpha, beta in per_op}
    default = measured.get("all-reduce") or (per_op[0][1:] if per_op else (0.0, host_copy_bw))
    peak = host_flops / devices
    return Cluster(name="virtual CPU device", platform="cpu", nodes=1, per_node=devices,
                   peaks=(("float32", peak), ("bfloat16", peak), ("float8", peak)),
                   hbm_bytes=host_memory / devices, mem_bw=host_copy_bw * cores / devices,
                   scaleup=Link("host memory", default[0], default[1], per_op), scaleout=None,
                   source=f"host probe {host_flops / 1e9:.1f} GFLOP/s f32, copy {host_copy_bw / GB:.1f} GB/s, "
                          f"x {cores} cores, shared by {devices} devices; collectives α-β measured")
