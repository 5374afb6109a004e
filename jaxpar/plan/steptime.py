"""Per-step time of one candidate: compute at a calibrated efficiency + memory-bound passes + exposed
communication per axis (the strategy's predicted flows) + the pipeline bubble + fixed overheads.

`step_time` returns the terms (`StepTime`); the constants below are assumptions unless said otherwise
(`Calibration`, fitted η: plan/anchors.py). Each term's derivation and the calibration:
experiments/10_capstone/README.md, "How the model is built".
"""
from __future__ import annotations

import dataclasses

from jaxpar.model.counting import ModelShape
from jaxpar.parallel.memory import kept_per_layer, sequence_split
from jaxpar.parallel.registry import predict
from jaxpar.parallel.theory import Candidate, Prediction, rows_per_microbatch
from jaxpar.plan.fleet import Cluster
from jaxpar.plan.gemm import gemm_efficiency
from jaxpar.plan.overlap import hidden_fraction, layout_key
from jaxpar.plan.overlap import measured as measured_overlap

COMPUTE_EFFICIENCY = 0.6973     # jaxpar/plan/anchors.py FITTED["jaxpar (XLA)"]
FP8_EFFICIENCY = 0.7286         # NeMo's, FITTED["NeMo"]: no published XLA fp8 run is anchored
OVERLAP = 0.6
MEMORY_EFFICIENCY = 0.8
STEP_OVERHEAD_S = 0.010
LAYER_OVERHEAD_S = 60e-6
# Bytes moved per S x S element per layer by the einsum attention (scores bf16 written and read, softmax in
# fp32 fused into one read and one bf16 write of the probabilities, read again by the PV matmul: ~12 forward;
# the backward reads the probabilities, writes and reads their gradient and the scores' gradient: ~24).
SCORE_BYTES = {"forward": 12, "backward": 24}
# AdamW's bytes per parameter a device updates: read p, g, μ, ν and write p, μ, ν in fp32 (28) and a little more (32).
# MEASURED on CPU: the default model's update replicated on 8 virtual devices took 39.8-47.1 ms of CPU time per core,
# 46.9-51.3 bytes per parameter at the host's copy rate over its cores (experiments/10_capstone/adam_cost.py, four
# runs; the optimizer's fused loops make more than one pass).
ADAM_BYTES_PER_PARAM = {"cpu": 48, "gpu": 32}
# Passes over the residual stream per layer, in elements of the activation dtype: forward, two RMSNorms (read,
# write) and two residual adds (two reads, a write) = 10; the backward pass twice that; remat `full` the forward
# again. Tensor parallelism without sequence parallelism does not split the residual stream: every device of a
# tensor group makes these passes over all of its group's tokens (why Megatron added sequence parallelism); with it
# (`sequence`), each device makes them over its 1/tensor of the tokens.
RESIDUAL_PASSES = {"forward": 10, "backward": 20}
# parallel.data = zero1 / zero2 (parallel/zero.py): the compiled step copies a full fp32 parameter-sized buffer three
# more times than DDP (gradient into the reduce-scatter's layout, gathered parameters into the state), each read
# and written: the default model's XLA:CPU program has 82 MB of copy ops per device against DDP's 41 MB (4Ψ = 13.7
# MB). Assumed the same on GPU.
ZERO_COPIES = {"zero1": 3, "zero2": 3}
# Cost of the activations a layer keeps for the backward (memory.kept_per_layer), per microbatch, in passes at the copy
# rate: the forward stacks each into the layer scan's buffer and the backward reads it back. This is what remat saves
# against its recomputation: the default model's compiled XLA:CPU data=8 step stacks 34.8 MB per device per step
# without remat and 1.0 MB with remat full (memory.py predicts 42.3 / 1.0), while executing 24% more matmul FLOPs.
# MEASURED on CPU: on one device, the whole 16 x 128 batch, process CPU seconds (medians of 9 rounds, three runs),
# loss+grad took 0.818-0.869 s without remat, 0.872-0.938 with remat full, the forward alone 0.192-0.214, so the kept
# bytes cost the difference plus the recomputed forward (its FLOPs' share, 64%): 0.062-0.080 s for 338 MB, 2.2-3.2
# passes at 12.2-13.8 GB/s (experiments/10_capstone/kept_cost.py, tests/test_plan_cpu.py). That is with glibc keeping
# freed memory (measure/host_allocator.py); with its default, the 350 MB buffer of each call is mapped afresh and
# page-faulted in, and the same A/B gave 6-10.6 passes.
# Charged on XLA:CPU only: the GPU anchors (plan/anchors.py) are fitted without it, and whether XLA:GPU's fusions
# write the stack in place has not been measured here.
KEPT_PASSES = {"cpu": 3, "gpu": 0}


@dataclasses.dataclass(frozen=True)
class Calibration:
    """The efficiencies the model divides by; `source` says where each comes from."""

    compute: float = COMPUTE_EFFICIENCY
    fp8: float = FP8_EFFICIENCY
    overlap: float = OVERLAP
    memory: float = MEMORY_EFFICIENCY
    step_overhead_s: float = STEP_OVERHEAD_S
    layer_overhead_s: float = LAYER_OVERHEAD_S      # per layer per microbatch
    gemm_size: bool = True                          # scale matmul efficiency by GEMM size (plan/gemm.py)
    source: str = "assumptions anchored on published H100 MFU (see jaxpar/plan/steptime.py)"
    measured: tuple = ()    # ((layout key, axis), hidden fraction): compiled schedules (plan/overlap.py)
    activations: str = "jaxpar"   # whose kernels' kept activations the memory counts (plan/framework_memory.py)


GPU_CALIBRATION = Calibration(measured=measured_overlap(),
                              source="assumptions anchored on published H100 MFU (see jaxpar/plan/steptime.py); "
                                     "overlap per strategy and axis from compiled H100 schedules where measured "
                                     "(jaxpar/plan/overlap_measured.json)")
# `jaxpar plan --cpu-devices N`: the host probe's rates as they are, nothing hidden, no overheads (uncalibrated: lab 10
# measures η and the CPU's fixed overheads, plan/reality.py).
HOST_CALIBRATION = Calibration(compute=1.0, overlap=0.0, memory=1.0, step_overhead_s=0.0, layer_overhead_s=0.0,
                               source="host probe rates, uncalibrated (lab 10 calibrates them)")


@dataclasses.dataclass(frozen=True)
class StepTime:
    compute_s: float
    memory_s: float
    comm_s: dict            # axis -> seconds if nothing were hidden
    exposed_s: dict         # axis -> seconds exposed
    bubble_s: float
    bubble_fraction: float
    executed_flops: float   # per device per step
    model_flops: float      # per device per step (the MFU numerator)
    overhead_s: float = 0.0  # fixed per step and per microbatch
    gemm_efficiency: float = 1.0   # the size factor g of the weight matmuls

    @property
    def total_s(self) -> float:
        return self.compute_s + self.memory_s + sum(self.exposed_s.values()) + self.bubble_s + self.overhead_s

    @property
    def serial_s(self) -> float:
        """The same step with nothing overlapped: the pessimistic bound."""
        return self.compute_s + self.memory_s + sum(self.comm_s.values()) + self.bubble_s + self.overhead_s

    def terms(self) -> dict[str, float]:
        """Every term of the step, for the breakdown and for saying which dominates."""
        out = {"compute": self.compute_s, "memory-bound passes": self.memory_s}
        out.update({f"exposed {axis}": t for axis, t in self.exposed_s.items() if t > 0})
        if self.bubble_s:
            out["pipeline bubble"] = self.bubble_s
        if self.overhead_s:
            out["fixed overheads"] = self.overhead_s
        return out


def executed_flops_per_token(shape: ModelShape, seq_len: int, remat: str, attention: str) -> dict[str, float]:
    """FLOPs per token the compiled step executes, split into weight matmuls and attention (see module doc)."""
    d, L = shape.d_model, shape.layers
    matmul = 6.0 * shape.active_matmul_params()
    unit = 2.0 * shape.heads * shape.head_dim * seq_len * L          # one S x S einsum, all layers, per token
    if remat == "full":
        outputs = shape.heads * shape.head_dim * d + d * (shape.expert_mlp_dim * (shape.top_k + shape.shared_experts)
                                                         if shape.experts else shape.mlp_dim)
        per_layer_forward = (shape.active_matmul_params() - d * shape.vocab) / L - outputs
        matmul += 2.0 * per_layer_forward * L
    if attention == "flash":
        attn = 0.5 * unit * ((2 + 5) + (2 if remat in ("full", "dots") else 0))
    else:
        attn = unit * (6 + {"full": 2, "dots": 1}.get(remat, 0))
    return {"matmul": matmul, "attention": attn}


def step_time(shape: ModelShape, cand: Candidate, cluster: Cluster, global_batch: int, seq_len: int,
              calibration: Calibration = GPU_CALIBRATION, prediction: Prediction | None = None) -> StepTime:
    """Predict one optimizer step of `cand` on `cluster` (see the module docstring).

    `prediction`: the strategy's (default: asked of it): its collectives, bubble, and the parameters a device updates.
    """
    if prediction is None:
        prediction = predict(shape, cand, global_batch, seq_len, cluster.platform)
    n = cand.devices
    tokens = global_batch * seq_len
    per_token = executed_flops_per_token(shape, seq_len, cand.remat, cand.attention)
    matmul = per_token["matmul"] * tokens / n
    attention = per_token["attention"] * tokens / n
    dtype = "bfloat16" if cand.precision != "float32" else "float32"
    bf16_rate = calibration.compute * cluster.peak(dtype)
    matmul_peak = cluster.peak("float8") if cand.precision == "float8" else cluster.peak(dtype)
    size = (gemm_efficiency(shape, cand, rows_per_microbatch(cand, global_batch) * seq_len,
                            matmul_peak / cluster.mem_bw) if calibration.gemm_size else 1.0)
    if cand.precision == "float8":
        compute = matmul / (calibration.compute * calibration.fp8 * size * matmul_peak) + attention / bf16_rate
    else:
        compute = matmul / (bf16_rate * size) + attention / bf16_rate
    overhead = (calibration.step_overhead_s
                + calibration.layer_overhead_s * (shape.layers / cand.pipe + 2) * cand.microbatches)

    mem_rate = calibration.memory * cluster.mem_bw
    updated = prediction.stored["optimizer"]
    memory = ADAM_BYTES_PER_PARAM[cluster.platform] * updated / mem_rate
    e = 4 if cand.precision == "float32" else 2
    passes = RESIDUAL_PASSES["forward"] * (2 if cand.remat == "full" else 1) + RESIDUAL_PASSES["backward"]
    residual_tokens = (tokens / cand.batch_shards * shape.layers / cand.pipe      # token-layers one device sees
                       / sequence_split(cand))
    memory += residual_tokens * shape.d_model * e * passes / mem_rate
    if cand.data > 1:
        memory += ZERO_COPIES.get(cand.data_impl, 0) * 2 * 4 * shape.params / (cand.fsdp * cand.tensor) / mem_rate
    kept = (kept_per_layer(shape, cand, global_batch, seq_len, cluster.platform) * shape.layers / cand.pipe
            * cand.microbatches)
    memory += KEPT_PASSES[cluster.platform] * kept / mem_rate
    if cand.attention == "dot":
        b = rows_per_microbatch(cand, global_batch)
        elements = b * (shape.heads / cand.tensor) * seq_len**2 * shape.layers / cand.pipe * cand.microbatches
        passes = SCORE_BYTES["forward"] * (2 if cand.remat in ("full", "dots") else 1) + SCORE_BYTES["backward"]
        memory += elements * passes / mem_rate

    flow_list = prediction.flows
    comm: dict[str, float] = {}
    hideable = 0.0
    exposed: dict[str, float] = {}
    layout = layout_key(cand)           # every axis's implementation and overlap option (plan/overlap.py)
    measured = {f.axis: hidden_fraction(calibration.measured, layout, f.axis) for f in flow_list
                if cluster.platform != "cpu"}
    for f in flow_list:
        link = cluster.axis_link(cand, f.axis, f.op)
        t = link.time(f.op, f.bytes, f.count)
        comm[f.axis] = comm.get(f.axis, 0.0) + t
        known = measured.get(f.axis)
        if known is not None:                   # the compiled schedule's own fraction (lab 05)
            exposed[f.axis] = exposed.get(f.axis, 0.0) + t * (1 - known)
        elif f.hideable and cluster.platform != "cpu":
            hideable += t
            exposed[f.axis] = exposed.get(f.axis, 0.0) + t * (1 - calibration.overlap)
        else:
            exposed[f.axis] = exposed.get(f.axis, 0.0) + t
    window = calibration.overlap * compute
    spill = max(0.0, hideable * calibration.overlap - window)     # more to hide than compute to hide it behind
    if spill and hideable:
        for f in flow_list:
            if f.hideable and measured.get(f.axis) is None:
                exposed[f.axis] += spill * cluster.axis_link(cand, f.axis, f.op).time(f.op, f.bytes, f.count) / hideable

    fraction = prediction.bubble
    busy = compute + memory + exposed.get("tensor", 0.0)
    bubble = float(busy * fraction / (1 - fraction)) if fraction else 0.0
    model = shape.flops_per_token(seq_len) * tokens / n
    return StepTime(compute, memory, comm, exposed, bubble, float(fraction), matmul + attention, model,
                    overhead, size)
