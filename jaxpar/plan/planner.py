"""The planner: evaluate every candidate of the space, rank the ones that fit, and defend the choice.

`plan(...)` predicts, for each candidate, per-device memory (jaxpar/parallel/memory.py) and step time
(steptime.py), then tokens/s, MFU, days, GPU-hours and cost for the token budget, and
ranks the candidates that fit by step time (every candidate trains the same global
batch, so the fastest step is the shortest run). `defence(plan)` is the paragraph that
explains the choice: which term of the step dominates, and, term by term, why each
runner-up loses. A cluster on which nothing fits is refused with the smallest cluster
(in whole nodes) on which something does.
"""
from __future__ import annotations

import dataclasses

from jaxpar.config import ConfigError
from jaxpar.model.counting import ModelShape
from jaxpar.parallel.memory import Memory, memory
from jaxpar.parallel.registry import predict
from jaxpar.parallel.theory import Candidate, candidate_from_config
from jaxpar.plan.fleet import Cluster
from jaxpar.plan.framework_memory import apply_activations
from jaxpar.plan.layouts import apply_layout, layout_flows
from jaxpar.plan.space import enumerate_candidates, microbatch_choices
from jaxpar.plan.steptime import GPU_CALIBRATION, Calibration, StepTime, step_time
from jaxpar.plan.strategy import check_fits_model
from jaxpar.units import GB

DAY = 86400.0


@dataclasses.dataclass
class Evaluated:
    """One candidate with its predictions (and, after verification, what the compiler said)."""

    cand: Candidate
    memory: Memory
    time: StepTime
    comm_bytes: dict
    tokens_per_s: float
    mfu: float
    days: float
    gpu_hours: float
    cost: float | None
    note: str = ""                   # "formula only: ...", "demoted: ...", verification results
    mfu_fp8_peak: float = 0.0        # the same model FLOPs against the fp8 peak (2x the bf16 one on H100)

    @property
    def label(self) -> str:
        return self.cand.label()


@dataclasses.dataclass
class Plan:
    shape: ModelShape
    cluster: Cluster
    global_batch: int
    seq_len: int
    tokens: float
    headroom: float
    ranked: list[Evaluated]          # candidates that fit, fastest first
    evaluated: int                   # candidates in the space
    too_big: list[Evaluated]         # the most frugal candidate that does not fit, and the fastest (if faster)
    budget_note: str = ""
    results: list[Evaluated] = dataclasses.field(default_factory=list, repr=False)   # every candidate evaluated

    @property
    def best(self) -> Evaluated:
        return self.ranked[0]


def check_budget(tokens: float | None, global_batch: int, seq_len: int) -> float:
    if tokens is None or not tokens > 0:
        raise ConfigError("--tokens", f"is {tokens}; the training budget must be a positive number of tokens "
                          "(or give --words, a positive number of Arabic words)")
    for field, value in (("--global-batch", global_batch), ("--seq-len", seq_len)):
        if not isinstance(value, int) or value < 1:
            raise ConfigError(field, f"is {value}; must be a positive whole number")
    return float(tokens)


def evaluate(shape: ModelShape, cand: Candidate, cluster: Cluster, global_batch: int, seq_len: int, tokens: float,
             headroom: float = 0.1, calibration: Calibration = GPU_CALIBRATION, layout: str | None = None) -> Evaluated:
    """Memory (in `layout`, default the candidate's: plan/layouts.py), step time and what they mean for the run,
    for one candidate. MFU is against the dense bf16 peak, also for fp8 candidates (NeMo's convention);
    `mfu_fp8_peak` beside it."""
    layout = layout or cand.layout
    cand = dataclasses.replace(cand, layout=layout)
    prediction = predict(shape, cand, global_batch, seq_len, cluster.platform)
    prediction = dataclasses.replace(prediction, flows=layout_flows(prediction, shape, cand, layout))
    mem = apply_layout(memory(shape, cand, global_batch, seq_len, cluster.hbm_bytes, headroom, prediction,
                              cluster.platform), cand, layout)
    mem = apply_activations(mem, shape, cand, prediction, global_batch, seq_len, cluster.platform,
                            calibration.activations)
    t = step_time(shape, cand, cluster, global_batch, seq_len, calibration, prediction)
    step_tokens = global_batch * seq_len
    tokens_per_s = step_tokens / t.total_s
    peak = cluster.peak("bfloat16")
    mfu = t.model_flops / (t.total_s * peak)
    seconds = tokens / tokens_per_s
    gpu_hours = seconds * cand.devices / 3600
    cost = gpu_hours * cluster.price_per_gpu_hour if cluster.price_per_gpu_hour else None
    return Evaluated(cand, mem, t, prediction.bytes_by_axis(), tokens_per_s, mfu, seconds / DAY, gpu_hours, cost,
                     mfu_fp8_peak=t.model_flops / (t.total_s * cluster.peak("float8")))


def plan(shape: ModelShape, cluster: Cluster, *, global_batch: int, seq_len: int, tokens: float,
         headroom: float = 0.1, calibration: Calibration = GPU_CALIBRATION, candidates: list[Candidate] | None = None,
         check_fits: bool = True, layout: str = "jaxpar", **space) -> Plan:
    """Evaluate the space (or `candidates`) on `cluster`; raise ConfigError when nothing fits (check_fits).
    `layout` is the model-state layout of every candidate that does not name its own (`dist-opt`); a given
    candidate whose pipeline leaves its microbatches open (0) gets them by `choose_microbatches`."""
    tokens = check_budget(tokens, global_batch, seq_len)
    if not 0 <= headroom < 1:
        raise ConfigError("--headroom", f"is {headroom}; the fraction of device memory kept free must be in [0, 1)")
    given = candidates is not None
    if candidates is None:
        candidates = enumerate_candidates(shape, cluster.devices, global_batch, seq_len=seq_len, **space)
    if not candidates:
        raise ConfigError("--global-batch", f"{global_batch} sequences cannot be split over {cluster.devices} devices "
                          "by any strategy (data x fsdp x expert must divide it); use a multiple of the device count")
    candidates = [c if c.layout != "jaxpar" else dataclasses.replace(c, layout=layout) for c in candidates]
    run = (cluster, global_batch, seq_len, tokens, headroom, calibration)
    results = []
    for c in candidates:
        if given:
            check_fits_model(c, shape)
        results.append(choose_microbatches(shape, c, *run) if c.microbatches == 0 else evaluate(shape, c, *run))
    fits = sorted((r for r in results if r.memory.fits), key=lambda r: (r.time.total_s, r.memory.total))
    too_big = sorted((r for r in results if not r.memory.fits), key=lambda r: r.memory.total)[:1]
    too_big += sorted((r for r in results if not r.memory.fits and fits and r.time.total_s < fits[0].time.total_s),
                      key=lambda r: r.time.total_s)[:1]
    if check_fits and not fits:
        smallest = smallest_cluster(shape, cluster, global_batch, seq_len, headroom,
                                    activations=calibration.activations, **space)
        where = (f"the smallest that fits is {smallest.nodes} x {smallest.per_node} ({smallest.devices} GPUs)"
                 if smallest else "no cluster of up to 4096 nodes fits it either")
        least = too_big[0]   # the most frugal
        raise ConfigError("--nodes", f"no strategy fits {shape.params / 1e9:.2f} B params on {cluster.nodes} x "
                          f"{cluster.per_node} {cluster.name} ({least.memory.total / GB:.0f} GB per device at best, "
                          f"{least.memory.limit / GB:.0f} GB usable); {where}")
    return Plan(shape, cluster, global_batch, seq_len, tokens, headroom, fits, len(results), too_big, results=results)


def choose_microbatches(shape: ModelShape, cand: Candidate, cluster: Cluster, global_batch: int, seq_len: int,
                        tokens: float, headroom: float = 0.1, calibration: Calibration = GPU_CALIBRATION) -> Evaluated:
    """The planner's own rule for a pipeline whose microbatches the strategy leaves open: of the counts the space
    enumerates (`space.microbatch_choices`), the fastest that fits, else the most frugal."""
    run = (cluster, global_batch, seq_len, tokens, headroom, calibration)
    rows = global_batch // cand.batch_shards
    counts = microbatch_choices(rows, cand.pipe, cand.schedule) if global_batch % cand.batch_shards == 0 else []
    if not counts:
        raise ConfigError("--strategy", f"pipe={cand.pipe} ({cand.schedule}) needs at least {cand.pipe} "
                          f"microbatches of the {global_batch / cand.batch_shards:g} sequences each batch shard gets; "
                          "give m=N or a larger --global-batch")
    tried = [evaluate(shape, dataclasses.replace(cand, microbatches=m), *run) for m in counts]
    fitting = [r for r in tried if r.memory.fits]
    if fitting:
        return min(fitting, key=lambda r: (r.time.total_s, r.memory.total))
    return min(tried, key=lambda r: r.memory.total)


def smallest_cluster(shape: ModelShape, cluster: Cluster, global_batch: int, seq_len: int, headroom: float,
                     max_nodes: int = 4096, activations: str = "jaxpar", **space) -> Cluster | None:
    """The fewest whole nodes on which some candidate fits in memory (doubling, then the nodes in between), its
    activations counted as `activations`' kernels keep them (plan/framework_memory.py)."""
    def fits_on(cand: Candidate, c: Cluster) -> bool:
        prediction = predict(shape, cand, global_batch, seq_len, c.platform)
        mem = memory(shape, cand, global_batch, seq_len, c.hbm_bytes, headroom, prediction, c.platform)
        return apply_activations(mem, shape, cand, prediction, global_batch, seq_len, c.platform, activations).fits

    def fits(nodes: int) -> bool:
        c = cluster.resized(nodes)
        return any(fits_on(cand, c) for cand in enumerate_candidates(shape, c.devices, global_batch, seq_len=seq_len,
                                                                      **space))
    nodes = cluster.nodes
    while nodes <= max_nodes and not fits(nodes):
        nodes *= 2
    if nodes > max_nodes:
        return None
    for smaller in range(max(1, nodes // 2 + 1), nodes):
        if fits(smaller):
            return cluster.resized(smaller)
    return cluster.resized(nodes)


# ----------------------------------------------------------------------------- explaining the choice

def _share(t: StepTime) -> str:
    terms = t.terms()
    name, value = max(terms.items(), key=lambda kv: kv[1])
    return f"{name} dominates ({value / t.total_s:.0%} of {t.total_s:.2f} s)"


def why_loses(best: Evaluated, other: Evaluated) -> str:
    """The term that costs `other` the most time relative to `best`."""
    a, b = best.time.terms(), other.time.terms()
    diffs = {k: b.get(k, 0.0) - a.get(k, 0.0) for k in set(a) | set(b)}
    name, worst = max(diffs.items(), key=lambda kv: kv[1])
    slower = other.time.total_s / best.time.total_s - 1
    return f"{slower:+.1%} slower, mostly {name} ({worst:+.2f} s)"


def family(c: Candidate) -> str:
    if c.pipe > 1:
        return "pipeline"
    if c.expert > 1:
        return "expert parallel"
    if c.tensor > 1:
        return "tensor parallel"
    if c.fsdp > 1 and c.data > 1:
        return "hybrid sharded (data x fsdp)"
    if c.fsdp > 1:
        return "fully sharded (fsdp only)"
    return "data parallel"


def defence(p: Plan, runners_up: int = 2) -> str:
    """One paragraph: the choice, the term that dominates its step, why the runners-up and the other families lose."""
    best = p.best
    c = best.cand
    t = best.time
    lines = [f"Choose {best.label} ({family(c)}): {t.total_s:.2f} s per step of {p.global_batch} x {p.seq_len} tokens, "
             f"{best.tokens_per_s / 1e6:.2f} M tokens/s, MFU {best.mfu:.0%} of the bf16 peak, {best.days:.1f} days for "
             f"{p.tokens:.3g} tokens; {_share(t)}, and it fits in {best.memory.total / GB:.0f} of "
             f"{best.memory.limit / GB:.0f} usable GB per device."]
    exposed = {k: v for k, v in t.exposed_s.items() if v > 0}
    if exposed:
        worst = max(exposed, key=lambda op: exposed[op])
        lines.append(f"Its largest exposed collective is on {worst} ({exposed[worst]:.3f} s of "
                     f"{t.comm_s[worst]:.3f} s, on {p.cluster.axis_link(c, worst).name}).")
    named = p.ranked[1:1 + runners_up]
    for r in named:
        lines.append(f"Runner-up {r.label}: {why_loses(best, r)}.")
    for field, r in variants(p):
        if r in named:
            continue
        if r.memory.fits:
            lines.append(f"Another {field}, {r.label}: {why_loses(best, r)}.")
        else:
            lines.append(f"Another {field}, {r.label}: does not fit ({r.memory.total / GB:.0f} GB per device).")
    seen = {family(c)}
    for r in p.ranked[1 + runners_up:]:
        fam = family(r.cand)
        if fam in seen:
            continue
        seen.add(fam)
        lines.append(f"Best {fam}, {r.label}: {why_loses(best, r)}.")
    if len(p.too_big) > 1:
        r = p.too_big[1]
        lines.append(f"Faster candidates do not fit: {r.label} would take {r.time.total_s:.2f} s but needs "
                     f"{r.memory.total / GB:.0f} GB per device.")
    lines.append(f"{p.evaluated - len(p.ranked)} of {p.evaluated} candidates do not fit in memory.")
    return " ".join(lines)


def variants(p: Plan) -> list[tuple[str, Evaluated]]:
    """For each setting besides the mesh (precision, attention, remat, microbatches), the fastest candidate that
    differs from the best only there, and whether any fits at all."""
    best = p.best.cand
    out = []
    for field in ("precision", "attention", "remat", "microbatches"):
        same = [r for r in p.results if getattr(r.cand, field) != getattr(best, field)
                and dataclasses.replace(r.cand, **{field: getattr(best, field)}) == best]
        if same:
            out.append((field, min(same, key=lambda r: (not r.memory.fits, r.time.total_s))))
    return out


# ----------------------------------------------------------------------------- tables

def table(p: Plan, top: int = 10, spread: tuple[float, float] | None = None) -> str:
    """The ranked plan as markdown (predictions); `spread`: (low, high) factors on each step time (plan/anchors.py),
    printed as a range beside the step, tokens/s and days."""
    money = p.cluster.price_per_gpu_hour is not None
    low, high = spread or (1.0, 1.0)

    def ranged(value: float, text: str, inverse: bool = False) -> str:
        if spread is None:
            return text.format(value)
        a, b = (value / high, value / low) if inverse else (value * low, value * high)
        return f"{text.format(value)} ({text.format(a)}-{text.format(b)})"
    head = ("| # | strategy | memory GB | step s | compute s | exposed comm s | bubble s | tokens/s | "
            "MFU (bf16 peak) | days | "
            "GPU-hours |" + (" cost |" if money else "") + " note |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for i, r in enumerate(p.ranked[:top], 1):
        t = r.time
        cost = f" {r.cost:,.0f} |" if money else ""
        lines.append(f"| {i} | {r.label} | {r.memory.total / GB:.1f} | {ranged(t.total_s, '{:.3f}')} | "
                     f"{t.compute_s:.3f} | {sum(t.exposed_s.values()):.3f} | {t.bubble_s:.3f} | "
                     f"{ranged(r.tokens_per_s, '{:,.0f}', inverse=True)} | {r.mfu:.1%} | {ranged(r.days, '{:.1f}')} | "
                     f"{r.gpu_hours:,.0f} |{cost} {r.note} |")
    return "\n".join(lines)


def summary_line(p: Plan) -> str:
    return (f"{p.shape.describe()}; {p.cluster.describe()}; global batch {p.global_batch} x {p.seq_len} tokens; "
            f"budget {p.tokens:.3g} tokens{p.budget_note}; {p.evaluated} candidates, {len(p.ranked)} fit "
            f"(memory headroom {p.headroom:.0%}; model state in {_layout(p)}). Predictions, not measurements.")


def _layout(p: Plan) -> str:
    from jaxpar.plan.layouts import LAYOUTS
    layout = p.results[0].memory.layout if p.results else "jaxpar"
    return f"the {layout} layout ({LAYOUTS[layout]})"


def predict_config(config, sizes: dict[str, int], vocab: int, cluster: Cluster,
                   calibration: Calibration = GPU_CALIBRATION) -> StepTime:
    """The calibrated step time of one config on one cluster (what `jaxpar dryrun` reports)."""
    shape = ModelShape.from_config(config, vocab)
    cand = candidate_from_config(config, sizes, cluster.platform)
    return step_time(shape, cand, cluster, config.train.batch_size, config.data.seq_len, calibration)
