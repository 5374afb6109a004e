"""Which communication a compiled program hides behind computation, read from its schedule.

A scheduled HLO module (`is_scheduled=true`, what `compiled.as_text()` prints) lists each
computation's instructions in execution order. On GPU a collective is asynchronous: an
`*-start` issues the transfer, the matching `*-done` waits for it, and whatever the
schedule puts between the two runs while the bytes are on the wire.

We replay each computation on two clocks: the compute stream (every instruction costs its
roofline time, max(FLOPs / peak, bytes touched / memory bandwidth)) and one communication
stream (each collective costs α + bytes / β on the link its group crosses, and collectives
queue behind each other, as NCCL's do on one stream). At a `-done` the compute stream waits
until the transfer ends: that wait is the collective's *exposed* time, the rest of its α-β
time is *hidden*. A synchronous collective (CPU; or a GPU one XLA did not make async) is
fully exposed, and so is a start/done pair XLA marks `"is_sync":true` in its backend config.
A `while` loop costs its trip count x its body's replayed time; a transfer
started at the end of a loop body and finished at the top of the next trip (XLA's
collective pipeliner) is replayed across the boundary.

This is a model of the schedule, not a measurement of a run: the roofline costs are
optimistic for small kernels, and a kernel running beside a transfer loses some bandwidth
to it (neither is modelled).
"""
from __future__ import annotations

import dataclasses
import re
from collections import defaultdict

import numpy as np

from jaxpar.measure import hlo
from jaxpar.measure.hlo_module import matching_bracket, trip_count
from jaxpar.units import fmt_seconds

FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "partition-id",
        "replica-id", "opt-barrier", "add-dependency", "iota"}
_CONTRACT = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
_GEMM_CONTRACT = re.compile(r'"lhs_contracting_dimensions":\[([^\]]*)\]')
_CALLS = re.compile(r"\bcalls=%?([\w.\-]+)")


@dataclasses.dataclass(frozen=True)
class Hardware:
    """What the replay divides by: dense FLOP/s and memory bytes/s of one device."""

    peak_flops: float
    hbm_bw: float


@dataclasses.dataclass
class Record:
    """One collective's replay: per execution, then how often it runs per step."""

    name: str
    op: str
    axis: str
    duration_s: float       # α + bytes/β, one execution
    compute_s: float        # roofline time of the compute scheduled between start and done
    exposed_s: float        # the compute stream's wait at the done (at most duration_s)
    runs_per_step: int
    is_async: bool

    @property
    def hidden_s(self) -> float:
        return self.duration_s - self.exposed_s


def _operands(ins) -> list[str]:
    at = ins.line.index(ins.opcode + "(", ins.line.index("=")) + len(ins.opcode)
    return re.findall(r"%([\w.\-]+)", ins.line[at:matching_bracket(ins.line, at)])


class Schedule:
    """A parsed scheduled module, with the roofline cost of every instruction."""

    def __init__(self, hlo_text: str, hardware: Hardware):
        self.instructions, self.entry = hlo.parse_module(hlo_text)
        self.hw = hardware
        self.by_computation = defaultdict(list)
        for ins in self.instructions:
            self.by_computation[ins.computation].append(ins)
        self.shape = {ins.name: ins.shape_text for ins in self.instructions}
        self._flops: dict[str, float] = {}

    def _bytes(self, name: str) -> int:
        return hlo.shapes_bytes(hlo.parse_shapes(self.shape.get(name, "")))

    def dot_flops(self, ins) -> float:
        """2 x output elements x contracted elements (a dot, or a cuBLAS gemm custom call)."""
        out = hlo.parse_shapes(ins.shape_text)
        if not out:
            return 0.0
        dims = _CONTRACT.search(ins.line) or _GEMM_CONTRACT.search(ins.line)
        lhs = hlo.parse_shapes(self.shape.get(_operands(ins)[0], "")) if _operands(ins) else ()
        if not dims or not lhs:
            return 0.0
        contracted = np.prod([lhs[0][1][int(d)] for d in re.findall(r"\d+", dims.group(1))], dtype=np.float64)
        return 2.0 * float(np.prod(out[0][1], dtype=np.float64)) * float(contracted)

    def computation_flops(self, comp: str) -> float:
        """Matmul FLOPs inside a fused computation (nested fusions included)."""
        if comp not in self._flops:
            total = 0.0
            for ins in self.by_computation.get(comp, []):
                if ins.opcode in ("dot", "convolution"):
                    total += self.dot_flops(ins)
                elif ins.opcode == "fusion":
                    callee = _CALLS.search(ins.line)
                    total += self.computation_flops(callee.group(1)) if callee else 0.0
            self._flops[comp] = total
        return self._flops[comp]

    def kernel_s(self, ins) -> float:
        """Roofline seconds of one kernel: max(FLOPs / peak, bytes read and written / bandwidth)."""
        if ins.opcode in ("dot", "convolution") or "__cublas$gemm" in ins.line:
            flops = self.dot_flops(ins)
        elif ins.opcode == "fusion":
            callee = _CALLS.search(ins.line)
            flops = self.computation_flops(callee.group(1)) if callee else 0.0
        else:
            flops = 0.0
        reads = [self._bytes(o) for o in _operands(ins)]
        written = hlo.shapes_bytes(hlo.parse_shapes(ins.shape_text))
        if "dynamic_update_slice" in ins.name or ins.opcode == "dynamic-update-slice":
            reads = sorted(reads)[:-1]          # in place: the big buffer is neither read nor rewritten whole
            written = sum(reads)
        elif "dynamic_slice" in ins.name or ins.opcode == "dynamic-slice":
            reads = [written]
        return max(flops / self.hw.peak_flops, (sum(reads) + written) / self.hw.hbm_bw)


def _done_operand(ins) -> str | None:
    m = re.search(r"-done\(\s*%?([\w.\-]+)", ins.line)
    return m.group(1) if m else None


class _Replay:
    """Replays computations on a compute clock and a communication clock (see the module docstring)."""

    def __init__(self, schedule: Schedule, collectives: dict, duration):
        self.s, self.collectives, self.duration = schedule, collectives, duration
        self.records: dict[str, Record] = {}
        self.runs = hlo.runs_per_computation(schedule.instructions, schedule.entry)
        self._time: dict[str, float] = {}

    def time(self, comp: str) -> float:
        """Seconds one execution of `comp` takes on the compute stream, waits included."""
        if comp not in self._time:
            self._time[comp] = 0.0            # recursion guard
            first, carry = self._pass(comp, {}, record=False)
            self._time[comp] = self._pass(comp, {k: (end - first) for k, end in carry.items()}, record=True)[0]
        return self._time[comp]

    def _cost(self, ins) -> float:
        if ins.opcode == "while":
            body = re.search(r"\bbody=%?([\w.\-]+)", ins.line)
            if body is None:
                raise ValueError(f"a while loop without its body: {ins.line.strip()[:80]!r}")
            trips = trip_count(ins, self.s.by_computation) or 1
            return trips * self.time(body.group(1))
        if ins.opcode == "conditional":
            listed = re.search(r"branch_computations=\{([^}]*)\}", ins.line)
            names = re.findall(r"%?([\w.\-]+)", listed.group(1)) if listed else []
            return max((self.time(n) for n in names), default=0.0)
        if ins.opcode in ("call", "async-start") and (called := _CALLS.search(ins.line)):
            return self.time(called.group(1))
        if ins.opcode in FREE or ins.opcode.endswith(("-start", "-done")):
            return 0.0
        return self.s.kernel_s(ins)

    def _pass(self, comp: str, carried: dict, record: bool) -> tuple[float, dict]:
        clock, link, inflight = 0.0, 0.0, {}          # inflight: start name -> (end time, compute so far)
        compute = 0.0
        for ins in self.s.by_computation.get(comp, []):
            c = self.collectives.get(ins.name)
            if c is not None and c.is_async and '"is_sync":true' not in ins.line:
                begin = max(clock, link)
                link = begin + self.duration(c)
                inflight[ins.name] = (link, compute)
            elif c is not None:                        # synchronous: the compute stream waits for all of it
                begin = max(clock, link)
                link = clock = begin + self.duration(c)
                if record:
                    self._record(c, 0.0, self.duration(c), asynchronous=False)
            elif ins.opcode.endswith("-done") and _done_operand(ins) in self.collectives:
                start = _done_operand(ins)
                if start in inflight:
                    end, compute_then = inflight.pop(start)
                    between = compute - compute_then
                elif start in carried:                 # issued in the previous trip of this loop body
                    end, between = carried[start], compute
                else:
                    continue
                wait = max(0.0, end - clock)
                clock += wait
                if record:
                    self._record(self.collectives[start], between, wait)
            else:
                cost = self._cost(ins)
                clock += cost
                compute += cost
        return clock, {name: end for name, (end, _) in inflight.items()}

    def _record(self, c, between: float, wait: float, asynchronous: bool = True) -> None:
        duration = self.duration(c)
        self.records[c.name] = Record(c.name, c.op, c.axis_label, duration, between, min(wait, duration),
                                      self.runs(c.computation)[0], asynchronous)


def replay(hlo_text: str, hardware: Hardware, duration, mesh=None) -> tuple[list[Record], float]:
    """Every collective's replay, and the replayed time of one execution of the entry computation.

    `duration(collective)` -> seconds of one execution (α-β on its link, see `alpha_beta`).
    """
    schedule = Schedule(hlo_text, hardware)
    found = {c.name: c for c in hlo.collectives(hlo_text, mesh)}
    r = _Replay(schedule, found, duration)
    total = r.time(schedule.entry)
    return list(r.records.values()), total


def alpha_beta(link_of):
    """duration(collective) = α + bytes per run / β, with (α, β) = `link_of(collective)`."""
    def duration(c) -> float:
        alpha, beta = link_of(c)
        return alpha + c.bytes_per_run / beta
    return duration


def by_axis(records: list[Record]) -> dict[str, dict]:
    """Per mesh axis, per step: collective seconds, hidden, exposed, the hidden fraction."""
    out: dict[str, dict] = {}
    for r in records:
        row = out.setdefault(r.axis, {"collectives": 0, "async": 0, "comm_s": 0.0, "hidden_s": 0.0,
                                      "exposed_s": 0.0, "compute_between_s": 0.0})
        row["collectives"] += 1
        row["async"] += int(r.is_async)
        row["comm_s"] += r.duration_s * r.runs_per_step
        row["hidden_s"] += r.hidden_s * r.runs_per_step
        row["exposed_s"] += r.exposed_s * r.runs_per_step
        row["compute_between_s"] += r.compute_s * r.runs_per_step
    for row in out.values():
        row["hidden_fraction"] = row["hidden_s"] / row["comm_s"] if row["comm_s"] else 0.0
    return out


def summary(records: list[Record], step_s: float) -> dict:
    """The JSON the dry run stores: per axis, totals, the replayed step and every collective."""
    axes = by_axis(records)
    comm = sum(a["comm_s"] for a in axes.values())
    hidden = sum(a["hidden_s"] for a in axes.values())
    return {"by_axis": axes, "comm_s": comm, "hidden_s": hidden, "exposed_s": comm - hidden,
            "hidden_fraction": hidden / comm if comm else 0.0, "replayed_step_s": step_s,
            "collectives": [{**dataclasses.asdict(r), "hidden_s": r.hidden_s} for r in records]}


def markdown(result: dict) -> list[str]:
    """The dry run report's overlap section."""
    lines = ["## Communication hidden behind compute (the compiled schedule, replayed)", "",
             "| mesh axis | collectives (async) | α-β time | hidden | exposed | hidden fraction |",
             "|---|---:|---:|---:|---:|---:|"]
    for axis, a in sorted(result["by_axis"].items()):
        lines.append(f"| {axis} | {a['collectives']} ({a['async']}) | {fmt_seconds(a['comm_s'])} | "
                     f"{fmt_seconds(a['hidden_s'])} | {fmt_seconds(a['exposed_s'])} | {a['hidden_fraction']:.1%} |")
    lines += ["", (f"Replayed step (compute at roofline + exposed waits): {fmt_seconds(result['replayed_step_s'])}; "
              f"{result['hidden_fraction']:.1%} of the α-β collective time hidden. A model of the schedule "
              "(jaxpar/measure/overlap.py), not a measurement.")]
    return lines


def link_model(mesh, machine: dict):
    """(α, β) of the link a collective's groups cross, as the planner models it (plan/fleet.py: the datasheet
    bandwidth x LINK_EFFICIENCY, α per link); on CPU the host's measured copy bandwidth and no α."""
    from jaxpar.measure import hardware
    if machine["platform"] == "cpu":
        return lambda c: (0.0, hardware.probe_host().link_bw)
    acc = hardware.ACCELERATORS[machine["accelerator"]]
    flat = list(mesh.devices.flat)

    def link_of(c):
        crosses = any(len({flat[i].process_index for i in g}) > 1 for g in c.replica_groups)
        if crosses:
            return hardware.ALPHA_INFINIBAND_S, acc.scaleout_bw * hardware.LINK_EFFICIENCY
        return hardware.ALPHA_NVLINK_S, acc.link_bw * hardware.LINK_EFFICIENCY
    return link_of


def analyse(hlo_text: str, mesh, machine: dict, peak_flops: float) -> dict:
    """The overlap section of a dry run: the compiled schedule replayed on `machine` (see the module docstring)."""
    from jaxpar.measure import hardware
    if machine["platform"] == "cpu":
        bw = hardware.probe_host().hbm_bw / mesh.devices.size
    else:
        bw = hardware.ACCELERATORS[machine["accelerator"]].hbm_bw
    records, step = replay(hlo_text, Hardware(peak_flops, bw), alpha_beta(link_model(mesh, machine)), mesh)
    return summary(records, step)
