"""Lab 07, part f (`--parts layouts`): the MoE model in the hand-written layouts, each against one device.

MoE layers inside every hand-written pipeline schedule, manual expert parallelism inside the pipeline
stages (expert x pipe x data or fsdp), and MoE under manual (Megatron) tensor parallelism with fsdp and
data. The layouts are built and compared with lab 04's code (labs/pipeline/build.Lab,
labs/pipeline/moe.compare): the oracle is one device accumulating the same microbatches; every metric
is compared step by step, the router statistics per layer included. Beside it, the bytes per mesh axis
of the compiled step against the strategy's own prediction (`predict`, parallel/theory.py).
"""
from __future__ import annotations

from pathlib import Path

from jaxpar.labs.base.report import md_table
from jaxpar.labs.pipeline.moe import MOE_MODEL, TOLERANCE, _case, compare
from jaxpar.units import fmt_bytes, ratio

# small enough for minutes on 8 CPU devices; MOE_MODEL (lab 04's) sets 10 layers, 8 of them MoE
MODEL = ["model.d_model=64", "model.heads=4", "model.kv_heads=4", "model.mlp_dim=128", "data.seq_len=32",
         "train.warmup_steps=1"]
TP_BATCH = 16
ROUTER = ("moe_routed", "moe_dropped", "moe_entropy", "moe_z")
LAYOUTS = [   # label, (overrides, devices, the oracle's microbatches)
    ("GPipe, pipe=2 m=4", _case("gpipe", 2, 4)),
    ("1F1B, pipe=2 m=4", _case("1f1b", 2, 4)),
    ("interleaved, pipe=2 v=2 m=4", _case("interleaved", 2, 4, 2)),
    ("ZB-H1, pipe=2 m=4", _case("zb-h1", 2, 4)),
    ("DualPipeV, pipe=2 m=4", _case("dualpipev", 2, 4, 2)),
    ("manual EP in stages: expert=2 x pipe=2 x data=2, 1F1B m=4", _case("1f1b", 2, 4, data=2, expert=2)),
    ("manual EP in stages: expert=2 x pipe=2 x fsdp=2, ZB-H1 m=4", _case("zb-h1", 2, 4, fsdp=2, expert=2)),
    ("manual EP in stages: expert=4 x pipe=2, interleaved v=2 m=4", _case("interleaved", 2, 4, 2, expert=4)),
    ("manual TP: tensor=2 x fsdp=2 x data=2 (balance loss off)",
     (["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "parallel.tensor=manual", f"train.batch_size={TP_BATCH}",
       "model.moe.balance_loss=0"], 8, 1)),
    ("manual TP: tensor=4 x data=2 (balance loss off)",
     (["mesh.data=2", "mesh.tensor=4", "parallel.tensor=manual", f"train.batch_size={TP_BATCH}",
       "model.moe.balance_loss=0"], 8, 1)),
]


def axis_bytes(strategy, step) -> dict[str, dict[str, float]]:
    """Bytes per device per step by mesh axis: compiled (a pipeline's as its busiest stage executes them, as the
    dry run counts them) and the strategy's prediction."""
    from jaxpar.kernels.kernel_ops import platform_of
    from jaxpar.measure.executed import step_collectives
    from jaxpar.parallel.registry import predicted_collective_bytes

    compiled: dict[str, float] = {}
    for c in step_collectives(strategy, step.as_text()):
        compiled[c.axis_label] = compiled.get(c.axis_label, 0.0) + c.bytes_per_step
    sizes = {name: int(size) for name, size in strategy.mesh.shape.items()}
    predicted = predicted_collective_bytes(strategy.config, strategy.model_cfg, sizes, platform_of(strategy.mesh))
    return {axis: {"compiled": compiled.get(axis, 0.0), "predicted": predicted.get(axis, 0.0)}
            for axis in sorted(set(compiled) | set(predicted))}


def _bytes_cell(by_axis: dict) -> str:
    return "; ".join(f"{axis}: {fmt_bytes(b['compiled'])} / {fmt_bytes(b['predicted'])} "
                     f"({ratio(b['compiled'], b['predicted'])})" for axis, b in by_axis.items()) or "-"


def moe_layouts(out: Path, steps: int, devices: int, log, quick: bool = False) -> dict:
    """Every layout that fits on `devices` against its one-device oracle, with its bytes per axis (the model is
    lab 04's MoE on jaxpar's base config, whatever lab 07's --config: the layouts need its 10 layers);
    `quick`: two of them, manual EP inside 1F1B stages and manual TP x FSDP."""
    from jaxpar.config import apply_overrides, load_config
    from jaxpar.labs.pipeline.build import Lab

    config = load_config(None)
    apply_overrides(config, MODEL)
    initial: dict = {}
    lab, runs, rows = Lab(config, out, log, quick), {}, []
    for label, (overrides, need, micro) in lab.few(LAYOUTS, 5, 8):
        if need > devices:
            continue
        r = compare(lab, overrides, need, micro, True, steps, initial)
        by_axis = axis_bytes(r.pop("strategy"), r.pop("step"))
        runs[label] = {**r, "bytes_by_axis": by_axis}
        dev = r["deviation"]
        router = max(dev.get(k, 0.0) for k in ROUTER)
        runs[label]["router_stats_dev"] = router
        rows.append([label, micro, f"{dev['loss']:.1e}", f"{dev['grad_norm']:.1e}",
                     "yes" if router <= TOLERANCE else "**NO**", f"{router:.1e}", f"{dev.get('moe_balance', 0):.1e}",
                     _bytes_cell(by_axis)])
        log(f"  {label}: loss {dev['loss']:.1e}, router statistics {router:.1e}, "
            f"balance {dev.get('moe_balance', 0):.1e}")
    md = "\n".join([
        f"## f. MoE in the hand-written layouts: pipelines, expert x pipe, manual TP ({steps} steps, fp32)", "",
        "The oracle: one device accumulating the same a·m microbatches (lab 04's builder). Model: d_model 64, "
        f"{', '.join(o.split('.', 1)[1] for o in MOE_MODEL)}. Router statistics: routed and dropped fractions, "
        "entropy and z of every MoE layer at every step. Balance: the statistic E·Σ f_i·P_i per layer, a product "
        "of two batch means, so a strategy that computes it per data shard (manual TP over `data`) reports the "
        "shards' mean, not the batch's (its balance loss is off here). Bytes: per device per step, compiled / "
        "predicted (`predict`, ring model) and their ratio.", "",
        md_table(["layout", "oracle a·m", "loss: max rel. diff vs one device", "grad norm",
                  f"per-layer router statistics equal (within {TOLERANCE:g})", "router statistics max rel. diff",
                  "balance statistic max rel. diff", "bytes per axis: compiled / predicted"], rows, "lrrrlrrl")])
    return {"runs": runs, "markdown": md}
