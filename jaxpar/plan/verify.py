"""From a candidate to a config jaxpar can build, and the check of the top candidates against the compiler.

`candidate_config` writes a candidate as `--set` overrides of a base config and asks the
checkout whether it can build it: `jaxpar.config.validate` must accept the mesh, and the registry
(`jaxpar.parallel.registry.select`) must find a strategy. Whatever refuses, its one-line
ConfigError becomes the reason the candidate stays "formula only". Nothing here names the
strategies the checkout has: after a merge the same code builds what the merge added.

`verify` compiles the best buildable candidates deviceless for a GPU target
(`jaxpar.measure.dryrun`, which needs the CUDA plugin wheels, not a GPU) and sets the predicted
memory and bytes per mesh axis beside the compiled ones; a candidate whose compiled peak
does not fit the device is demoted below every candidate that was not, with the reason.
"""
from __future__ import annotations

import copy
import dataclasses

from jaxpar.config import ConfigError, apply_overrides, validate
from jaxpar.parallel.theory import Candidate
from jaxpar.units import GIB

# model.attention of a fused (flash) kernel: jaxpar's Pallas kernel, Triton on GPU. cuDNN's (`cudnn`) is the other
# GPU choice, but it cannot even be traced without the cuDNN library, so a deviceless compile could not check it.
FLASH = "pallas"


def candidate_overrides(cand: Candidate, global_batch: int, seq_len: int, platform: str = "gpu") -> list[str]:
    """The `--set FIELD=VALUE` list that makes a config run `cand`."""
    out = [f"mesh.{axis}={size}" for axis, size in cand.sizes.items()]
    out += [f"train.batch_size={global_batch}", f"data.seq_len={seq_len}", f"train.remat={cand.remat}",
            f"train.compute_dtype={cand.precision}", f"parallel.data={cand.data_impl}"]
    if cand.pipe > 1:
        out += [f"parallel.pipe={cand.schedule}", f"parallel.pipe_microbatches={cand.microbatches}",
                "train.microbatches=1"]
        if cand.virtual > 1:
            out += [f"parallel.pipe_virtual={cand.virtual}"]
    else:
        out += [f"train.microbatches={cand.microbatches}"]
    if cand.expert > 1:
        out += ["parallel.expert=manual"]
    if cand.sequence:     # jaxpar builds sequence parallelism under Megatron's hand-written tensor axis
        out += ["parallel.tensor=manual", "parallel.sequence=true"]
        if cand.tensor_overlap != "none":
            out += [f"parallel.tensor_overlap={cand.tensor_overlap}"]
    if cand.attention == "flash":
        out += [f"model.attention={FLASH}"]
    return out + [f"parallel.{axis}={impl}" for axis, _, impl in cand.added]


def candidate_config(base, cand: Candidate, global_batch: int, seq_len: int, platform: str = "gpu"):
    """(config, None) when this checkout can build `cand`, else (None, the reason it stays formula only)."""
    from jaxpar.parallel.registry import select
    from jaxpar.plan.layouts import BUILDABLE
    if cand.layout not in BUILDABLE:
        return None, f"formula only: jaxpar does not build the {cand.layout} layout"
    overrides = candidate_overrides(cand, global_batch, seq_len, platform)
    config = copy.deepcopy(base)
    try:
        with config.unlocked():
            config.model.max_seq_len = max(config.model.max_seq_len, seq_len)
        apply_overrides(config, overrides)
        sizes = validate(config, cand.devices)
        select(config, sizes)
    except ConfigError as err:
        return None, f"formula only: {err}"
    return config, None


def annotate(plan, base, count: int, platform: str = "gpu") -> None:
    """Mark the first `count` ranked candidates this checkout cannot build as formula only, with the reason."""
    for r in plan.ranked[:count]:
        if not r.note:
            r.note = candidate_config(base, r.cand, plan.global_batch, plan.seq_len, platform)[1] or "builds"


def best_buildable(plan, base, platform: str = "gpu"):
    """(rank, candidate) of the best ranked candidate this checkout can build, or (None, None)."""
    for rank, r in enumerate(plan.ranked, 1):
        if candidate_config(base, r.cand, plan.global_batch, plan.seq_len, platform)[0] is not None:
            return rank, r
    return None, None


def buildable_sentence(plan, base) -> str:
    """One sentence for the defence: what this checkout can run of the plan."""
    from jaxpar.plan.planner import why_loses
    rank, r = best_buildable(plan, base)
    if r is None:
        return "This checkout builds none of the candidates that fit: every one is formula only."
    if rank == 1:
        return "This checkout builds the chosen strategy."
    return (f"This checkout cannot build the {rank - 1} better-ranked candidate(s) (formula only, see the notes); "
            f"the best it builds is #{rank}, {r.label}: {why_loses(plan.best, r)}.")


@dataclasses.dataclass
class Verified:
    label: str
    predicted_peak: float
    compiled_peak: float
    usable: float
    bytes: dict            # mesh axis label -> (predicted, compiled)
    compile_s: float
    demoted: str = ""

    @property
    def memory_ratio(self) -> float:
        return self.compiled_peak / self.predicted_peak


def _axis_bytes(predicted: dict, compiled: dict) -> dict:
    labels = {k for k, v in predicted.items() if v} | {k for k, v in compiled.items() if v}
    return {k: (predicted.get(k, 0.0), compiled.get(k, {}).get("bytes", 0.0) if isinstance(compiled.get(k), dict)
                else compiled.get(k, 0.0)) for k in sorted(labels)}


def verify(plan, base_config, count: int, target: str = "h100", log=print) -> tuple[list[Verified], list[str]]:
    """Compile the `count` best buildable candidates of `plan` for `target`; demote those that do not fit.

    Returns (what was compiled, one line per reason the better-ranked candidates were not built: how many,
    the best of them). Reorders plan.ranked in place.
    """
    from jaxpar.measure.dryrun import dryrun
    cluster = plan.cluster
    topology = f"1x{cluster.nodes}x{cluster.per_node}"
    verified: list = []
    skipped: dict = {}
    for rank, r in enumerate(list(plan.ranked), 1):
        if len(verified) >= count:
            break
        config, reason = candidate_config(base_config, r.cand, plan.global_batch, plan.seq_len, "gpu")
        if config is None:
            r.note = reason
            first = skipped.setdefault(reason, [0, rank, r.label])
            first[0] += 1
            continue
        log(f"  compiling {r.label} for {target} {topology} ...")
        result = dryrun(config, target, topology=topology)
        compiled = result["memory"]["compiled"]["peak"]
        usable = plan.cluster.hbm_bytes * (1 - plan.headroom)
        v = Verified(f"#{rank} {r.label}", r.memory.total, compiled, usable,
                     _axis_bytes(r.comm_bytes, result["collectives"]["by_axis"]), result["timing"]["compile_s"])
        r.note = f"compiled peak {compiled / GIB:.1f} GiB ({compiled / r.memory.total:.2f}x predicted)"
        if compiled > usable:
            v.demoted = (f"demoted: compiled peak {compiled / 1e9:.1f} GB exceeds the {usable / 1e9:.0f} GB usable "
                         f"({1 - plan.headroom:.0%} of {plan.cluster.hbm_bytes / 1e9:.0f} GB)")
            r.note = v.demoted
        verified.append(v)
    plan.ranked.sort(key=lambda r: r.note.startswith("demoted"))   # stable: the order is kept otherwise
    lines = [f"{n} candidate(s), the best #{rank} {label}: {reason}" for reason, (n, rank, label) in skipped.items()]
    return verified, lines


def verification_table(verified: list[Verified]) -> str:
    lines = ["| strategy | memory predicted GiB | compiled GiB | compiled / predicted | bytes per axis: predicted / "
             "compiled GiB (ratio) | fits |", "|---|---:|---:|---:|---|---|"]
    for v in verified:
        axes = "; ".join(f"{axis} {p / GIB:.2f} / {c / GIB:.2f} ({c / p:.3f})" if p else f"{axis} - / {c / GIB:.2f}"
                         for axis, (p, c) in v.bytes.items()) or "none"
        lines.append(f"| {v.label} | {v.predicted_peak / GIB:.2f} | {v.compiled_peak / GIB:.2f} | "
                     f"{v.memory_ratio:.3f} | {axes} | {v.demoted or 'yes'} |")
    return "\n".join(lines)
