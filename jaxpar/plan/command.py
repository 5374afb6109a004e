"""`jaxpar plan`: arguments, inputs checked before anything runs, the ranked table and the defence."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from jaxpar.checks import add_config_arguments
from jaxpar.config import ConfigError

DEFAULT_CONFIG = "configs/arabic_7b.py"     # a preset (jaxpar/configs/arabic_7b.py), found from any working directory


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`jaxpar plan`'s arguments: the planning options, the single strategy, the sweep and its collection."""
    p.add_argument("action", nargs="*", metavar="collect DIR",
                   help="`jaxpar plan collect DIR`: merge a --sweep's measurements into the defence")
    add_plan_options(p)
    p.add_argument("--strategy", metavar="TEXT",
                   help="evaluate this one strategy, e.g. 'fsdp=64 m=2 remat=dots bf16 flash' (any mesh sizes, "
                        "m=microbatches, remat, precision, attention, pipeline schedule), buildable or not")
    p.add_argument("--json", metavar="FILE", help="write every candidate's predictions to FILE (tokens/s per GPU, "
                                                  "step time, MFU, memory, exposed communication per axis)")
    p.add_argument("--cpu-devices", dest="host_devices", type=int, metavar="N",
                   help="plan for N virtual CPU devices of this host instead of GPUs (rates from a short host probe)")
    p.add_argument("--sweep", type=int, default=0, metavar="N",
                   help="write a Slurm job array into --out: one task per top-N buildable candidate, each trains "
                        "--steps steps and records step time and memory; then `jaxpar plan collect DIR`")
    p.add_argument("--steps", type=int, default=5, metavar="K", help="steps each sweep task trains (default 5)")
    p.add_argument("--repeats", type=int, default=3, metavar="R",
                   help="times each sweep task measures its candidate, for a noise estimate (default 3, at least 3)")
    p.add_argument("--framework", default="jaxpar", metavar="NAME",
                   help="whose fitted compute efficiency η predicts a GPU plan: jaxpar (default; MaxText's XLA run "
                        "stands in), maxtext, nemo, megatron (NeMo's η) or torchtitan (plan/anchors.py); nemo and "
                        "megatron also count activations as Megatron-Core's kernels keep them "
                        "(plan/framework_memory.py)")


def add_plan_options(p: argparse.ArgumentParser) -> None:
    """The options `jaxpar plan` shares with lab 10 (`jaxpar lab capstone`)."""
    add_config_arguments(p, config_help="model config (default: configs/arabic_7b.py)",
                         set_help="override a config field (repeatable)")
    p.add_argument("--nodes", type=int, default=8, help="nodes in the cluster (default 8)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node, joined by NVLink (default 8)")
    p.add_argument("--gpu", default="h100", help="GPU type: h100, h100-pcie, h200, a100, a100-40gb (default h100)")
    p.add_argument("--nvlink-gbps", type=float, help="NVLink GB/s per GPU per direction (default: the datasheet's)")
    p.add_argument("--ib-gbps", type=float, help="InfiniBand GB/s per GPU per direction (default: 50, NDR 400G)")
    p.add_argument("--price", type=float, help="price per GPU-hour, for the cost column (optional)")
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--tokens", help="training budget in tokens, e.g. 1e12 or 1T")
    budget.add_argument("--words", help="training budget in Arabic words (converted with the tokenizer's measured "
                                        "tokens per word), e.g. 5e11")
    p.add_argument("--global-batch", type=int, help="global batch in sequences (default: the config's)")
    p.add_argument("--seq-len", type=int, help="sequence length (default: the config's data.seq_len)")
    p.add_argument("--headroom", type=float, default=0.1, help="fraction of device memory kept free (default 0.1)")
    p.add_argument("--top", type=int, default=10, help="rows of the ranked table (default 10)")
    p.add_argument("--verify", type=int, default=0, metavar="N",
                   help="compile the N best buildable candidates deviceless for the GPU (needs the CUDA plugin)")
    p.add_argument("--out", metavar="DIR", help="also write plan.md and plan.json into DIR")
    p.add_argument("--layout", default="jaxpar", metavar="NAME",
                   help="model-state layout the memory assumes: jaxpar (default: fp32 params on every device + "
                        "fp32 accumulator; jaxpar builds it), distributed-optimizer (Megatron/NeMo: bf16 params, "
                        "fp32 grads, fp32 master + AdamW split over data; formula only) or "
                        "distributed-optimizer-bf16-grads (the same with bf16 grads, as NeMo's published runs)")


def load_model_config(args):
    from jaxpar.config import apply_overrides, load_config
    config = load_config(args.config or DEFAULT_CONFIG)
    apply_overrides(config, args.overrides)
    if config.model.vocab_size <= 0:
        raise ConfigError("model.vocab_size", "is 0 (the tokenizer's); a plan needs it: --set model.vocab_size=N")
    return config


def budget_tokens(args, config) -> tuple[float, str]:
    """Tokens to train on, and a note when they came from Arabic words through the measured fertility."""
    from jaxpar.measure.memory import parse_count
    if args.words is not None:
        from jaxpar.plan.fertility import fertility
        words = parse_count(args.words, "--words")
        f = fertility(config.data.corpus, config.data.vocab_size, config.data.normalize)
        return words * f["tokens_per_word"], (
            f" = {words:.3g} Arabic words x {f['tokens_per_word']:.3f} tokens/word (BPE {f['vocab_reached']} "
            f"tokens on '{config.data.corpus}', {'normalized' if f['normalize'] else 'with diacritics'}, "
            f"measured on held-out text)")
    if args.tokens is None:
        raise ConfigError("--tokens", "give the training budget: --tokens N (e.g. 1e12) or --words N")
    return parse_count(args.tokens, "--tokens"), ""


def check_inputs(args):
    """Everything that can be refused before planning: one ConfigError naming the argument."""
    from jaxpar import checks
    from jaxpar.plan.layouts import check_layout
    check_layout(args.layout)
    cpu_devices = getattr(args, "host_devices", None)       # `jaxpar plan --cpu-devices` (not the lab's)
    if cpu_devices is not None and cpu_devices < 1:
        raise ConfigError("--cpu-devices", f"is {cpu_devices}; must be a positive whole number")
    cluster = None if cpu_devices else gpu_cluster_of(args)
    if args.verify < 0:
        raise ConfigError("--verify", f"is {args.verify}; give how many candidates to compile, e.g. 3")
    if args.top < 1:
        raise ConfigError("--top", f"is {args.top}; must be at least 1")
    sweep, steps = getattr(args, "sweep", 0), getattr(args, "steps", 1)
    if sweep < 0 or (sweep and not args.out):
        raise ConfigError("--sweep", f"is {sweep}; give how many candidates to measure (e.g. 3) and --out DIR")
    if steps < 1:
        raise ConfigError("--steps", f"is {steps}; each sweep task trains at least 1 step")
    if getattr(args, "repeats", 3) < 3:
        raise ConfigError("--repeats", f"is {args.repeats}; a noise estimate needs at least 3 repeats")
    from jaxpar.plan.anchors import FRAMEWORKS
    if getattr(args, "framework", "jaxpar") not in FRAMEWORKS:
        raise ConfigError("--framework", f"is '{args.framework}'; valid: {', '.join(FRAMEWORKS)}")
    if getattr(args, "json", None):
        checks.writable_file(args.json, "--json")
    config = load_model_config(args)
    if getattr(args, "strategy", None):
        from jaxpar.plan.strategy import parse_strategy
        devices = cpu_devices or cluster.devices
        args.candidate = parse_strategy(args.strategy, devices, "cpu" if cpu_devices else "gpu")
    tokens, note = budget_tokens(args, config)
    return config, cluster, tokens, note


def gpu_cluster_of(args):
    from jaxpar.plan.fleet import gpu_cluster
    return gpu_cluster(args.gpu, args.nodes, args.gpus_per_node, nvlink_gbps=args.nvlink_gbps,
                       ib_gbps=args.ib_gbps, price_per_gpu_hour=args.price)


def host_cluster(devices: int):
    """N virtual CPU devices of this host: the host probe's rates, collectives at its copy bandwidth (no sweep).
    The probe is the host's kept one (measure.hardware.kept_host_probe): a probe under load moves, and two
    identical invocations must plan identically."""
    from jaxpar.mesh import set_cpu_devices
    set_cpu_devices(devices)
    from jaxpar.measure.hardware import kept_host_probe
    from jaxpar.plan.cpu_links import host_cores
    from jaxpar.plan.fleet import cpu_cluster
    host = kept_host_probe(devices)
    return cpu_cluster(devices, {}, host["fp32_flops"], host["hbm_bw"], host["hbm_bytes"] or 16e9, cores=host_cores())


def run(args) -> int:
    if args.action:
        return run_collect(args.action)
    config, cluster, tokens, note = check_inputs(args)     # before JAX is imported (the model's counts import it)
    from jaxpar.model.counting import ModelShape
    from jaxpar.plan.planner import plan
    from jaxpar.plan.steptime import GPU_CALIBRATION, HOST_CALIBRATION
    if cluster is None:
        cluster = host_cluster(args.host_devices)
    global_batch = args.global_batch if args.global_batch is not None else config.train.batch_size
    seq_len = args.seq_len if args.seq_len is not None else config.data.seq_len
    one = getattr(args, "candidate", None)
    space = {} if cluster.platform == "gpu" else {"precisions": ("float32",), "attentions": ("dot",)}
    calibration = HOST_CALIBRATION
    if cluster.platform == "gpu":
        from jaxpar.plan.anchors import FRAMEWORKS
        from jaxpar.plan.anchors import calibration as framework_calibration
        calibration = framework_calibration(FRAMEWORKS[args.framework], GPU_CALIBRATION)
    p = plan(ModelShape.from_config(config), cluster, global_batch=global_batch, seq_len=seq_len, tokens=tokens,
             headroom=args.headroom, layout=args.layout, candidates=[one] if one else None,
             check_fits=one is None, calibration=calibration, **space)
    p.budget_note = note
    text = strategy_report(p, config, args) if one else ranked_report(p, config, args)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(candidates_json(p, args.framework), indent=2) + "\n")
        print(f"\nwrote {args.json}")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "plan.md").write_text(text + "\n")
        (out / "plan.json").write_text(json.dumps(plan_json(p, args.framework), indent=2) + "\n")
        print(f"\nwrote {out}/plan.md and plan.json")
        if args.sweep:
            from jaxpar.plan.sweep import write_sweep
            script = write_sweep(p, args.config or DEFAULT_CONFIG, args.overrides, args.sweep, args.steps, out,
                                 cluster.platform, args.host_devices, args.layout, repeats=args.repeats)
            print(f"wrote {script}: sbatch it, then `jaxpar plan collect {out}`")
    return 0


def efficiency_lines(p, framework: str = "jaxpar") -> tuple[list[str], tuple[float, float] | None]:
    """A GPU plan's η (whose, fitted on what, when) and its leave-one-out range (plan/anchors.py); none on CPU."""
    if p.cluster.platform != "gpu":
        return [], None
    from jaxpar.plan.anchors import FRAMEWORKS, describe, spread
    return [*describe(framework), ""], spread(FRAMEWORKS[framework])


def ranked_report(p, config, args) -> str:
    from jaxpar.plan.planner import defence, summary_line, table
    from jaxpar.plan.verify import annotate, buildable_sentence
    efficiency, spread = efficiency_lines(p, getattr(args, "framework", "jaxpar"))
    lines = [f"# Plan: {config.name}", "", summary_line(p), "", *efficiency]
    verified_text = verify_top(p, config, args.verify, args.gpu) if args.verify else []
    annotate(p, config, args.top, p.cluster.platform)
    lines += [table(p, args.top, spread), "", "## Defence", "", defence(p) + " " + buildable_sentence(p, config)]
    if verified_text:
        lines += ["", "## Checked against the compiler", "", *verified_text]
    return "\n".join(lines)


def strategy_report(p, config, args) -> str:
    """`--strategy`: one candidate's predictions, whether it fits, and whether jaxpar builds it."""
    from jaxpar.plan.layouts import BUILDABLE
    from jaxpar.plan.verify import candidate_config
    r = p.results[0]
    t = r.time
    why = candidate_config(config, r.cand, p.global_batch, p.seq_len, p.cluster.platform)[1]
    if r.memory.layout not in BUILDABLE:
        why = f"formula only: jaxpar does not build the {r.memory.layout} layout"
    efficiency, spread = efficiency_lines(p, getattr(args, "framework", "jaxpar"))
    ranged = "" if spread is None else (f" ({t.total_s * spread[0]:.4f}-{t.total_s * spread[1]:.4f} s, leave-one-out "
                                        "over the anchors)")
    lines = [f"# Strategy: {r.label}", "", f"{p.shape.describe()}; {p.cluster.describe()}; global batch "
             f"{p.global_batch} x {p.seq_len}; model state in the {r.memory.layout} layout. Predictions.", "",
             *efficiency, f"- buildable by jaxpar: {'yes' if why is None else 'no (' + why + ')'}",
             f"- memory per device: {r.memory.total / 1e9:.2f} GB of {r.memory.limit / 1e9:.0f} usable: "
             f"{'fits' if r.memory.fits else 'DOES NOT FIT'} ({kept_by(r.memory.activation_model)}; "
             + ", ".join(f"{k} {v / 1e9:.1f}" for k, v in r.memory.parts().items()) + " GB)",
             f"- step: {t.total_s:.4f} s{ranged}; {r.tokens_per_s / r.cand.devices:,.0f} tokens/s per device; "
             f"MFU {r.mfu:.1%} of the bf16 peak" + (f" ({r.mfu_fp8_peak:.1%} of the fp8 peak)"
                                                    if r.cand.precision == "float8" else ""), "",
             "| term | seconds |", "|---|---:|"]
    lines += [f"| {k} | {v:.4f} |" for k, v in t.terms().items()]
    lines += ["", "| axis | GB per device | link | seconds | exposed |", "|---|---:|---|---:|---:|"]
    lines += [f"| {a} | {r.comm_bytes.get(a, 0) / 1e9:.3f} | {p.cluster.axis_link(r.cand, a).name} | {s:.4f} | "
              f"{t.exposed_s.get(a, 0):.4f} |" for a, s in t.comm_s.items()]
    return "\n".join(lines)


def kept_by(activation_model: str) -> str:
    """Whose kernels the memory's activations are counted for (plan/framework_memory.py)."""
    if activation_model == "jaxpar":
        return "activations as jaxpar's XLA program keeps them"
    return f"activations as {activation_model}'s kernels keep them (--framework)"


def run_collect(action: list[str]) -> int:
    if action[0] != "collect" or len(action) != 2:
        raise ConfigError("plan", f"unexpected '{' '.join(action)}'; the only subcommand is `jaxpar plan collect DIR`")
    from jaxpar.plan.sweep import collect
    out = Path(action[1])
    text, data = collect(out)
    (out / "defence.md").write_text(text)
    (out / "defence.json").write_text(json.dumps(data, indent=2) + "\n")
    print(text + f"\nwrote {out}/defence.md")
    return 0


def verify_top(p, config, count: int, gpu: str) -> list[str]:
    """Compile the best buildable candidates deviceless (or say why not, and how to make it possible)."""
    from jaxpar.measure.targets import GPU_TARGETS, gpu_plugin_problem
    target = gpu.lower().removesuffix("-sxm").removesuffix("-80gb")
    if target not in GPU_TARGETS:
        return [f"Verification skipped: no deviceless compile target for '{gpu}' (targets: {', '.join(GPU_TARGETS)})."]
    problem = gpu_plugin_problem()
    if problem:
        return [f"Verification skipped: {problem}."]
    from jaxpar.plan.verify import verification_table, verify
    verified, skipped = verify(p, config, count, target, log=lambda line: None)
    out = [verification_table(verified), ""]
    out += ["Better-ranked candidates this checkout cannot build (formula only):", ""]
    out += [f"- {s}" for s in skipped]
    return out


def range_json(p, framework: str = "jaxpar") -> dict | None:
    """The leave-one-out range the report prints (plan/anchors.py), for --json and plan.json; None on CPU."""
    if p.cluster.platform != "gpu":
        return None
    from jaxpar.plan.anchors import FRAMEWORKS, leave_one_out, spread
    name = FRAMEWORKS[framework]
    low, high = spread(name)
    return {"framework": framework, "eta_of": name, "step_factors": [low, high],
            "leave_one_out": dict(leave_one_out(name)),
            "meaning": "this η predicting each anchor it was not fitted on, predicted / published; each step_s_range "
                       "is step_s times step_factors (tokens/s and days scale the other way): a prediction's range"}


def step_range(r, factors: dict | None) -> list[float] | None:
    return None if factors is None else [r.time.total_s * f for f in factors["step_factors"]]


def candidate_json(r, factors: dict | None = None) -> dict:
    """One candidate's predictions, for --json and plan.json; `factors`: `range_json`'s."""
    t = r.time
    return {"strategy": r.label, "step_s_range": step_range(r, factors), "candidate": r.cand.to_dict(),
            "layout": r.memory.layout,
            "fits": r.memory.fits, "memory": r.memory.parts(), "memory_total": r.memory.total, "step_s": t.total_s,
            "terms": t.terms(), "comm_s": t.comm_s, "exposed_s": t.exposed_s, "comm_bytes": r.comm_bytes,
            "tokens_per_s": r.tokens_per_s, "tokens_per_s_per_device": r.tokens_per_s / r.cand.devices,
            "mfu_bf16_peak": r.mfu, "mfu_fp8_peak": r.mfu_fp8_peak, "gemm_efficiency": t.gemm_efficiency,
            "days": r.days, "gpu_hours": r.gpu_hours, "cost": r.cost, "note": r.note}


def candidates_json(p, framework: str = "jaxpar") -> dict:
    """--json: every candidate evaluated, fitting or not, in the planner's order (fastest first)."""
    rows = sorted(p.results, key=lambda r: (not r.memory.fits, r.time.total_s))
    factors = range_json(p, framework)
    return {"model_params": p.shape.params, "cluster": p.cluster.describe(), "global_batch": p.global_batch,
            "seq_len": p.seq_len, "tokens": p.tokens, "mfu_peak": "dense bf16 peak (mfu_fp8_peak: the fp8 peak)",
            "range": factors, "candidates": [candidate_json(r, factors) for r in rows]}


def plan_json(p, framework: str = "jaxpar") -> dict:
    factors = range_json(p, framework)
    rows = []
    for r in p.ranked[:50]:
        rows.append({"strategy": r.label, "step_s_range": step_range(r, factors),
                     "candidate": r.cand.to_dict(), "memory": r.memory.parts(),
                     "memory_total": r.memory.total, "step_s": r.time.total_s, "terms": r.time.terms(),
                     "comm_s": r.time.comm_s, "comm_bytes": r.comm_bytes, "tokens_per_s": r.tokens_per_s,
                     "mfu": r.mfu, "days": r.days, "gpu_hours": r.gpu_hours, "cost": r.cost, "note": r.note})
    return {"model_params": p.shape.params, "cluster": p.cluster.describe(), "global_batch": p.global_batch,
            "seq_len": p.seq_len, "tokens": p.tokens, "range": factors, "candidates": p.evaluated, "fit": len(p.ranked),
            "ranked": rows}
