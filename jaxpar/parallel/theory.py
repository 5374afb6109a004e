"""What a strategy predicts for one training step, before anything is compiled: the contract of `Strategy.predict`.

A `Candidate` is one point of the strategy space: mesh sizes, which implementation runs each axis,
microbatches, pipeline schedule, remat, precision, attention kernel. The built-in axes are its named fields;
an axis a registered strategy adds (jaxpar/strategies.py) is an entry of `added`; `sizes` and `impls` map
every axis. A strategy's `predict(shape, cand, global_batch, seq_len, platform)` returns a `Prediction`:
every collective `Flow` (bytes each device sends
per step on one mesh axis, its kind, how many collectives carry it, whether the compiler can hide it),
the pipeline bubble and the stash. The dry run compares it with the compiled program, the planner ranks
with it, the labs print it: nothing else predicts a strategy. Plain Python: no JAX import.
"""
from __future__ import annotations

import dataclasses
import math
from fractions import Fraction

from jaxpar.config import ConfigError, fused_attention
from jaxpar.parallel.expert_sizes import received_rows, resolve
from jaxpar.parallel.schedules import chunks_per_stage, pipeline_microbatches
from jaxpar.strategies import BUILT_IN_AXES, added_axes

AXES = BUILT_IN_AXES   # jaxpar.mesh's order: tensor innermost (the added axes come before them)
SHORT = {"expert": "ep", "context": "cp", "tensor": "tp"}        # labels: data=8 fsdp=8 tp=2
VIRTUAL = chunks_per_stage("interleaved")   # the interleaved schedule's chunks per stage when the config leaves 0
WEIGHTS_PER_LAYER = 9        # attn_norm, wq, wk, wv, wo, mlp_norm, w_gate, w_up, w_down: one collective each
OTHER_WEIGHTS = 3            # embed, lm_head, final_norm


@dataclasses.dataclass(frozen=True)
class Candidate:
    data: int = 1
    fsdp: int = 1
    tensor: int = 1
    pipe: int = 1
    expert: int = 1
    context: int = 1               # the sequence split inside attention (parallel.context)
    microbatches: int = 1          # gradient accumulation; with pipe > 1, the pipeline's microbatches
    accumulate: int = 1            # with pipe > 1: train.microbatches, the whole pipeline run that many times
    schedule: str = ""             # parallel.pipe when pipe > 1
    remat: str = "full"
    precision: str = "bfloat16"
    attention: str = "dot"         # dot: jaxpar's einsum attention (S x S scores); flash: a fused kernel
    data_impl: str = "auto"        # parallel.data
    tensor_impl: str = "auto"      # parallel.tensor
    expert_impl: str = "auto"      # parallel.expert
    expert_exchange: str = "auto"  # parallel.expert_exchange: how manual dropless EP sizes its buffers
    context_impl: str = "auto"     # parallel.context: ring | all_to_all when context > 1
    sequence: bool = False         # sequence parallelism over tensor: the token-wide activations split (memory.py);
    #                                jaxpar builds it as parallel.sequence under tensor_impl manual (plan/verify.py)
    virtual: int = 0               # chunks per stage; 0: the schedule's own (schedules.chunks_per_stage)
    grad_buckets: int = 0          # parallel.grad_buckets (data_impl ddp, zero2): layer gradients reduced in buckets
    layout: str = "jaxpar"         # model-state layout the planner's memory assumes (plan/layouts.py)
    tensor_overlap: str = "none"   # parallel.tensor_overlap (tensor_impl manual + sequence): collective matmul
    prefetch: bool = False         # parallel.prefetch (data_impl zero3): layer i+1 gathered during layer i
    added: tuple[tuple[str, int, str], ...] = ()   # (axis, size, parallel.<axis>) of each added axis in use (> 1)

    def __post_init__(self):
        if not self.virtual:
            object.__setattr__(self, "virtual", chunks_per_stage(self.schedule))
        object.__setattr__(self, "added", tuple((a, int(s), i) for a, s, i in self.added if s > 1))

    @property
    def sizes(self) -> dict[str, int]:
        """Every mesh axis in use and its size, in mesh order (the added axes outermost)."""
        return {**{axis: size for axis, size, _ in self.added}, **{axis: getattr(self, axis) for axis in AXES}}

    @property
    def impls(self) -> dict[str, str]:
        """`parallel.<axis>` of every mesh axis: what the strategy registry matches on."""
        return {"data": self.data_impl, "fsdp": "auto", "pipe": self.schedule if self.pipe > 1 else "auto",
                "expert": self.expert_impl, "context": self.context_impl if self.context > 1 else "auto",
                "tensor": self.tensor_impl, **{axis: impl for axis, _, impl in self.added}}

    @property
    def devices(self) -> int:
        return math.prod(self.sizes.values())

    def to_dict(self) -> dict:
        """The fields as a plan's JSON records them (`added` only when an added axis is in use)."""
        fields = dataclasses.asdict(self)
        if not self.added:
            del fields["added"]
        return fields

    @property
    def batch_shards(self) -> int:
        """How many ways the batch is split: data x fsdp x expert (tensor and pipe see every sequence)."""
        return self.data * self.fsdp * self.expert

    def mesh_text(self) -> str:
        words = {**SHORT, **{a: impl for a, _, impl in self.added if impl != "auto"}}   # by implementation, as zero1=8
        used = [f"{words.get(a, a)}={s}" for a, s in self.sizes.items() if s > 1]
        mesh = " ".join(used) or "1 device"
        if self.data_impl != "auto" and self.data > 1:
            mesh = mesh.replace(f"data={self.data}", f"{self.data_impl}={self.data}")
        return mesh

    def label(self) -> str:
        """The words of `jaxpar plan --strategy` that give back this candidate (plan/strategy.py)."""
        sp = " all_to_all" if self.context > 1 and self.context_impl == "all_to_all" else ""   # ring: cp's default
        sp += " sp" if self.sequence else ""
        if self.sequence and self.tensor_overlap != "none":
            sp += " async-tp" if self.tensor_overlap == "collective_matmul" else f" async-tp={self.tensor_overlap}"
        pipe = f" {self.schedule}" if self.pipe > 1 else ""
        if self.pipe > 1 and self.schedule == "interleaved" and self.virtual != VIRTUAL:
            pipe += f" v={self.virtual}"
        state = {"distributed-optimizer": " dist-opt",
                 "distributed-optimizer-bf16-grads": " dist-opt=bf16-grads"}.get(self.layout, "")
        return (f"{self.mesh_text()}{sp}{pipe} m={self.microbatches} remat={self.remat} "
                f"{ {'bfloat16': 'bf16', 'float8': 'fp8', 'float32': 'fp32'}[self.precision]} {self.attention}{state}")

    def span(self, axis: str) -> int:
        """Consecutive device ids one collective group of `axis` spans (mesh order, tensor innermost); a group
        over several axes ("data+expert") spans the widest."""
        if "+" in axis:
            return max(self.span(a) for a in axis.split("+"))
        stride = 1
        for name, size in reversed(self.sizes.items()):
            if name == axis:
                return stride * size
            stride *= size
        raise KeyError(axis)


@dataclasses.dataclass(frozen=True)
class Flow:
    axis: str            # mesh axis (a group over several axes is named "data+expert")
    op: str              # all-gather | reduce-scatter | all-reduce | all-to-all | permute
    bytes: float         # sent per device per step
    count: float         # collectives per step
    hideable: bool


@dataclasses.dataclass(frozen=True)
class Prediction:
    """One step of a candidate as its strategy predicts it (per device)."""

    flows: list[Flow]
    stored: dict[str, float]            # parameters this device stores ("params"), holds gradients of ("grads"),
    #                                     updates ("optimizer"): `stored_params`
    bubble: Fraction = Fraction(0)      # idle fraction of the pipeline schedule
    stash: float = 1.0                  # microbatches whose activations a stage holds at once
    note: str = ""                      # what the prediction leaves out

    def bytes_by_axis(self) -> dict[str, float]:
        return bytes_by_axis(self.flows)


def bytes_by_axis(flow_list: list[Flow]) -> dict[str, float]:
    out: dict[str, float] = {}
    for f in flow_list:
        out[f.axis] = out.get(f.axis, 0.0) + f.bytes
    return out


def stored_params(shape, cand: Candidate, data_shards: dict[str, int] | None = None) -> dict[str, float]:
    """Parameters one device stores, holds gradients of and updates, with the layers split over pipe (the routed
    experts also over expert) and everything over fsdp x tensor; `data_shards` splits a part further over data."""
    c = shape.counts()
    layers = c["blocks"] - c["experts"] + c["experts"] / cand.expert
    each = (layers / cand.pipe + c["total"] - c["blocks"]) / (cand.fsdp * cand.tensor)
    return {part: each / (data_shards or {}).get(part, 1) for part in ("params", "grads", "optimizer")}


def wire_bytes(precision: str, platform: str) -> int:
    """Bytes per element a collective moves: 4 on CPU (XLA:CPU communicates bf16 in fp32), else the
    activation dtype's (float8 computes its non-matmul work, and communicates, in bf16)."""
    if platform == "cpu":
        return 4
    return 4 if precision == "float32" else 2


def rows_per_microbatch(cand: Candidate, global_batch: int) -> float:
    return global_batch / cand.batch_shards / cand.microbatches


def candidate_from_config(config, sizes: dict[str, int], platform: str = "gpu") -> Candidate:
    """The candidate a config runs (the inverse of plan/verify.py's `candidate_overrides`)."""
    parallel, model = config.parallel, config.model
    pipe = sizes.get("pipe", 1)
    microbatches = config.train.microbatches
    accumulate = 1
    if pipe > 1:
        microbatches = pipeline_microbatches(pipe, parallel.pipe_microbatches)
        accumulate = config.train.microbatches
    return Candidate(**{axis: sizes.get(axis, 1) for axis in AXES},  # type: ignore[arg-type]  # the int mesh axes
                     microbatches=microbatches, accumulate=accumulate,
                     schedule=parallel.pipe if pipe > 1 else "", remat=config.train.remat,
                     precision=config.train.compute_dtype,
                     attention="flash" if fused_attention(model.attention, platform) else "dot",
                     data_impl=parallel.data, tensor_impl=parallel.tensor, expert_impl=parallel.expert,
                     expert_exchange=parallel.expert_exchange,
                     context_impl=parallel.context,
                     sequence=bool(parallel.sequence),
                     virtual=parallel.pipe_virtual if pipe > 1 else 0,
                     grad_buckets=parallel.grad_buckets,
                     tensor_overlap=parallel.tensor_overlap,
                     prefetch=bool(parallel.prefetch),
                     added=tuple((axis, sizes.get(axis, 1), parallel[axis]) for axis in added_axes()))


def moe_all_to_all_bytes(shape, cand: Candidate, global_batch: int, seq_len: int, platform: str, *,
                         microbatches: int | None = None, layers: int | None = None) -> dict[str, float]:
    """Bytes each device sends per step in the MoE layers' all_to_alls over `expert` (X devices); `microbatches`,
    `layers`: a pipeline's (m·train.microbatches, one stage's MoE layers), default the candidate's and every one.

    formula    per MoE layer, dispatch + combine move 2·T·k·h·e forward and again backward, T = tokens per
               device per microbatch, x (X-1)/X (a device keeps its own experts' share), x MoE layers x m.
    predicted  what jaxpar's buffers send (parallel/expert.py): capacity dispatch [E, groups, C, h] per exchange;
               dropless by parallel.expert_exchange (parallel/expert_exchange.py; auto: ragged on GPU, else
               capacity): padded, X chunks of T·min(k, E/X) rows; capacity, X chunks of ceil(1.25·T·k/X) rows
               (the step without overflow), plus for both the expert ids (int32) and for capacity the overflow
               vote (an int32 pmax), forward only; ragged, the rows the routing sends, T·k when it is balanced
               (the HLO lists its receive buffer, 1.25·T·k rows: an upper bound), plus the ids, the chunk sizes
               and offsets (3 int32[X] all_to_alls) and the vote (a fourth, and the pmax). With remat (any
               policy but none) the backward recomputes the forward exchanges: 6, not 4. `vote`: the pmax's
               part of it (an all-reduce; the rest are all_to_alls).
    """
    moe = shape.moe
    if moe is None:   # only a hand-written `plan --strategy ep=N` asks this of a dense model
        raise ConfigError("--strategy", f"ep={cand.expert} splits a MoE model's experts, but this model is dense "
                          "(model.moe.experts=0); leave ep= out, or plan an MoE config")
    X, m = cand.expert, microbatches or cand.microbatches
    b = global_batch // m // cand.batch_shards
    T, k, h, E = b * seq_len, moe.top_k, shape.d_model, moe.experts
    e = wire_bytes(cand.precision, platform)
    ring, per_step = (X - 1) / X, (shape.moe_layers if layers is None else layers) * m
    forward_runs = 1 if cand.remat == "none" else 2
    formula = ring * 2 * T * k * h * e * 2 * per_step
    if moe.dispatch == "capacity":
        slots = b // moe.group_sequences * E * moe.capacity(moe.group_sequences * seq_len)
        exchange, ids, vote = ring * slots * h * e, 0.0, 0.0
    else:
        kind = resolve(cand.expert_exchange, platform)
        rows = T * k if kind == "ragged" else received_rows(kind, T, k, E, X)
        vote = 0.0 if kind == "padded" else ring * 2 * 4 * forward_runs             # an all-reduce, not all_to_all
        sizes = ring * 4 * X * 4 if kind == "ragged" else 0.0
        exchange, ids = ring * rows * h * e, (ring * rows * 4 + sizes) * forward_runs + vote
    predicted = exchange * 2 * (1 + forward_runs) * per_step + ids * per_step
    return {"formula": formula, "predicted": predicted, "tokens_per_device": T, "vote": vote * per_step,
            "runs": 2 * (1 + forward_runs) * per_step}
