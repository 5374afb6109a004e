"""Lab 04, part i (`--parts moe`): MoE inside every pipeline schedule, expert parallelism inside the stages
(the circular pipeline's too), the experts split Megatron-style over `tensor` inside the stages, sequence
parallelism inside the stages (its collective matmuls too: dense in every hand-written schedule, MoE in 1F1B and
ZB-H1), and pipelines with gradient accumulation and with `parallel.rules`, each against one device.

The oracle of a pipeline with m microbatches and train.microbatches = a is one device accumulating over the
same a·m strided microbatches (the balance loss multiplies two batch means, so it depends on the
microbatching); every metric is compared step by step: loss, cross-entropy, each aux loss, the gradient
norm, and each router statistic per layer (the telemetry), and the aux-free router bias after the last
step. PyTorch counterparts: Megatron-Core runs MoE layers inside its pipeline schedules (the aux loss is
scaled by 1/m per microbatch and added in each stage's backward), with `--expert-model-parallel-size`
and `--expert-tensor-parallel-size` inside the pipeline stages (and `--sequence-parallel` for its TP);
torchtitan's pipelining keeps the loss on the last stage only.
"""
from __future__ import annotations

import jax
import numpy as np

from jaxpar.labs.base.report import md_table

TOLERANCE = 1e-4
MICRO = 4                                      # rows per pipeline microbatch
# every layer but the first two is MoE: 8 pipelined layers (2 per stage at p=4, 2 chunks of 2 at p=2, v=2)
MOE_MODEL = ["model.layers=10", "model.moe.experts=4", "model.moe.top_k=2", "model.moe.dense_layers=2",
             "model.moe.router=sigmoid", "model.moe.bias_rate=0.01", "model.moe.balance_loss=0.1",
             "model.moe.z_loss=0.01"]
SP = ("parallel.tensor=manual", "parallel.sequence=true")


def _case(schedule, p, m, v=1, a=1, data=1, fsdp=1, expert=1, tensor=1, extra=()):
    shards = data * fsdp * expert
    overrides = [f"mesh.data={data}", f"mesh.fsdp={fsdp}", f"mesh.pipe={p}", f"mesh.expert={expert}",
                 f"mesh.tensor={tensor}",
                 f"parallel.pipe={schedule}", f"parallel.pipe_microbatches={m}", f"parallel.pipe_virtual={v}",
                 f"train.microbatches={a}", f"train.batch_size={MICRO * m * a * shards}", *extra]
    if expert > 1:
        overrides.append("parallel.expert=manual")
    return overrides, data * fsdp * p * expert * tensor, a * m


CASES = [   # label, (overrides, devices, the oracle's microbatches), MoE model or dense
    ("MoE GPipe p=4 m=8", _case("gpipe", 4, 8), True),
    ("MoE 1F1B p=4 m=8", _case("1f1b", 4, 8), True),
    ("MoE interleaved p=2 v=2 m=4", _case("interleaved", 2, 4, 2), True),
    ("MoE ZB-H1 p=4 m=8", _case("zb-h1", 4, 8), True),
    ("MoE circular p=4 m=8", _case("circular", 4, 8), True),
    ("MoE circular p=2 v=2 m=4", _case("circular", 2, 4, 2), True),
    ("MoE data=2 x pipe=2 x expert=2, 1F1B m=4", _case("1f1b", 2, 4, data=2, expert=2), True),
    ("MoE fsdp=2 x pipe=2 x expert=2, ZB-H1 m=4", _case("zb-h1", 2, 4, fsdp=2, expert=2), True),
    ("MoE pipe=2 x expert=4, interleaved v=2 m=4", _case("interleaved", 2, 4, 2, expert=4), True),
    ("MoE data=2 x pipe=2, GPipe m=2, accumulation 2", _case("gpipe", 2, 2, a=2, data=2), True),
    # every expert's hidden dimension split Megatron-style over tensor inside the stages (with manual EP too)
    ("MoE data=2 x pipe=2 x tensor=2, 1F1B m=4", _case("1f1b", 2, 4, data=2, tensor=2), True),
    ("MoE expert=2 x pipe=2 x tensor=2, ZB-H1 m=4", _case("zb-h1", 2, 4, expert=2, tensor=2), True),
    ("MoE pipe=2 x tensor=2, DualPipeV m=4", _case("dualpipev", 2, 4, 2, tensor=2), True),
    # manual EP inside the compiler-driven pipeline (and the automatic TP around it)
    ("MoE circular data=2 x pipe=2 x expert=2 (manual), m=4", _case("circular", 2, 4, data=2, expert=2), True),
    ("MoE circular pipe=2 x expert=2 (manual) x tensor=2, v=2 m=4", _case("circular", 2, 4, 2, expert=2, tensor=2),
     True),
    ("dense 1F1B p=4 m=4, accumulation 2", _case("1f1b", 4, 4, a=2), False),
    ("dense fsdp=2 x pipe=4, 1F1B m=4, rules embed= (no fsdp slicing)",
     _case("1f1b", 4, 4, fsdp=2, extra=("parallel.rules=embed=",)), False),
    ("dense data=2 x fsdp=2 x pipe=2 circular m=4, accumulation 2, rules embed=fsdp+data",
     _case("circular", 2, 4, a=2, data=2, fsdp=2, extra=("parallel.rules=embed=fsdp+data",)), False),
    # Megatron's sequence parallelism inside the stages: they pass [b, s/t, h] on
    ("dense data=2 x pipe=2 x tensor=2, SP, 1F1B m=4", _case("1f1b", 2, 4, data=2, tensor=2, extra=SP), False),
    ("dense fsdp=2 x pipe=2 x tensor=2, SP, ZB-H1 m=4, remat full",
     _case("zb-h1", 2, 4, fsdp=2, tensor=2, extra=(*SP, "train.remat=full")), False),
    ("dense pipe=2 x tensor=2, SP, interleaved v=2 m=4", _case("interleaved", 2, 4, 2, tensor=2, extra=SP), False),
    # SP's collective matmuls inside the stages (parallel/collective_matmul.py: each ring step a swap over tensor=2)
    *((f"dense {'data=2 x ' if data > 1 else ''}pipe=2 x tensor=2, SP rings ({mode}), {schedule} m=4",
       _case(schedule, 2, 4, v, data=data, tensor=2, extra=(*SP, f"parallel.tensor_overlap={mode}")), False)
      for schedule, v, data, mode in (("gpipe", 1, 2, "collective_matmul"), ("1f1b", 1, 2, "bidirectional"),
                                      ("interleaved", 2, 1, "collective_matmul"), ("zb-h1", 1, 1, "bidirectional"),
                                      ("dualpipev", 2, 1, "collective_matmul"))),
    # with an MoE model: the attention's rings, the MoE blocks' feed-forward SP's whole collectives
    ("MoE data=2 x pipe=2 x tensor=2, SP rings (collective_matmul), 1F1B m=4",
     _case("1f1b", 2, 4, data=2, tensor=2, extra=(*SP, "parallel.tensor_overlap=collective_matmul")), True),
    ("MoE expert=2 x pipe=2 x tensor=2, SP rings (bidirectional), ZB-H1 m=4",
     _case("zb-h1", 2, 4, expert=2, tensor=2, extra=(*SP, "parallel.tensor_overlap=bidirectional")), True),
]


def _run_metrics(lab, strategy, step, steps: int, initial):
    """Every metric of `steps` steps ([steps, ...] arrays) and the final params, from `initial` (host)."""
    state, metrics = jax.device_put(initial, strategy.state_shardings), []
    for batch in lab.batches(strategy.config, steps):
        with jax.set_mesh(strategy.mesh):
            state, m = step(state, jax.device_put(batch, strategy.batch_sharding))
        metrics.append(jax.device_get(m))
    return {k: np.array([m[k] for m in metrics]) for k in metrics[0]}, jax.device_get(state["params"])


def _max_dev(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want) / np.maximum(np.abs(want), 1e-6)))


TELEMETRY = ("moe_routed", "moe_dropped", "moe_entropy", "moe_z", "moe_balance")


def compare(lab, overrides, devices: int, micro: int, moe: bool, steps: int, initial: dict) -> dict:
    """One layout against one device accumulating `micro` microbatches: max relative deviation per metric,
    the worst per-layer router statistic (telemetry), the router bias after the last step; `initial` caches
    the host initial state per model (MoE or dense). The oracle takes the layout's own `model.*` settings too.
    Lab 07 (labs/moe/layouts.py) reuses it."""
    model = [*(MOE_MODEL if moe else []), *(o for o in overrides if o.startswith("model."))]
    batch_size = next(int(o.split("=")[1]) for o in overrides if o.startswith("train.batch_size="))
    oracle_t, oracle_s = lab.compiled([*model, "mesh.data=1", f"train.batch_size={batch_size}",
                                       f"train.microbatches={micro}"], 1)
    strategy, step = lab.compiled([*(MOE_MODEL if moe else []), *overrides], devices)
    if moe not in initial:
        initial[moe] = jax.device_get(oracle_t.init_state())
    want, want_params = _run_metrics(lab, oracle_t, oracle_s, steps, initial[moe])
    got, params = _run_metrics(lab, strategy, step, steps, initial[moe])
    dev = {k: _max_dev(got[k], want[k]) for k in want}
    telemetry = max((v for k, v in dev.items() if k in TELEMETRY), default=0.0)
    bias = (_max_dev(params["moe_blocks"]["router_bias"], want_params["moe_blocks"]["router_bias"])
            if moe else None)
    worst = max([dev["loss"], dev["grad_norm"], telemetry])
    return {"deviation": dev, "telemetry": telemetry, "bias_dev": bias, "losses": got["loss"].tolist(),
            "oracle": want["loss"].tolist(), "oracle_microbatches": micro, "within_tolerance": worst <= TOLERANCE,
            "keys_match": set(got) == set(want), "strategy": strategy, "step": step}


def moe_pipelines(lab, steps: int) -> dict:
    """Each case against its oracle: max relative deviation per metric group."""
    rows, out = [], {}
    initial: dict = {}
    for label, (overrides, devices, micro), moe in lab.few(CASES, 6, 18):   # quick: EP in stages; SP in stages
        r = compare(lab, overrides, devices, micro, moe, steps, initial)
        dev, telemetry, bias = r["deviation"], r["telemetry"], r["bias_dev"]
        out[label] = {k: v for k, v in r.items() if k not in ("strategy", "step", "telemetry")}
        rows.append([label, micro, f"{dev['loss']:.1e}", f"{dev['grad_norm']:.1e}",
                     f"{dev.get('moe_balance_loss', 0):.1e}" if moe else "-", f"{telemetry:.1e}" if moe else "-",
                     f"{bias:.1e}" if moe else "-",
                     "yes" if r["within_tolerance"] and r["keys_match"] else "NO"])
    md = "\n".join([
        f"## i. MoE in the pipelines, expert parallelism inside stages, accumulation and rules ({steps} steps, fp32)",
        "", "The oracle: one device with train.microbatches = a·m (the same strided microbatches). MoE model: "
        f"{', '.join(o.split('.', 1)[1] for o in MOE_MODEL)}. Telemetry: the worst of routed / dropped "
        "fractions, entropy, z and balance per layer; bias: the router bias after the last step.", "",
        md_table(["layout", "oracle a·m", "loss", "grad norm", "balance loss", "telemetry per layer", "bias",
                  f"within {TOLERANCE:g}"], rows)])
    return {"cases": out, "markdown": md}
