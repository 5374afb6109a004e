"""One candidate strategy, and the space the planner enumerates.

A candidate is a point in (mesh sizes data x fsdp x tensor x pipe x expert, how `data`
is implemented, microbatches, pipeline schedule, remat policy, compute precision,
attention kernel). `enumerate_candidates` lists every one a model and a cluster allow:
each axis size divides what it splits (heads, kv_heads, the MLP, the vocabulary for
`tensor`; d_model for `fsdp`; layers for `pipe`; experts for `expert`; the global batch
for data x fsdp x expert x microbatches). Whether jaxpar has a trainer that runs a
candidate is not decided here: that is the registry's job at verification time.
"""
from __future__ import annotations

import dataclasses
import itertools

from jaxpar.plan.shape import ModelShape

AXES = ("data", "fsdp", "pipe", "expert", "tensor")      # jaxpar.mesh's order: tensor innermost
SHORT = {"expert": "ep", "tensor": "tp"}                 # labels: data=8 fsdp=8 tp=2
REMATS = ("none", "dots", "full")
PRECISIONS = ("bfloat16", "float8", "float32")
ATTENTIONS = ("dot", "flash")      # dot: jaxpar's einsum attention (S x S scores); flash: a fused kernel
SCHEDULES = ("1f1b", "interleaved", "zb-h1", "gpipe")
DATA_IMPLS = ("auto", "zero1", "zero3")    # parallel.data: XLA's data parallel, or parallel/zero.py's stages
VIRTUAL = 2                         # chunks per stage of the interleaved schedule (the pipeline branch's default)
# Left out of the space, because the planner cannot predict it (deviceless H100 compiles of the 7B): jaxpar's fp8
# matmuls (per-tensor current scaling, model/fp8.py) under tensor parallelism compiled to 3.5x the tensor-axis
# bytes of bf16 and 14-32% more memory than plan/memory.py's fp8 terms; inside a pipeline stage they keep less than
# those terms say (remat dots kept what remat full keeps: 40.7 GiB where the model said 70).
FP8_NOT_MODELLED = "fp8 with tensor > 1 or pipe > 1: not modelled, not ranked"


@dataclasses.dataclass(frozen=True)
class Candidate:
    data: int = 1
    fsdp: int = 1
    tensor: int = 1
    pipe: int = 1
    expert: int = 1
    microbatches: int = 1          # gradient accumulation; with pipe > 1, the pipeline's microbatches
    schedule: str = ""             # pipeline schedule when pipe > 1
    remat: str = "full"
    precision: str = "bfloat16"
    attention: str = "dot"
    data_impl: str = "auto"

    @property
    def sizes(self) -> dict[str, int]:
        return {axis: getattr(self, axis) for axis in AXES}

    @property
    def devices(self) -> int:
        return self.data * self.fsdp * self.tensor * self.pipe * self.expert

    @property
    def batch_shards(self) -> int:
        """How many ways the batch is split: data x fsdp x expert (tensor and pipe see every sequence)."""
        return self.data * self.fsdp * self.expert

    @property
    def virtual(self) -> int:
        return VIRTUAL if self.schedule == "interleaved" else 1

    def mesh_text(self) -> str:
        used = [f"{SHORT.get(a, a)}={s}" for a, s in self.sizes.items() if s > 1]
        mesh = " ".join(used) or "1 device"
        if self.data_impl != "auto" and self.data > 1:
            mesh = mesh.replace(f"data={self.data}", f"{self.data_impl}={self.data}")
        return mesh

    def label(self) -> str:
        pipe = f" {self.schedule}" if self.pipe > 1 else ""
        return (f"{self.mesh_text()}{pipe} m={self.microbatches} remat={self.remat} "
                f"{ {'bfloat16': 'bf16', 'float8': 'fp8', 'float32': 'fp32'}[self.precision]} {self.attention}")

    def span(self, axis: str) -> int:
        """Consecutive device ids one collective group of `axis` spans (mesh order, tensor innermost)."""
        stride = 1
        for name in reversed(AXES):
            if name == axis:
                return stride * getattr(self, name)
            stride *= getattr(self, name)
        raise KeyError(axis)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def mesh_choices(shape: ModelShape, devices: int, global_batch: int) -> list[dict[str, int]]:
    """Every (data, fsdp, tensor, pipe, expert) whose product is `devices` and whose sizes divide what they split."""
    out = []
    for tensor in divisors(devices):
        if shape.heads % tensor or shape.kv_heads % tensor or shape.mlp_dim % tensor or shape.vocab % tensor:
            continue
        if shape.experts and shape.expert_mlp_dim % tensor:
            continue
        for pipe in divisors(devices // tensor):
            if shape.layers % pipe:
                continue
            for expert in divisors(devices // (tensor * pipe)):
                if expert > 1 and (not shape.experts or shape.experts % expert):
                    continue
                rest = devices // (tensor * pipe * expert)
                for fsdp in divisors(rest):
                    data = rest // fsdp
                    if shape.d_model % fsdp or global_batch % (data * fsdp * expert):
                        continue
                    out.append({"data": data, "fsdp": fsdp, "tensor": tensor, "pipe": pipe, "expert": expert})
    return out


def microbatch_choices(rows: int, pipe: int, schedule: str) -> list[int]:
    """Microbatch counts for `rows` sequences per data shard: powers of two (and rows itself) dividing rows;
    a pipeline needs at least `pipe` of them (interleaved: a multiple of pipe)."""
    counts = sorted({m for m in [2**k for k in range(16)] + [rows] if m <= rows and rows % m == 0})
    if pipe == 1:
        return counts
    return [m for m in counts if m >= pipe and (schedule != "interleaved" or m % pipe == 0)]


def enumerate_candidates(shape: ModelShape, devices: int, global_batch: int, *, remats=REMATS,
                         precisions=("bfloat16", "float8"), attentions=ATTENTIONS, schedules=SCHEDULES,
                         data_impls=DATA_IMPLS) -> list[Candidate]:
    """The strategy space: every mesh x microbatches x schedule x remat x precision x attention allowed."""
    out = []
    for sizes in mesh_choices(shape, devices, global_batch):
        rows = global_batch // (sizes["data"] * sizes["fsdp"] * sizes["expert"])
        pipe = sizes["pipe"]
        only_data = sizes["data"] > 1 and sizes["data"] == devices
        impls = [i for i in data_impls if i == "auto" or only_data]
        for schedule in (schedules if pipe > 1 else ("",)):
            if schedule == "interleaved" and (shape.layers // pipe) % VIRTUAL:
                continue
            for m in microbatch_choices(rows, pipe, schedule):
                for impl, remat, precision, attention in itertools.product(impls, remats, precisions, attentions):
                    if precision == "float8" and (sizes["tensor"] > 1 or pipe > 1):
                        continue          # not modelled: see FP8_NOT_MODELLED
                    out.append(Candidate(**sizes, microbatches=m, schedule=schedule, remat=remat,
                                         precision=precision, attention=attention, data_impl=impl))
    return out


def candidate_from_config(config, sizes: dict[str, int], platform: str = "gpu") -> Candidate:
    """The candidate a config runs (the inverse of plan/verify.py's `candidate_overrides`)."""
    parallel, model = config.parallel, config.model
    pipe = sizes.get("pipe", 1)
    microbatches = config.train.microbatches
    if pipe > 1 and parallel.get("pipe_microbatches", 0):
        microbatches = parallel.pipe_microbatches
    elif pipe > 1:
        microbatches = 2 * pipe             # the pipeline trainers' default
    kernel = model.get("attention", "dot")
    fused = kernel in ("cudnn", "pallas") or (kernel == "auto" and platform == "gpu")
    return Candidate(**{axis: sizes.get(axis, 1) for axis in AXES}, microbatches=microbatches,
                     schedule=parallel.pipe if pipe > 1 else "", remat=config.train.remat,
                     precision=config.train.compute_dtype, attention="flash" if fused else "dot",
                     data_impl=parallel.data)
