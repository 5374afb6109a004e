"""Dry run: compile a config's full training step for N devices without allocating it, and read the bill.

The train state and the batch are abstract (ShapeDtypeStructs with shardings), so a
7B model on 64 devices compiles on a laptop. From the compiled program we report,
per device: memory (compiler's accounting vs the ZeRO formulas), collectives per
mesh axis with bytes (vs the 2Ψ/3Ψ theory), FLOPs (vs 6Ψ per token), and a predicted
step time: the planner's calibrated model (jaxpar.plan.steptime), with the optimistic
bound (100% of peak, perfect overlap) beside it, labelled. The report's headline is
memory and communication; a GPU target adds the predicted step time. Virtual CPU
devices share one host's cores, so their time is no prediction for any accelerator:
it is reported below, labelled as theirs, and never as the headline.

Targets:
  cpu               N virtual CPU devices (`jax_num_cpu_devices`, fixed before JAX starts).
  h100, h200, a100  a real XLA:GPU compile with no GPU: a topology described by
                    jaxpar's own GpuTargetConfigProto files (measure/gpu_targets/) and
                    the CUDA PJRT plugin wheels (which compile without a GPU). Topology PxHxG =
                    partitions x hosts x GPUs per host.
"""
from __future__ import annotations

import json
import re
import resource
import time
from importlib import metadata
from pathlib import Path

from jaxpar.config import ConfigError

GPU_TARGETS = {   # target -> (GpuTargetConfigProto file, jaxpar.measure.hardware.ACCELERATORS key)
    "h100": ("h100.txtpb", "H100-SXM"),
    "h200": ("h200.txtpb", "H200-SXM"),
    "a100": ("a100.txtpb", "A100-SXM-80GB"),
}
TARGETS = ("cpu", *GPU_TARGETS)
TARGET_DIR = Path(__file__).parent / "measure" / "gpu_targets"
GIB = 2**30


# ----------------------------------------------------------------------------- targets

def parse_topology(text: str) -> tuple[int, int, int]:
    """'1x8x8' -> (partitions, hosts, gpus_per_host)."""
    m = re.fullmatch(r"\s*(\d+)x(\d+)x(\d+)\s*", text or "")
    if not m or min(int(g) for g in m.groups()) < 1:
        raise ConfigError("--topology", f"'{text}' is not PxHxG (partitions x hosts x gpus_per_host), e.g. 1x8x8")
    return tuple(int(g) for g in m.groups())


def gpu_plugin_problem() -> str | None:
    """Why a deviceless GPU compile cannot run here (None: it can): the CUDA plugin wheels must match jaxlib."""
    jaxlib = metadata.version("jaxlib")
    for cuda in ("cuda12", "cuda13"):
        versions = []
        for dist in (f"jax-{cuda}-plugin", f"jax-{cuda}-pjrt"):
            try:
                versions.append(metadata.version(dist))
            except metadata.PackageNotFoundError:
                versions.append(None)
        if versions == [jaxlib, jaxlib]:
            return None
        if any(versions):
            return (f"found jax-{cuda}-plugin {versions[0]} / jax-{cuda}-pjrt {versions[1]} but jaxlib is {jaxlib}; "
                    f"pip install --no-deps jax-{cuda}-plugin=={jaxlib} jax-{cuda}-pjrt=={jaxlib}")
    return (f"a deviceless GPU compile needs the jax-cuda12-plugin and jax-cuda12-pjrt wheels matching jaxlib "
            f"{jaxlib}: pip install --no-deps jax-cuda12-plugin=={jaxlib} jax-cuda12-pjrt=={jaxlib} "
            "(a separate venv is fine; no GPU needed)")


def prepare_process(target: str, devices: int | None) -> None:
    """Process-wide JAX settings a dry run needs; call before JAX starts a backend (the CLI does).

    cpu: the virtual device count. GPU targets: keep JAX on the CPU platform, so the
    installed CUDA plugin does not look for a GPU; the compile goes through the topology.
    """
    import jax
    if target == "cpu":
        if devices:
            try:
                jax.config.update("jax_num_cpu_devices", int(devices))
            except RuntimeError:   # JAX already started: `target_devices` reports a count mismatch
                pass
    elif target in GPU_TARGETS:
        jax.config.update("jax_platforms", "cpu")


def target_devices(target: str, devices=None, topology: str | None = None) -> tuple[list, dict]:
    """The devices to compile for and a description of the machine they form."""
    import jax
    if target not in TARGETS:
        raise ConfigError("--target", f"unknown target '{target}'; valid: {', '.join(TARGETS)}")
    if target == "cpu":
        if topology:
            raise ConfigError("--topology", "applies to GPU targets only; for cpu give --devices N")
        available = jax.devices("cpu")
        if devices is None:
            chosen = available
        elif isinstance(devices, int):
            if devices != len(available):
                raise ConfigError("--devices", f"{devices} CPU devices asked for but JAX started with "
                                  f"{len(available)}; the count is fixed before JAX starts: run "
                                  f"`jaxpar dryrun --target cpu --devices {devices}` in a fresh process")
            chosen = available
        else:
            chosen = list(devices)
        return chosen, {"target": "cpu", "platform": "cpu", "hosts": 1, "gpus_per_host": len(chosen),
                        "accelerator": None, "topology": None}

    file, accelerator = GPU_TARGETS[target]
    if topology is None:
        if not devices:
            raise ConfigError("--topology", f"target {target} needs --topology PxHxG (e.g. 1x8x8) or --devices N")
        n = int(devices)
        topology = f"1x1x{n}" if n <= 8 else (f"1x{n // 8}x8" if n % 8 == 0 else None)
        if topology is None:
            raise ConfigError("--devices", f"{n} GPUs do not fill 8-GPU hosts; give --topology PxHxG")
    partitions, hosts, per_host = parse_topology(topology)
    if devices is not None and not isinstance(devices, int):
        raise ConfigError("--devices", "GPU targets take a device count, not a device list")
    if devices and devices != partitions * hosts * per_host:
        raise ConfigError("--devices", f"{devices} does not match --topology {topology} "
                          f"= {partitions * hosts * per_host} GPUs")
    problem = gpu_plugin_problem()
    if problem:
        raise ConfigError("--target", problem)
    from jax.experimental import topologies
    try:
        topo = topologies.get_topology_desc(platform="cuda", target_config=(TARGET_DIR / file).read_text(),
                                            topology=topology)
    except Exception as err:   # noqa: BLE001 - XLA's error, reduced to one line
        raise ConfigError("--topology", f"XLA rejected {target} topology {topology}: "
                          f"{str(err).strip().splitlines()[0][:200]}") from None
    return list(topo.devices), {"target": target, "platform": "gpu", "hosts": partitions * hosts,
                                "gpus_per_host": per_host, "accelerator": accelerator, "topology": topology}


# ----------------------------------------------------------------------------- theory

def predicted_collective_bytes(config, model_cfg, sizes: dict[str, int], platform: str) -> dict[str, float]:
    """Bytes each device sends per step, by mesh axis, from the formulas the course teaches.

    Ψ = parameters; Ψ_L = the scanned blocks' share, Ψ_o = embedding, head, final norm.
    e = bytes per element on the wire: the compute dtype on GPU; 4 on CPU, where XLA
    computes (and communicates) bf16 in fp32. m = microbatches, b = micro-batch per device.

    fsdp (F):  weight all-gathers (F-1)/F·e·(2·m·Ψ_L + Ψ_o')/T: XLA gathers each scanned layer
               once in the forward loop and again in the backward loop of every microbatch
               (the gathered weights do not survive the loop boundary, with or without
               remat); the head and final norm (Ψ_o') once per step (loop-invariant, hoisted
               out of the accumulation loop; the head is sometimes gathered twice: ~+1%).
               An untied embedding is neither gathered nor its gradient reduced: the partitioner
               gathers the tokens of the fsdp group (F-1)/F·4·b·F·s, looks up its own columns
               of the table and moves the activations to batch sharding with an all-to-all,
               (F-1)/F·e·b·s·h forward and again backward, per microbatch; the backward
               all-to-all brings each device the gradient of its own columns (a tied table is
               gathered for the head like any weight, and so is a table also split by vocab
               over `tensor`, or whose tokens are split over data or expert too, see parallel/auto.py).
               Gradient reduction of the rest, Ψ/T, once per microbatch (XLA reduces inside the
               accumulation loop): GPU reduce-scatter (F-1)/F·e, CPU all-reduce of the full
               gradient + slice 2(F-1)/F·4. So ZeRO-3 ≈ 3Ψ·e·(F-1)/F on GPU and
               ≈ 4Ψ·4·(F-1)/F on CPU, at m = 1.
    data (D):  gradient all-reduce 2(D-1)/D·e·Ψ/(F·T) per microbatch (DDP: 2Ψ·e).
    parallel.data = ddp / zero1 (shard_map over `data`, parallel/zero.py): fp32 gradients accumulated
               locally and reduced once per step: DDP all-reduce 2(D-1)/D·4Ψ; ZeRO-1
               reduce-scatter + all-gather of the updated fp32 params 2(D-1)/D·4Ψ.
               zero2: each layer's gradient reduce-scattered inside every microbatch's backward
               pass, in the compute dtype, (D-1)/D·e·m·Ψ, + the fp32 all-gather (D-1)/D·4Ψ.
               zero3: per microbatch, in the compute dtype, layers gathered forward and backward
               and reduce-scattered 3Ψ_L, embedding/head/final norm gathered once and
               reduce-scattered 2Ψ_o (a tied embedding twice: 4Ψ_embed), times (D-1)/D·e·m.
    tensor (T): activation all-reduces 2(T-1)/T·e·b·s·h each: Megatron's 2 forward + 2 backward
               per layer, +1 with remat 'full' (XLA recomputes the attention output projection's
               all-reduce, not the MLP's), +2 per microbatch outside the layers (the
               vocab-parallel embedding forward, the head backward). XLA:CPU does not merge
               the q/k/v and gate/up input-gradient sums before reducing: 2 forward + 5
               backward = 7 per layer there. The cross-entropy's vocab reductions (max,
               sum of exponentials, target logit: b·s numbers each) are left out.
    parallel.tensor = manual (parallel/tensor.py, with or without parallel.sequence): `manual_tensor_bytes`.
    expert (X), MoE models: the MoE layers' all_to_alls (`moe_all_to_all_bytes`: jaxpar's buffers).
               The batch is split over `expert` too: the gradients of the parameters every expert
               device holds (all but the routed experts) all-reduce over data x expert,
               2(DX-1)/(DX)·e·(Ψ-Ψ_x)/T per microbatch, under the label `expert` (D = 1) or
               `data+expert`; the routed experts' Ψ_x/X over `data` only. With fsdp > 1 the fsdp
               formula above takes the per-device share Ψ - Ψ_x(1 - 1/X) and the expert-axis
               reductions are not predicted.
    """
    import numpy as np

    from jaxpar.model.counting import param_count
    from jaxpar.train.step import activation_dtype

    if config.parallel.tensor == "manual" and sizes.get("pipe", 1) == 1:
        return manual_tensor_bytes(config, model_cfg, sizes, platform)
    counts = param_count(model_cfg)
    psi, psi_layers = counts["total"], counts["blocks"]
    psi_other = psi - psi_layers
    compute_bytes = np.dtype(activation_dtype(config.train.compute_dtype)).itemsize  # float8: bf16 (XLA may gather fp8)
    e = 4 if platform == "cpu" else compute_bytes
    F, D, T, X = sizes.get("fsdp", 1), sizes.get("data", 1), sizes.get("tensor", 1), sizes.get("expert", 1)
    m = config.train.microbatches
    if sizes.get("pipe", 1) > 1:
        return _pipeline_collective_bytes(config, model_cfg, sizes, platform)
    b = config.train.batch_size // m // (D * F * X)
    psi_experts = counts["experts"]
    psi_layers -= psi_experts * (X - 1) // X          # a device's share: the routed experts are split over X
    psi = psi_layers + psi_other
    out = {}
    stage = config.parallel.data
    if stage != "auto":
        if D > 1:
            ring = (D - 1) / D
            tied = 2 * counts["embedding"] if model_cfg.tie_embeddings else 0
            out["data"] = ring * {"ddp": 2 * 4 * psi, "zero1": 2 * 4 * psi, "zero2": e * m * psi + 4 * psi,
                                  "zero3": e * m * (3 * psi_layers + 2 * psi_other + tied)}[stage]
        return out
    s, h = config.data.seq_len, model_cfg.d_model
    if F > 1:
        ring = (F - 1) / F
        looked_up = 0 if model_cfg.tie_embeddings or T > 1 or D > 1 or X > 1 else counts["embedding"]
        gathers = ring * e * (2 * m * psi_layers + psi_other - looked_up) / T
        lookup = ring * m * (4 * b * F * s + 2 * e * b * s * h / T) if looked_up else 0
        reduce = ring * (psi - looked_up) / T * (2 * 4 if platform == "cpu" else e) * m
        out["fsdp"] = gathers + lookup + reduce
    if X > 1:
        out["expert"] = moe_all_to_all_bytes(config, model_cfg, sizes, platform)["predicted"]
        if F == 1:
            label = "expert" if D == 1 else "data+expert"
            out[label] = out.get(label, 0.0) + 2 * (D * X - 1) / (D * X) * e * (psi - psi_experts / X) / T * m
            if D > 1:
                out["data"] = 2 * (D - 1) / D * e * psi_experts / X / T * m
    elif D > 1:
        out["data"] = 2 * (D - 1) / D * e * psi / (F * T) * m
    if T > 1:
        per_layer = (7 if platform == "cpu" else 4) + (1 if config.train.remat == "full" else 0)
        count = (per_layer * model_cfg.layers + 2) * m
        out["tensor"] = count * 2 * (T - 1) / T * e * b * s * h
    return out


def manual_tensor_layer_units(remat: str, sequence: bool, regather: bool = True) -> int:
    """Collective bytes of one layer, one microbatch, under parallel.tensor=manual, in units of
    u = (T-1)/T·e·b·s·h (an all-reduce of b·s·h is 2u; an all-gather or reduce-scatter of it, u).
    See `manual_tensor_bytes` for what each term is."""
    recompute_row = remat in ("full", "dots")
    if not sequence:
        return 8 + (2 if recompute_row else 0)
    return 8 + (2 if regather or remat != "none" else 0) + (1 if recompute_row else 0)


def manual_tensor_bytes(config, model_cfg, sizes: dict[str, int], platform: str,
                        regather: bool = True) -> dict[str, float]:
    """Bytes each device sends per step under parallel.tensor=manual (parallel/tensor.py), by mesh axis.

    u = (T-1)/T·e·b·s·h, e = bytes of the activation dtype on GPU (the psums are written in it); 4 on
    CPU, where XLA runs bf16 collectives in fp32 (measured); b = rows per data shard per microbatch,
    m microbatches.
    tensor, TP: per layer 4 all-reduces of b·s·h = 8u (g after wo and w_down forward, f before q/k/v
               and gate/up backward), +2u with remat full/dots (the attention g is recomputed: its output
               is the MLP norm's input; the MLP's is the next layer's input, saved by the scan).
               Outside the layers 4u: the embedding's g forward, the head's f backward.
           SP: the same 8u as 4 all-gathers + 4 reduce-scatters, +2u for gathering each column-parallel
               input again in the backward pass (`regather`, Megatron-LM's choice; also whenever a remat
               policy does not save it), +1u with remat full/dots (the attention reduce-scatter).
               Outside 4u: embedding reduce-scatter forward + all-gather backward, head all-gather
               forward + reduce-scatter backward. Once per step: the norm weights' gradient sum
               2(T-1)/T·4·(2L+1)·h.
           Both, per microbatch: the cross-entropy's three fp32 reductions (max, sum of exponentials,
               target logit) 3·2(T-1)/T·4·b·s; once per step: the grad-norm scalar 2(T-1)/T·4.
    data:  DDP: one all-reduce of this device's fp32 gradient, 2(D-1)/D·4·(Ψ_split/T + Ψ_norms), plus
           the loss 2(D-1)/D·4 (with fsdp F > 1: this device's share of each parameter, Ψ_leaf/(T·F)).
    fsdp:  F > 1, per parameter split over fsdp, fp32, g = its size / T if split over tensor:
           (F-1)/F·4·g for each all-gather, 3 per layer weight (forward, the backward's re-gather, the
           gradient's reduce-scatter), 2 for the embedding and head (gathered once; a tied one twice); the parameters
           fsdp does not split (norms, the router bias) all-reduce their gradient, 2(F-1)/F·4·size.
           The scalars (loss, norm) that reduce over data x fsdp together are left out.
    """
    import numpy as np

    from jaxpar.model.counting import param_count
    from jaxpar.train.step import activation_dtype

    T, D, F = sizes.get("tensor", 1), sizes.get("data", 1), sizes.get("fsdp", 1)
    m, L, h, s = config.train.microbatches, model_cfg.layers, model_cfg.d_model, config.data.seq_len
    b = config.train.batch_size // m // (D * F)
    e = 4 if platform == "cpu" else np.dtype(activation_dtype(config.train.compute_dtype)).itemsize
    norms = (2 * L + 1) * h
    out = {}
    if T > 1:
        per_layer = manual_tensor_layer_units(config.train.remat, config.parallel.sequence, regather)
        u = (T - 1) / T * e * b * s * h
        ring = 2 * (T - 1) / T
        out["tensor"] = (m * ((per_layer * L + 4) * u + ring * 4 * 3 * b * s) + ring * 4
                         + (ring * 4 * norms if config.parallel.sequence else 0))
    if F > 1:
        out["fsdp"], stored = _fsdp_bytes(model_cfg, T, F)
        if D > 1:
            out["data"] = 2 * (D - 1) / D * 4 * (stored + 1)
    elif D > 1:
        psi = param_count(model_cfg)["total"]
        out["data"] = 2 * (D - 1) / D * 4 * ((psi - norms) / T + norms + 1)
    return out


def _fsdp_bytes(model_cfg, T: int, F: int) -> tuple[float, float]:
    """(fsdp bytes per device per step, elements this device stores) of manual TP x FSDP (default rules)."""
    import jax
    import numpy as np

    from jaxpar.model.transformer import init_params
    from jaxpar.parallel.rules import DEFAULT

    shapes = jax.eval_shape(lambda: init_params(model_cfg, 0))
    specs = DEFAULT.tree_specs(model_cfg.param_axes(), ("tensor", "fsdp"))
    sent = stored = 0.0
    for (path, shape), spec in zip(jax.tree_util.tree_leaves_with_path(shapes),
                                   jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))):
        axes = jax.tree.leaves(tuple(spec))
        size = float(np.prod(shape.shape)) / (T if "tensor" in axes else 1)
        name = jax.tree_util.keystr(path[:1], simple=True)
        gathers = 3 if name in ("blocks", "moe_blocks") else 4 if name == "embed" and model_cfg.tie_embeddings else 2
        if "fsdp" in axes:
            sent += (F - 1) / F * 4 * size * gathers
            stored += size / F
        else:
            sent += 2 * (F - 1) / F * 4 * size
            stored += size
    return sent, stored


def _pipeline_collective_bytes(config, model_cfg, sizes: dict[str, int], platform: str) -> dict[str, float]:
    """Bytes per device per step of the pipeline trainers (parallel/pipeline.py, parallel/circular.py).

    b = microbatch rows per batch shard (data x fsdp, x expert for MoE), a = b·s·h·e one microbatch's
    activation (e: compute dtype bytes on GPU, 4 on CPU, where XLA moves bf16 as fp32); r =
    train.microbatches, the whole pipeline run r times per step (gradient accumulation). Ψ_P = the
    pipelined stack (`moe_blocks` for MoE), Ψ_x its routed experts, Ψ_o everything else (embedding, head,
    final norm, an MoE model's dense stack), all replicated over pipe.
    hand-written schedules, the busiest stage, T ticks of the table:
      pipe    2·T·a·r: every tick each stage sends one activation forward and one gradient backward
              (lock-step SPMD: a buffer moves even in a bubble; the textbook 2(p-1)·m·a counts only the
              useful ones, see measure/bubble.p2p_bytes), + the gradients of Ψ_o summed over pipe,
              2(p-1)/p·4·Ψ_o/T. With v > 1 XLA also re-deals the chunks (not predicted).
      tensor  Megatron, 2(T-1)/T·a each: 2 per layer per F (g after wo, down), 2 per layer per B (f's
              backward before q/k/v and gate/up; zb-h1's W has none), +1 per layer per B with remat
              'full' (XLA recomputes the attention's g, not the MLP's), + 1 per embedding lookup (g) and
              1 per head (f's backward); the cross-entropy's per-token reductions are left out.
      gradients (fp32, once per step): Ψ_o summed over pipe, then every gradient averaged over the batch
              shards: all-reduced over data (and, but for the routed experts, over expert), reduce-scattered
              over fsdp where the weight is sliced, (F-1)/F·4, after the weights' all-gather, (F-1)/F·4 for Ψ_o
              and (F-1)/F·e for the chunks (XLA moves their cast to the compute dtype ahead of the gather). Per
              device: Ψ_o/T, (Ψ_P - Ψ_x)/(p·T), Ψ_x/(p·X·T). An all-reduce over n devices sends
              2(n-1)/n of its buffer. XLA:GPU folds consecutive all-reduces into one over the union of their
              axes (labelled e.g. `data+pipe+expert`); XLA:CPU keeps one per axis.
      expert  MoE: the routed experts' all_to_alls of the stage's MoE layers (`moe_all_to_all_bytes` with
              L/p layers and m·r microbatches: F sends, B recomputes under remat and sends the gradients
              back). The balance statistics' means over the batch shards (E numbers per layer and
              microbatch) are left out.
      With v > 1 XLA re-deals the chunks between the stored [L] layout and the staged one (params in, grads
      out), with permutes and all-to-alls whose groups span pipe and other axes (label `?`): not predicted.
    circular: v·m + p - 1 iterations, each rolling one activation forward and one gradient back: pipe 2·it·a.
    """
    import numpy as np

    from jaxpar.model.counting import block_params, param_count
    from jaxpar.parallel.pipeline import compile_program, part_ticks, pipe_microbatches, pipe_virtual
    from jaxpar.parallel.schedules import build
    from jaxpar.train.step import activation_dtype

    p, D, F, T = sizes["pipe"], sizes.get("data", 1), sizes.get("fsdp", 1), sizes.get("tensor", 1)
    X = sizes.get("expert", 1) if model_cfg.moe else 1
    m, v, r = pipe_microbatches(config, p), pipe_virtual(config), config.train.microbatches
    e = 4 if platform == "cpu" else np.dtype(activation_dtype(config.train.compute_dtype)).itemsize
    b = config.train.batch_size // (D * F * X) // (m * r)
    a = b * config.data.seq_len * model_cfg.d_model * e
    counts = param_count(model_cfg)
    psi_pipelined = counts["blocks"] - (model_cfg.dense_layers * block_params(model_cfg) if model_cfg.moe else 0)
    psi_other, psi_x = counts["total"] - psi_pipelined, counts["experts"]
    out = {}
    if config.parallel.pipe == "circular":
        out["pipe"] = 2 * (v * m + p - 1) * a * r
        return out

    def all_reduce(axes, nbytes, gathered=4):
        axes = [x for x in ("data", "pipe", "expert") if x in axes and {"data": D, "pipe": p, "expert": X}[x] > 1]
        groups = [axes] if platform != "cpu" and axes else [[x] for x in axes]
        for group in groups:
            n = int(np.prod([{"data": D, "pipe": p, "expert": X}[x] for x in group]))
            out["+".join(group)] = out.get("+".join(group), 0.0) + 2 * (n - 1) / n * nbytes
        if F > 1:    # the weights' all-gather (`gathered` bytes per fp32 element) and the gradients' reduce-scatter
            out["fsdp"] = out.get("fsdp", 0.0) + (F - 1) / F * (gathered / 4 + 1) * nbytes

    program = compile_program(build(config.parallel.pipe, p, m, v))
    ticks = part_ticks(program)
    out["pipe"] = 2 * program.ticks * a * r
    all_reduce(("pipe", "data", "expert"), 4 * psi_other / T)
    all_reduce(("data", "expert"), 4 * (psi_pipelined - psi_x) / (p * T), gathered=e)
    all_reduce(("data",), 4 * psi_x / (p * X * T), gathered=e)
    if T > 1:
        chunk = model_cfg.layers // (p * v)
        per_backward = 2 + (1 if config.train.remat == "full" else 0)
        reductions = (2 * ticks["F"] + per_backward * ticks["B"]) * chunk + ticks["embed"] + ticks["head"]
        out["tensor"] = float(reductions.max()) * 2 * (T - 1) / T * a * r
    if X > 1:
        out["expert"] = out.get("expert", 0.0) + moe_all_to_all_bytes(
            config, model_cfg, sizes, platform, microbatches=m * r, layers=model_cfg.moe_layers // p)["predicted"]
    return out


def pipeline_summary(trainer, compiled_peak: int) -> dict | None:
    """A pipeline trainer's schedule, bubble (table and formula) and stash, for the dry-run report."""
    from jaxpar.measure.bubble import bubble_fraction
    schedule = getattr(trainer, "schedule", None)
    name = trainer.config.parallel.pipe
    if name == "auto":
        return None
    p, m, v = trainer.p, trainer.m, trainer.v
    out = {"schedule": name, "stages": p, "microbatches": m, "virtual": v,
           "bubble_formula": float(bubble_fraction(name, p, m, v)), "peak_per_stage": compiled_peak}
    if schedule is not None:
        out.update(bubble_table=float(schedule.bubble()), ticks=schedule.ticks, in_flight=max(schedule.in_flight()),
                   stash_slots=trainer.program.slots["stash"])
    return out


def moe_all_to_all_bytes(config, model_cfg, sizes: dict[str, int], platform: str, *, microbatches: int | None = None,
                         layers: int | None = None) -> dict[str, float]:
    """Bytes each device sends per step in the MoE layers' all_to_alls over `expert` (X devices).

    `microbatches`, `layers`: a pipeline's (m·train.microbatches, the MoE layers of one stage); default
    train.microbatches and every MoE layer.

    formula    the course's: per MoE layer, dispatch + combine move 2·T·k·h·e forward and again
               backward, T = tokens per device per microbatch; a device keeps the 1/X share bound
               for its own experts: x (X-1)/X. Per step: x MoE layers x microbatches.
    predicted  what jaxpar's buffers send (parallel/expert.py). capacity: [E, groups, C, h] per
               exchange, E·C·groups = T·k·c' with c' the capacity factor after C is rounded up.
               dropless: padded chunks of T·min(k, E/X) rows to each of the X devices,
               X·min(k, E/X)/k times the formula, plus the expert ids (int32, forward only).
               With remat (any policy but none) the backward pass recomputes the forward
               exchanges: 6 instead of 4 per layer.
    """
    import numpy as np

    from jaxpar.train.step import activation_dtype

    moe = model_cfg.moe
    X, m = sizes.get("expert", 1), microbatches or config.train.microbatches
    b = config.train.batch_size // m // (sizes.get("data", 1) * sizes.get("fsdp", 1) * X)
    T, k, h, E = b * config.data.seq_len, moe.top_k, model_cfg.d_model, moe.experts
    e = 4 if platform == "cpu" else np.dtype(activation_dtype(config.train.compute_dtype)).itemsize
    ring, per_step = (X - 1) / X, (model_cfg.moe_layers if layers is None else layers) * m
    forward_runs = 1 if config.train.remat == "none" else 2
    formula = ring * 2 * T * k * h * e * 2 * per_step
    if moe.dispatch == "capacity":
        group_tokens = moe.group_sequences * config.data.seq_len
        slots = b // moe.group_sequences * E * moe.capacity(group_tokens)
        exchange = ring * slots * h * e
        ids = 0.0
    else:
        rows = T * min(k, E // X)
        exchange = ring * X * rows * h * e
        ids = ring * X * rows * 4 * forward_runs
    predicted = exchange * 2 * (1 + forward_runs) * per_step + ids * per_step
    return {"formula": formula, "predicted": predicted, "tokens_per_device": T}


# ----------------------------------------------------------------------------- the dry run

def _links(found, mesh, machine) -> dict[str, tuple[str, float]]:
    """Per mesh axis: the slowest link its collectives cross, and that link's bytes/s per direction."""
    from jaxpar.measure import hardware
    flat = list(mesh.devices.flat)
    if machine["platform"] == "cpu":
        bw = hardware.probe_host().link_bw
        return {c.axis_label: ("host memory", bw) for c in found}
    acc = hardware.ACCELERATORS[machine["accelerator"]]
    links = {}
    for c in found:
        crosses = any(len({flat[i].process_index for i in g}) > 1 for g in c.replica_groups)
        link = ("InfiniBand", acc.scaleout_bw) if crosses else ("NVLink", acc.link_bw)
        if links.get(c.axis_label, ("", float("inf")))[1] > link[1]:
            links[c.axis_label] = link
    return links


def _peak_flops(config, machine, num_devices: int) -> tuple[float, str]:
    from jaxpar.measure import hardware
    if machine["platform"] == "cpu":
        host = hardware.probe_host()
        return host.fp32_flops / num_devices, (f"host f32 matmul {host.fp32_flops / 1e9:.1f} GFLOP/s (measured) "
                                                f"shared by {num_devices} virtual devices")
    acc = hardware.ACCELERATORS[machine["accelerator"]]
    if config.train.compute_dtype == "float8" and acc.fp8_flops:
        return acc.fp8_flops, f"{acc.name} fp8 dense peak (only the weight matmuls run in fp8)"
    if config.train.compute_dtype in ("bfloat16", "float8"):
        return acc.bf16_flops, f"{acc.name} bf16 dense peak"
    return acc.tf32_flops, f"{acc.name} TF32 dense peak (XLA's default for f32 dots)"


def calibrated_step(config, sizes: dict[str, int], vocab: int, machine: dict, n: int) -> dict:
    """The step time jaxpar's planner predicts for this config and machine (jaxpar.plan): compute at a calibrated
    efficiency of the peak, the exposed part of each axis' collectives, the pipeline bubble. On CPU nothing is
    calibrated here (η = 1): `jaxpar lab capstone` measures this host's η."""
    from jaxpar.measure import hardware
    from jaxpar.plan.cluster import cpu_cluster, gpu_cluster
    from jaxpar.plan.planner import predict_config
    from jaxpar.plan.steptime import GPU_CALIBRATION, Calibration
    if machine["platform"] == "cpu":
        host = hardware.probe_host()
        cluster = cpu_cluster(n, {}, host.fp32_flops, host.hbm_bw, host.hbm_bytes or 16e9)
        calibration = Calibration(compute=1.0, overlap=0.0, memory=1.0, step_overhead_s=0.0, layer_overhead_s=0.0,
                                  source="η not calibrated on CPU here: `jaxpar lab capstone` measures it")
    else:
        cluster = gpu_cluster(machine["target"], machine["hosts"], machine["gpus_per_host"])
        calibration = GPU_CALIBRATION
    t = predict_config(config, sizes, vocab, cluster, calibration)
    return {"step_s": t.total_s, "mfu": t.model_flops / (t.total_s * cluster.peak("bfloat16")),
            "terms": t.terms(), "source": calibration.source, "efficiency": calibration.compute,
            "overlap": calibration.overlap}


def dryrun(config, target: str = "cpu", devices=None, topology: str | None = None) -> dict:
    """Compile `config`'s training step for `target` without allocating; return every number of the report.

    `devices`: for cpu, the device count JAX was started with (or a device list); for
    GPU targets, a GPU count (or give `topology`, 'PxHxG'). Bad input raises ConfigError.
    """
    import jax
    import jax.numpy as jnp

    from jaxpar.kernels.costs import kernel_flops
    from jaxpar.measure import hardware, hlo
    from jaxpar.measure.flops import compiled_flops, mfu, model_flops_per_step
    from jaxpar.measure.memory import (
        activation_estimate,
        compiled_memory,
        leaf_bytes_per_device,
        shard_counts,
        state_bytes,
        zero_formula,
    )
    from jaxpar.mesh import describe, make_mesh
    from jaxpar.model.counting import param_count
    from jaxpar.model.kernel_ops import resolve
    from jaxpar.model.transformer import ModelConfig
    from jaxpar.parallel.registry import make_trainer
    from jaxpar.train.step import activation_dtype

    if config.model.vocab_size <= 0:
        raise ConfigError("model.vocab_size", f"is {config.model.vocab_size}; a dry run has no tokenizer to take "
                          "it from: set it, e.g. --set model.vocab_size=32000")
    chosen, machine = target_devices(target, devices, topology)
    mesh = make_mesh(config, chosen)
    sizes = {name: int(size) for name, size in mesh.shape.items()}
    if config.model.vocab_size % sizes["tensor"]:
        raise ConfigError("model.vocab_size", f"{config.model.vocab_size} is not divisible by "
                          f"mesh.tensor={sizes['tensor']}")
    n = len(chosen)
    model_cfg = ModelConfig.from_config(config.model)
    B, S = config.train.batch_size, config.data.seq_len

    start = time.perf_counter()
    trainer = make_trainer(config, model_cfg, mesh, donate=True)  # accelerator memory: state updated in place
    tokens = trainer.abstract_batch()
    with jax.set_mesh(mesh):   # traced once: the jaxpr gives the kernels' FLOPs, then it is lowered
        traced = trainer.step_fn.trace(trainer.abstract_state, tokens)
        lowered = traced.lower()
    kernels = kernel_flops(traced.jaxpr)
    lowered_at = time.perf_counter()
    with jax.set_mesh(mesh):
        compiled = lowered.compile()
    compiled_at = time.perf_counter()
    hlo_text = compiled.as_text()

    # memory
    psi = param_count(model_cfg)["total"]
    compute_bytes = jnp.dtype(activation_dtype(config.train.compute_dtype)).itemsize
    state = state_bytes(trainer.abstract_state)
    formula = zero_formula(psi, shard_counts(config, sizes))
    batch_bytes = leaf_bytes_per_device(tokens)
    micro = B // config.train.microbatches // (sizes["data"] * sizes["fsdp"] * sizes["expert"])
    chosen = resolve(config, machine["platform"], activation_dtype(config.train.compute_dtype))
    acts = activation_estimate(layers=model_cfg.layers, seq_len=S, micro_batch=micro, d_model=model_cfg.d_model,
                               heads=model_cfg.heads, vocab_size=model_cfg.vocab_size, tensor=sizes["tensor"],
                               compute_bytes=compute_bytes, remat=config.train.remat,
                               flash=chosen["attention"] in ("pallas", "cudnn"),
                               loss_chunk=config.model.loss_chunk if chosen["loss"] == "chunked" else None,
                               sequence_parallel=config.parallel.sequence)
    mem = compiled_memory(compiled, machine["platform"])

    # collectives
    # a pipeline step runs each tick's branches only on some ticks: its trainer counts what it executes
    found = trainer.collectives(hlo_text) if hasattr(trainer, "collectives") else hlo.collectives(hlo_text, mesh)
    summary = hlo.summarize(found)
    predicted_bytes = predicted_collective_bytes(config, model_cfg, sizes, machine["platform"])
    links = _links(found, mesh, machine)
    axes = {}
    for c in found:
        link, bw = links[c.axis_label]
        row = axes.setdefault(c.axis_label, {"instructions": 0, "runs": 0, "bytes": 0.0, "link": link,
                                             "link_bw": bw, "time_s": 0.0})
        row["instructions"] += 1
        row["runs"] += c.runs_per_step
        row["bytes"] += c.bytes_per_step
        row["time_s"] += c.bytes_per_step / bw
    for label, row in axes.items():
        row["predicted_bytes"] = predicted_bytes.get(label)

    # flops and time
    flops = compiled_flops(compiled, hlo_text, kernel_flops=kernels.total)
    model_flops = model_flops_per_step(model_cfg, B, S)
    peak, peak_source = _peak_flops(config, machine, n)
    compute_s = flops["corrected"] / peak
    comm_s = sum(row["time_s"] for row in axes.values())
    overlap_s, serial_s = max(compute_s, comm_s), compute_s + comm_s
    calibrated = calibrated_step(config, sizes, model_cfg.vocab_size, machine, n)
    usage = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024   # Linux: KiB
    hbm = hardware.ACCELERATORS[machine["accelerator"]].hbm_bytes if machine["accelerator"] else None
    return {
        "config": config.name, "target": target, "machine": machine, "devices": n, "mesh": sizes,
        "mesh_text": describe(mesh), "jax": jax.__version__, "date": time.strftime("%Y-%m-%d"),
        "timing": {"lower_s": lowered_at - start, "compile_s": compiled_at - lowered_at,
                   "host_peak_rss_bytes": usage},
        "model": {"params": psi, "layers": model_cfg.layers, "d_model": model_cfg.d_model,
                  "vocab_size": model_cfg.vocab_size, "batch_size": B, "seq_len": S,
                  "microbatches": config.train.microbatches, "compute_dtype": config.train.compute_dtype,
                  "remat": config.train.remat, "kernels": chosen},
        "memory": {"compiled": mem.as_dict(), "state_from_shardings": state, "zero_formula": formula,
                   "shard_counts": shard_counts(config, sizes), "batch_bytes": batch_bytes,
                   "activations_estimate": acts, "device_hbm_bytes": hbm},
        "pipeline": pipeline_summary(trainer, mem.peak),
        "collectives": {"by_axis": axes, "total_bytes": summary["total"]["bytes"],
                        "predicted_total_bytes": sum(predicted_bytes.values()),
                        "by_op": summary["by_op"]},
        "flops": {**flops, "model_per_step": model_flops, "model_per_device": model_flops / n,
                  "peak_per_device": peak, "peak_source": peak_source},
        "time": {"compute_s": compute_s, "communication_s": comm_s, "overlapped_s": overlap_s,
                 "serial_s": serial_s,
                 "mfu_overlapped": mfu(model_flops, overlap_s, n, peak),
                 "mfu_serial": mfu(model_flops, serial_s, n, peak), "calibrated": calibrated},
    }


# ----------------------------------------------------------------------------- report

def _gib(x) -> str:
    """Bytes in the largest binary unit that keeps the number >= 1."""
    if x is None:
        return "-"
    for unit, scale in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(x) >= scale:
            return f"{x / scale:.3f} {unit}"
    return f"{x:.0f} B"


def _ratio(measured, predicted) -> str:
    return f"{measured / predicted:.3f}" if measured is not None and predicted else "-"


def _seconds(x: float) -> str:
    if x < 1e-3:
        return f"{x * 1e6:.1f} µs"
    return f"{x * 1e3:.1f} ms" if x < 1 else f"{x:.2f} s"


def headline(r: dict) -> str:
    """The report's first claim: memory and communication per device; a GPU target's predicted step time."""
    mem, col, cal = r["memory"], r["collectives"], r["time"]["calibrated"]
    text = (f"**Per device: {_gib(mem['compiled']['peak'])} peak memory (compiled)"
            + (f", {'fits' if mem['compiled']['peak'] <= mem['device_hbm_bytes'] else 'does NOT fit'} in "
               f"{mem['device_hbm_bytes'] / 1e9:.0f} GB" if mem["device_hbm_bytes"] else "")
            + f"; {_gib(col['total_bytes'])} sent in collectives per step")
    if r["machine"]["platform"] == "cpu":
        return (text + ".** No step time is predicted for virtual CPU devices: they share one host's cores, so "
                "their time says nothing about an accelerator (`--target h100`, `h200` or `a100` predicts a GPU "
                "step time).")
    return text + f"; predicted step time {_seconds(cal['step_s'])}, MFU {cal['mfu']:.1%} (the planner's model).**"


def markdown_report(r: dict) -> str:
    """The dry run as markdown: the headline, memory, collectives, FLOPs, predicted step time."""
    m, mem, col, fl, t = r["model"], r["memory"], r["collectives"], r["flops"], r["time"]
    cal = t["calibrated"]
    cpu = r["machine"]["platform"] == "cpu"
    cm, st, fz, act = mem["compiled"], mem["state_from_shardings"], mem["zero_formula"], mem["activations_estimate"]
    where = r["machine"]["topology"] and f", topology {r['machine']['topology']}" or ""
    lines = [
        f"# Dry run: {r['config']} on {r['devices']} x {r['target']}{where} ({r['mesh_text']})",
        "",
        f"{m['params']:,} params ({m['params'] / 1e9:.2f} B), batch {m['batch_size']} x {m['seq_len']} tokens, "
        f"{m['microbatches']} microbatch(es), compute {m['compute_dtype']}, remat {m['remat']}, "
        f"attention {m['kernels']['attention']}, norm {m['kernels']['norm']}, loss {m['kernels']['loss']}. "
        f"jax {r['jax']}, {r['date']}. Lowered in {r['timing']['lower_s']:.1f} s, compiled in "
        f"{r['timing']['compile_s']:.1f} s; host peak RSS {r['timing']['host_peak_rss_bytes'] / GIB:.2f} GiB.",
        "",
        headline(r),
        "",
        "## Memory per device",
        "",
        "| part | analytic: shardings | analytic: ZeRO formula | compiled | compiled / analytic |",
        "|---|---:|---:|---:|---:|",
        f"| params (fp32) | {_gib(st['params'])} | {_gib(fz['params'])} | | |",
        f"| Adam mu + nu | {_gib(st['optimizer'])} | {_gib(fz['optimizer'])} | | |",
        f"| counters | {st['counters']} B | | | |",
        f"| batch (tokens) | {mem['batch_bytes']} B | | | |",
        f"| **arguments** | {_gib(st['state_total'] + mem['batch_bytes'])} | {_gib(fz['state'])} | "
        f"{_gib(cm['argument'])} | {_ratio(cm['argument'], st['state_total'] + mem['batch_bytes'])} |",
        f"| outputs (aliased) | | | {_gib(cm['output'])} ({_gib(cm['alias'])}) | |",
        f"| grads (in temp) | {_gib(st['grads'])} | {_gib(fz['grads'])} | | |",
        f"| activations (estimate, in temp) | {_gib(act['total'])} | | | |",
        f"| **temp** | {_gib(st['grads'] + act['total'])} | | {_gib(cm['temp'])} | "
        f"{_ratio(cm['temp'], st['grads'] + act['total'])} |",
        f"| **peak** | {_gib(st['state_total'] + mem['batch_bytes'] + st['grads'] + act['total'])} | "
        f"{_gib(fz['total'] + act['total'])} | {_gib(cm['peak'])} | "
        f"{_ratio(cm['peak'], st['state_total'] + mem['batch_bytes'] + st['grads'] + act['total'])} |",
        "",
        f"Shards per part {mem['shard_counts']}; formula: 4Ψ/N params, 4Ψ/N grads, 8Ψ/N Adam. "
        f"Activations: {act['note']}; per layer {_gib(act['per_layer'])}, logits {_gib(act['logits'])} "
        "(Korthikanti et al., adapted: an estimate). "
        f"Compiled peak: {cm['peak_method']}.",
    ]
    if mem["device_hbm_bytes"]:
        fits = "fits" if cm["peak"] <= mem["device_hbm_bytes"] else "does NOT fit"
        lines.append(f"Peak {_gib(cm['peak'])} vs {mem['device_hbm_bytes'] / 1e9:.0f} GB of device memory: {fits}.")
    pipe = r.get("pipeline")
    if pipe:
        table = f"{pipe['bubble_table']:.4f} (table, {pipe['ticks']} ticks)" if "bubble_table" in pipe else "-"
        lines += ["", "## Pipeline", "",
                  f"{pipe['schedule']}: p={pipe['stages']} stages, m={pipe['microbatches']} microbatches, "
                  f"v={pipe['virtual']} chunks per stage. Predicted bubble {pipe['bubble_formula']:.4f} (formula, "
                  f"measure/bubble.py), {table}. Every stage runs the same SPMD program: the compiled memory "
                  f"above is each stage's ({_gib(pipe['peak_per_stage'])} peak)"
                  + (f", with a stash of {pipe['stash_slots']} microbatches' activations "
                     f"(at most {pipe['in_flight']} alive on the busiest stage)." if "stash_slots" in pipe else ".")
                  + (" FLOPs below count every branch of a tick on every tick (an upper bound); the collectives "
                     "count what the busiest stage runs." if "stash_slots" in pipe else "")]
    lines += [
        "",
        "## Collectives per step (bytes each device sends, ring model)",
        "",
        "| mesh axis | link | instructions | runs/step | compiled | predicted | compiled / predicted | time |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for label, row in sorted(col["by_axis"].items()):
        lines.append(f"| {label} | {row['link']} ({row['link_bw'] / 1e9:.0f} GB/s) | {row['instructions']} | "
                     f"{row['runs']} | {_gib(row['bytes'])} | {_gib(row['predicted_bytes'])} | "
                     f"{_ratio(row['bytes'], row['predicted_bytes'])} | {_seconds(row['time_s'])} |")
    lines += [
        f"| **total** | | | | {_gib(col['total_bytes'])} | {_gib(col['predicted_total_bytes'])} | "
        f"{_ratio(col['total_bytes'], col['predicted_total_bytes'])} | {_seconds(t['communication_s'])} |",
        "",
        "Predicted: see `jaxpar.dryrun.predicted_collective_bytes` (ZeRO-3 ≈ 3Ψ·e on GPU, 4Ψ·4 on CPU; "
        "DDP 2Ψ·e; Megatron 4-5 all-reduces of b·s·h per layer).",
        "",
        "## FLOPs per device per step",
        "",
        "| | FLOPs | / model |",
        "|---|---:|---:|",
        f"| model (6Ψ + attention, per token x tokens / devices) | {fl['model_per_device']:.4g} | 1.000 |",
        f"| cost_analysis (loop bodies once) | "
        f"{'-' if fl['cost_analysis'] is None else format(fl['cost_analysis'], '.4g')} | "
        f"{_ratio(fl['cost_analysis'], fl['model_per_device'])} |",
        f"| fused kernels (their cost estimates; {'added: custom calls' if fl['kernels_added'] else 'in the HLO count: interpreted'}) | "
        f"{fl['kernels']:.4g} | {_ratio(fl['kernels'], fl['model_per_device'])} |",
        f"| compiled, loop-corrected ({fl['method']}) | {fl['corrected']:.4g} | "
        f"{_ratio(fl['corrected'], fl['model_per_device'])} |",
        "",
        "Compiled > model: remat recomputation, the one-hot embedding matmul, softmax and norms.",
        "",
        *(["## Time on these virtual CPU devices (not a prediction for any accelerator)", "",
            f"{r['devices']} virtual devices share this host's cores and memory; the figures below are theirs."]
          if cpu else ["## Predicted step time (prediction, not a measurement)"]),
        "",
        (f"The planner's step model (jaxpar.plan) for these {r['devices']} virtual CPU devices: "
         f"{_seconds(cal['step_s'])} per step, MFU {cal['mfu']:.1%}: " if cpu else
         f"**The planner's step model (jaxpar.plan): {_seconds(cal['step_s'])} per step, MFU {cal['mfu']:.1%}**: ")
        + "compute at "
        f"η = {cal['efficiency']:.2f} of peak, {cal['overlap']:.0%} of the hideable collectives overlapped "
        f"({cal['source']}); "
        + ", ".join(f"{name} {_seconds(value)}" for name, value in cal["terms"].items()) + ".",
        "",
        f"Optimistic bound (100% of peak: {fl['peak_source']} = {fl['peak_per_device'] / 1e12:.3g} TFLOP/s per "
        "device, collectives at the full link bandwidth), for comparison only:",
        "",
        "| | time | MFU |",
        "|---|---:|---:|",
        f"| compute (compiled FLOPs / peak) | {_seconds(t['compute_s'])} | |",
        f"| communication (bytes / link bandwidth, summed over axes) | {_seconds(t['communication_s'])} | |",
        f"| optimistic bound: perfect overlap, max | {_seconds(t['overlapped_s'])} | {t['mfu_overlapped']:.1%} |",
        f"| step, no overlap: sum | {_seconds(t['serial_s'])} | {t['mfu_serial']:.1%} |",
    ]
    return "\n".join(lines)


def write_json(result: dict, out_dir: str | Path) -> Path:
    """Write the report's numbers (dryrun.json) and its markdown (dryrun.md) into `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "dryrun.md").write_text(markdown_report(result) + "\n")
    path = out / "dryrun.json"
    path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    return path
