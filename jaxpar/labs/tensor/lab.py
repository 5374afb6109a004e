"""Lab 03 (course module 3): Megatron tensor and sequence parallelism by hand, against one
device, against the formulas, and beside what XLA's partitioner chooses.

One run, five parts, every number beside its prediction (experiments/03_tensor/README.md is the sheet):

a. equivalence   losses over the same batches (fp32) of the single device, auto TP, manual TP, manual
                 TP+SP and manual TP+SP keeping gathered inputs; and the gradient of one batch of each
                 manual variant against the single device's: max relative deviations.
b. communication every collective of each compiled step (`measure.hlo`), per layer and per step, by op,
                 against `parallel/tensor.predict` (auto: `parallel/auto.predict`).
c. memory        activation bytes per layer: the compiled gradient program's temp bytes with the layer
                 count doubled (temp(2L) - temp(L)) / L; the tensors autodiff saves, split into the
                 sequence region (norms, residual stream) and the tensor region (attention, MLP);
                 Korthikanti's formula (bf16, GPT) and jaxpar's own count (`measure.memory`).
d. layouts       manual TP x FSDP (torchtitan's 2D) and an MoE model under it (experts' hidden over tensor,
                 Megatron-Core's default; with an expert axis; with SP): losses and gradient norms against one
                 device, bytes per axis of the compiled step against the strategy's prediction (`tensor.predict`).
e. context       context parallelism (ring, all_to_all) at growing lengths: losses against one device, context
                 bytes against `parallel/context_predict.py`, the ring's work per hop (labs/tensor/context.py).

The mesh is data x tensor (tensor 4 by default, data = devices / tensor). Every part runs in float32.
Every program is compiled once (`lower().compile()`) and that executable is run and read.
Files in the run directory: report.md, results.json, config.json, equivalence.png, communication.png,
memory.png, context.png. `--parts` runs a subset.
"""
from __future__ import annotations

import copy
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxpar.config import ConfigError, apply_overrides, load_config
from jaxpar.labs.arguments import TENSOR_PARTS as PARTS
from jaxpar.labs.arguments import tensor as add_arguments
from jaxpar.labs.base.report import max_rel_dev, md_table
from jaxpar.labs.base.runner import Part, chosen_parts, run_directory, run_parts, standalone_main
from jaxpar.labs.tensor.build import VARIANTS, Lab
from jaxpar.labs.tensor.context import context
from jaxpar.labs.tensor.plots import PLOTS
from jaxpar.units import fmt_bytes, ratio

TOLERANCE = 1e-4          # max relative loss deviation from the oracle (tests/test_tensor.py uses the same)
MANUAL = ("tp", "sp", "sp-keep")


# ============================================================================ saved activations

def saved_residuals(strategy) -> list[jax.ShapeDtypeStruct]:
    """The per-device tensors JAX's autodiff keeps for the backward pass of `strategy`'s loss (a manual
    strategy: its ops, remat policy and shard_map layout), traced on abstract inputs, nothing run."""
    from jaxpar.model.transformer import loss
    found = []

    def body(params, tokens):
        objective = lambda p: loss(p, tokens, strategy.model_cfg, strategy.ops, strategy.policy)[0]
        _, backward = jax.vjp(objective, params)
        found.extend(jax.ShapeDtypeStruct(r.shape, r.dtype) for r in jax.tree.leaves(backward))
        return jnp.zeros(())

    program = jax.shard_map(body, mesh=strategy.mesh, in_specs=(strategy.param_specs, P("data", None)),
                            out_specs=P(), check_vma=False)
    with jax.set_mesh(strategy.mesh):
        jax.eval_shape(program, strategy.abstract_state["params"], strategy.abstract_batch())
    return found


def layer_activations(strategy) -> dict:
    """Saved activations of the stacked layers per layer, per device, by region.

    A layer's activations are the residuals stacked by the layer scan: shape [L, b, ...] (b = rows per
    device), weights excluded. The sequence region is what SP splits: [L, b, s or s/t, h] and the
    per-token scalars [L, b, s or s/t, 1] (norm inputs and outputs, the residual stream); the rest
    (heads, MLP hidden units, attention scores: split by TP) is the tensor region."""
    cfg, c = strategy.model_cfg, strategy.config
    L, b, s, h, t = cfg.layers, c.train.batch_size // strategy.d, c.data.seq_len, cfg.d_model, strategy.t
    weights = {leaf.sharding.shard_shape(leaf.shape) for leaf in jax.tree.leaves(strategy.abstract_state["params"])}
    out: dict[str, Any] = {"sequence_region": 0, "tensor_region": 0, "sequence_shapes": []}
    for r in saved_residuals(strategy):
        if len(r.shape) < 3 or r.shape[:2] != (L, b) or r.shape in weights:
            continue
        size = int(np.prod(r.shape)) * r.dtype.itemsize // L
        if len(r.shape) == 4 and r.shape[2] in (s, s // t) and r.shape[3] in (h, 1):
            out["sequence_region"] += size
            out["sequence_shapes"].append(list(r.shape[1:]))
        else:
            out["tensor_region"] += size
    out["per_layer"] = out["sequence_region"] + out["tensor_region"]
    return out


# ============================================================================ a. equivalence

def equivalence(lab: Lab, steps: int) -> dict:
    batches = lab.batches(steps)
    runs: dict[str, dict[str, Any]] = {}
    for key in ("single", "auto", *MANUAL):
        built = lab.step(key)
        runs[key] = {"label": built.label, "losses": lab.run(built, batches), "compile_s": built.compile_s}
    oracle = runs["single"]["losses"]
    want_loss, want = lab.grads(lab.gradient("single"), batches[0])
    for key, r in runs.items():
        r["max_rel_dev"] = max_rel_dev(r["losses"], oracle)
        r["within_tolerance"] = r["max_rel_dev"] <= TOLERANCE
        if key in MANUAL:
            loss, got = lab.grads(lab.gradient(key), batches[0])
            scale = max(float(np.max(np.abs(w))) for w in jax.tree.leaves(want))
            r["grad_max_abs_dev"] = max(float(np.max(np.abs(g - w))) for g, w in
                                        zip(jax.tree.leaves(got), jax.tree.leaves(want)))
            r["grad_max_abs_dev_rel_to_max_grad"] = r["grad_max_abs_dev"] / scale
            r["grad_batch_loss_rel_dev"] = abs(loss - want_loss) / want_loss
    rows = [[r["label"], f"{r['losses'][0]:.5f}", f"{r['losses'][-1]:.5f}", f"{r['max_rel_dev']:.2e}",
             f"{TOLERANCE:.0e}", "yes" if r["within_tolerance"] else "**NO**",
             f"{r['grad_max_abs_dev_rel_to_max_grad']:.2e}" if "grad_max_abs_dev" in r else "-"]
            for r in runs.values()]
    md = "\n".join([
        f"## a. Equivalence: {steps} steps, same batches, fp32, mesh data={lab.d} x tensor={lab.t}",
        "",
        md_table(["strategy", "loss step 1", f"loss step {steps}", "max rel. loss deviation (measured)", "tolerance",
                "within", "gradient of batch 1: max abs. deviation / max abs. gradient (measured)"], rows),
        "",
        "Predicted deviation: 0 up to fp32 rounding (the devices sum the same products in another order). "
        "Gradients: every parameter's gradient from the manual strategy's `grad_fn` (mean over `data`, SP's "
        "norm-weight sums included) against `jax.grad` on one device.",
    ])
    return {"steps": steps, "tolerance": TOLERANCE, "runs": runs, "markdown": md}


# ============================================================================ b. communication

def communication(lab: Lab) -> dict:
    from jaxpar.measure.hlo import collectives, compiled_hlo
    from jaxpar.model.counting import ModelShape
    from jaxpar.parallel.auto import tensor_all_reduces
    from jaxpar.parallel.registry import predicted_collective_bytes, workload
    from jaxpar.parallel.tensor import layer_units as manual_layer_units
    from jaxpar.parallel.tensor import predict as manual_tensor

    cfg = lab.model_cfg
    L = cfg.layers
    b, s, h, t = lab.base.train.batch_size // lab.d, lab.base.data.seq_len, cfg.d_model, lab.t
    u = (t - 1) / t * 4 * b * s * h          # an all-gather / reduce-scatter of b·s·h fp32; an all-reduce is 2u
    rows: dict[str, dict[str, Any]] = {}
    for key in ("auto", "auto-sp", *MANUAL):
        built = lab.step(key)
        found = collectives(compiled_hlo(built.compiled), built.strategy.mesh)
        layer: defaultdict[str, float] = defaultdict(float)
        total: defaultdict[str, float] = defaultdict(float)
        for c in found:
            total[f"{c.op} ({c.axis_label})"] += c.bytes_per_step
            if c.runs_per_step == L and c.axes == ("tensor",):
                layer[c.op] += c.bytes_per_run
        sizes = dict(built.strategy.mesh.shape)
        if key in MANUAL:
            regather = (VARIANTS[key][2] or {}).get("regather", True)
            theory = workload(built.config, built.strategy.model_cfg, sizes, "cpu")
            predicted = manual_tensor(*theory, regather=regather).bytes_by_axis()
            layer_units = manual_layer_units("none", built.config.parallel.sequence, regather)
        elif key == "auto":
            predicted = predicted_collective_bytes(built.config, built.strategy.model_cfg, sizes, "cpu")
            layer_units = 2 * tensor_all_reduces(ModelShape(cfg), "none", cpu=True)   # auto.predict's count
        else:
            predicted, layer_units = {}, None
        rows[key] = {"label": built.label, "layer_by_op": dict(layer), "layer_bytes": sum(layer.values()),
                     "layer_predicted": layer_units * u if layer_units else None,
                     "step_by_op": dict(total), "step_bytes": sum(total.values()),
                     "step_predicted": sum(predicted.values()) if predicted else None,
                     "instructions": len(found)}
    tp = rows["tp"]["layer_bytes"]
    layer_rows = [[r["label"], ", ".join(f"{op} {fmt_bytes(v)}" for op, v in sorted(r["layer_by_op"].items())),
                   fmt_bytes(r["layer_bytes"]), fmt_bytes(r["layer_predicted"]),
                   ratio(r["layer_bytes"], r["layer_predicted"]), f"{r['layer_bytes'] / tp:.3f}"]
                  for r in rows.values()]
    step_rows = [[r["label"], r["instructions"], fmt_bytes(r["step_bytes"]), fmt_bytes(r["step_predicted"]),
                  ratio(r["step_bytes"], r["step_predicted"])] for r in rows.values()]
    md = "\n".join([
        "## b. Communication: compiled collectives vs the formulas",
        "",
        f"One layer (collectives inside the layer loops, {L} runs per step, over `tensor`), bytes each device "
        f"sends under a ring model; u = (t-1)/t·4·b·s·h = {fmt_bytes(u)} (b = {b} rows per device, s = {s}, h = {h}, "
        f"t = {t}, fp32).",
        "",
        md_table(["strategy", "compiled, by op", "compiled per layer", "predicted", "ratio", "vs manual TP"],
               layer_rows),
        "",
        "Predicted per layer: manual TP 8u (4 all-reduces of b·s·h: g after wo and w_down forward, f before "
        "q/k/v and gate/up backward); manual TP+SP 10u: the same 8u as 4 all-gathers + 4 reduce-scatters, + "
        "2u gathering each column-parallel input again in the backward pass (Megatron-LM keeps only the s/t "
        "shard); SP keeping the gathered inputs 8u, TP's bytes exactly; auto TP 8u too (`parallel.auto`: the "
        "column-parallel inputs enter as one copy per tensor shard, so the q/k/v and gate/up input gradients "
        "are summed before their one all-reduce each, as Megatron's f). The rules "
        "variant is XLA's own sequence parallelism (no formula: read what it chose).",
        "",
        "Whole step, every axis (data: DDP's gradient all-reduce, 2(D-1)/D·4·Ψ_local):",
        "",
        md_table(["strategy", "collective instructions", "compiled per step", "predicted", "ratio"], step_rows),
    ])
    return {"u": u, "rows": rows, "markdown": md}


# ============================================================================ c. memory

def memory(lab: Lab) -> dict:
    from jaxpar.measure.memory import compiled_memory, jaxpar_layer_bytes, korthikanti_layer_bytes

    cfg = lab.model_cfg
    L = cfg.layers
    b, s, h, t = lab.base.train.batch_size // lab.d, lab.base.data.seq_len, cfg.d_model, lab.t
    rows = {}
    for key in MANUAL:
        small, big = lab.gradient(key, L), lab.gradient(key, 2 * L)
        temps = [compiled_memory(x.compiled, "cpu").temp for x in (small, big)]
        sp = small.config.parallel.sequence
        saved = layer_activations(small.strategy)
        saved_big = layer_activations(big.strategy)
        korthikanti = korthikanti_layer_bytes(seq_len=s, micro_batch=b, d_model=h, heads=cfg.heads, tensor=t,
                                              sequence_parallel=sp)
        ours = jaxpar_layer_bytes(seq_len=s, micro_batch=b, d_model=h, heads=cfg.heads, kv_heads=cfg.kv_heads,
                                  head_dim=cfg.head_dim, mlp_dim=cfg.mlp_dim, tensor=t, sequence_parallel=sp,
                                  gathered_kept=(VARIANTS[key][2] or {}).get("regather") is False)
        rows[key] = {"label": small.label, "temp": temps, "layers": [L, 2 * L],
                     "compiled_per_layer": (temps[1] - temps[0]) / L, "saved": saved,
                     "saved_consistent": saved_big["per_layer"] == saved["per_layer"],
                     "korthikanti_bf16": korthikanti, "jaxpar_formula": ours}
    tensor_region = rows["tp"]["saved"]["tensor_region"]
    for r in rows.values():
        # the tensor region is the same tensors in every variant, so what the compiled bytes hold beyond it
        # is the sequence region
        r["compiled_sequence_region"] = r["compiled_per_layer"] - tensor_region
    tp = rows["tp"]
    for r in rows.values():
        r["sequence_ratio_saved"] = r["saved"]["sequence_region"] / tp["saved"]["sequence_region"]
        r["sequence_ratio_compiled"] = r["compiled_sequence_region"] / tp["compiled_sequence_region"]
    for r in rows.values():   # 1/t for SP; the count's own ratio when the gathered inputs are kept
        r["sequence_ratio_predicted"] = r["jaxpar_formula"]["sequence_region"] / tp["jaxpar_formula"]["sequence_region"]
    per_layer_rows = [[r["label"], fmt_bytes(r["compiled_per_layer"]), fmt_bytes(r["saved"]["per_layer"]),
                       ratio(r["compiled_per_layer"], r["saved"]["per_layer"]),
                       fmt_bytes(r["jaxpar_formula"]["per_layer"]),
                       ratio(r["compiled_per_layer"], r["jaxpar_formula"]["per_layer"]),
                       fmt_bytes(r["korthikanti_bf16"]["per_layer"]), fmt_bytes(2 * r["korthikanti_bf16"]["per_layer"]),
                       ratio(r["compiled_per_layer"], 2 * r["korthikanti_bf16"]["per_layer"])] for r in rows.values()]
    region_rows = [[r["label"], fmt_bytes(r["saved"]["sequence_region"]), fmt_bytes(r["compiled_sequence_region"]),
                    fmt_bytes(r["jaxpar_formula"]["sequence_region"]), f"{r['sequence_ratio_saved']:.4f}",
                    f"{r['sequence_ratio_compiled']:.4f}",
                    f"{r['sequence_ratio_predicted']:.4f}", fmt_bytes(r["saved"]["tensor_region"]),
                    fmt_bytes(r["jaxpar_formula"]["tensor_region"])] for r in rows.values()]
    md = "\n".join([
        "## c. Activation memory per layer",
        "",
        f"Compiled: temp bytes of the gradient program (forward + backward, no optimizer; gradients are its "
        f"outputs) at {L} and {2 * L} layers, (temp({2 * L}) - temp({L})) / {L}. Saved: the tensors autodiff keeps "
        f"for the backward pass, per layer per device (`saved_residuals`). Korthikanti: s·b·h·(10 + 24/t + "
        f"5·a·s/(h·t)) bf16 bytes for TP, s·b·h·(34 + 5·a·s/h)/t with SP (GPT layer: LayerNorm, GeLU 4h MLP, "
        f"dropout); x2 for fp32 elements. jaxpar's count: the same accounting for its fp32 block (RMSNorm as "
        f"JAX differentiates it: 3 tensors per norm, SwiGLU: 6·F, GQA, two fp32 s x s tensors per head, no "
        f"dropout; `measure.memory.jaxpar_layer_bytes`). b = {b}, s = {s}, h = {h}, a = {cfg.heads}, t = {t}.",
        "",
        md_table(["strategy", "compiled per layer", "saved per layer", "compiled / saved", "jaxpar's count",
                "compiled / count", "Korthikanti (bf16)", "Korthikanti x2 (fp32)", "compiled / (x2)"],
               per_layer_rows),
        "",
        "The sequence region (what SP splits: the two norms' inputs, normalised values and outputs, and "
        "per-token scalars) against TP's. Compiled: the compiled per-layer bytes minus the tensor region "
        "(identical tensors in every variant). Predicted ratio: jaxpar's count over TP's, 1/t with SP.",
        "",
        md_table(["strategy", "sequence region: saved", "compiled", "jaxpar's count", "SP / TP: saved",
                "SP / TP: compiled", "predicted", "tensor region: saved", "jaxpar's count"], region_rows),
        "",
        "Keeping the gathered inputs (`regather=False`) stores the full [b, s, h] input of the q/k/v and gate/up "
        "matmuls: that part of the sequence region is not divided by t, which is why Megatron-LM gathers it "
        "again in the backward pass (part b: +2u per layer).",
    ])
    return {"rows": rows, "predicted_ratio": 1 / t, "markdown": md}


# ============================================================================ the whole lab


def run_lab(config, out: str | Path | None = None, *, steps: int = 10, tensor: int = 4,
            parts: tuple[str, ...] = PARTS, quick: bool = False, log=print) -> dict:
    """Run parts a-d on every local device; write the run directory; return every number. `quick`: part d on
    one of its layouts (MoE with SP x expert, the one that combines the most)."""
    start = time.perf_counter()
    if steps < 1:
        raise ConfigError("--steps", f"is {steps}; must be at least 1")
    parts = tuple(chosen_parts(parts, PARTS))
    devices = jax.devices()
    if tensor < 2 or len(devices) % tensor:
        raise ConfigError("--tensor", f"is {tensor}; must be at least 2 and divide the {len(devices)} devices "
                          "(on CPU pass --cpu-devices 8)")
    probe = copy.deepcopy(config)   # every check of the config before anything is built or written
    apply_overrides(probe, [f"mesh.data={len(devices) // tensor}", f"mesh.tensor={tensor}", "parallel.tensor=manual",
                            "parallel.sequence=true", "parallel.data=auto", "parallel.rules=",
                            "mesh.fsdp=1", "mesh.pipe=1", "mesh.expert=1"])
    from jaxpar.config import validate
    validate(probe, len(devices))
    lab = Lab(config, devices, tensor, log)
    out = run_directory(out, "tensor", config, log=log)
    m = lab.model_cfg
    header = lab.sheet_header(
        "Lab 03 (tensor): Megatron TP and sequence parallelism",
        f"Model: d_model {m.d_model}, {m.layers} layers, {m.heads} heads ({m.kv_heads} kv), mlp {m.mlp_dim}, "
        f"vocab {m.vocab_size}; mesh data={lab.d} x tensor={lab.t}")
    results = {**lab.facts(), "tensor": tensor, "data": lab.d}
    plan = {"equivalence": lambda: equivalence(lab, steps), "communication": lambda: communication(lab),
            "memory": lambda: memory(lab), "layouts": lambda: layouts(lab, steps, quick),
            "context": lambda: context(lab, steps, quick)}
    # the footer counts the cached programs (part d compiles its own programs, not cached)
    return run_parts("tensor", out, [Part(name, plan[name]) for name in parts], results, [header],
                     PLOTS, start=start, compiles=lab.compiles, log=log)


# ============================================================================ d. layouts

# the MoE of part d: fine-grained experts, a shared one, the sigmoid router and its bias, the Switch balance loss
# (over the whole batch: `MoEOps.batch_mean`)
LAYOUT_MOE = ["model.moe.experts=4", "model.moe.router=sigmoid", "model.moe.shared_experts=1"]


def layouts(lab: Lab, steps: int, quick: bool = False) -> dict:
    from jaxpar.measure.hlo import collectives
    from jaxpar.mesh import make_mesh
    from jaxpar.model.transformer import ModelConfig
    from jaxpar.parallel.registry import make_strategy, predicted_collective_bytes

    n, t = len(lab.devices), lab.t
    half = [f"model.moe.expert_mlp_dim={lab.base.model.mlp_dim // 2}"]
    cases = [(f"TP x FSDP: fsdp={n // t} x tensor={t}", [f"mesh.fsdp={n // t}", f"mesh.tensor={t}"], []),
             ("TP x FSDP x DDP: data=2 x fsdp=2 x tensor=2", ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"], []),
             (f"MoE, TP x FSDP: fsdp={n // t} x tensor={t}", [f"mesh.fsdp={n // t}", f"mesh.tensor={t}"],
              LAYOUT_MOE + half),
             (f"MoE, expert x TP: expert=2 x data={n // (2 * t)} x tensor={t}",
              ["mesh.expert=2", f"mesh.data={n // (2 * t)}", f"mesh.tensor={t}", "parallel.expert=manual"],
              LAYOUT_MOE + half),
             (f"MoE, SP x expert: expert=2 x fsdp={n // (2 * t)} x tensor={t}",
              ["mesh.expert=2", f"mesh.fsdp={n // (2 * t)}", f"mesh.tensor={t}", "parallel.expert=manual",
               "parallel.sequence=true"], LAYOUT_MOE + half)]
    cases = cases[4:] if quick else cases
    batches, rows, out, oracles = lab.batches(steps), [], {}, {}

    def build(overrides, devices):
        config = copy.deepcopy(lab.base)
        apply_overrides(config, ["mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1", "mesh.pipe=1", "mesh.expert=1",
                                 "train.compute_dtype=float32", "train.microbatches=1", "train.remat=none",
                                 "parallel.sequence=false", "parallel.data=auto", "parallel.rules=", *overrides])
        model_cfg = ModelConfig.from_config(config.model, lab.model_cfg.vocab_size)
        strategy = make_strategy(config, model_cfg, make_mesh(config, lab.devices[:devices]))
        with jax.set_mesh(strategy.mesh):
            compiled = strategy.lower_step().compile()
        state, losses, norms = strategy.init_state(), [], []
        with jax.set_mesh(strategy.mesh):
            for batch in batches:
                state, metrics = compiled(state, jax.device_put(batch, strategy.batch_sharding))
                losses.append(float(metrics["loss"]))
                norms.append(float(metrics["grad_norm"]))
        return config, strategy, compiled, losses, norms

    for label, mesh, model in cases:
        if n % (2 * t) and ("DDP" in label or "expert=2" in label):
            continue
        if tuple(model) not in oracles:          # one single-device run per model
            oracles[tuple(model)] = build(["parallel.tensor=auto", *model], 1)[3:]
        want, want_norms = oracles[tuple(model)]
        config, strategy, compiled, losses, norms = build(["parallel.tensor=manual", *mesh, *model], n)
        measured: defaultdict[str, float] = defaultdict(float)
        for c in collectives(compiled.as_text(), strategy.mesh):
            measured[c.axis_label] += c.bytes_per_step
        predicted = predicted_collective_bytes(config, strategy.model_cfg, dict(strategy.mesh.shape),
                                               lab.devices[0].platform)
        out[label] = {"losses": losses, "oracle": want, "max_rel_loss": max_rel_dev(losses, want),
                      "max_rel_grad_norm": max_rel_dev(norms, want_norms), "measured_bytes": dict(measured),
                      "predicted_bytes": predicted}
        bytes_ = "; ".join(f"{axis} {fmt_bytes(measured[axis])} / {fmt_bytes(v)} = {ratio(measured[axis], v)}"
                           for axis, v in predicted.items())
        rows.append([label, f"{losses[0]:.4f} -> {losses[-1]:.4f}", f"{out[label]['max_rel_loss']:.1e}",
                     f"{out[label]['max_rel_grad_norm']:.1e}", bytes_])
    md = "\n".join([
        f"## d. Layouts: manual TP with FSDP, and MoE under it ({steps} steps, fp32, against one device)", "",
        md_table(["layout", "loss", "max rel. dev. loss", "max rel. dev. grad norm",
                  "bytes per step per axis: compiled / predicted"], rows), "",
        "FSDP x TP as torchtitan lays it out: weights rest split over fsdp (on d_model) and tensor; each layer's "
        "weights are all-gathered over fsdp inside the layer loop, again in the backward pass, and their "
        "gradients reduce-scattered there (3 x (F-1)/F of a layer's tensor shard per step; the embedding and head "
        "2x). MoE: every expert's hidden dimension split over tensor (Megatron-Core's default expert tensor "
        "parallelism), the router replicated; with mesh.expert the experts exchange tokens by all_to_all over "
        "expert (parallel/expert.py); under SP the router sees s/t tokens and its statistics are averaged over "
        "tensor (parallel/tensor_moe.py)."])
    return {"steps": steps, "cases": out, "markdown": md}


# ============================================================================ command line

def run_from_args(args) -> int:
    """`jaxpar lab tensor` and run.py: the CPU device count must already be set (before JAX started)."""
    config = load_config(args.config)
    apply_overrides(config, args.overrides)
    run_lab(config, args.out, steps=args.steps, tensor=args.tensor,
            parts=args.parts, quick=args.quick)
    return 0


def main(argv=None) -> int:
    """Standalone entry (experiments/*/run.py): parse, set the CPU devices, run; bad input exits 2."""
    return standalone_main(__doc__.splitlines()[0], add_arguments, run_from_args, argv)
