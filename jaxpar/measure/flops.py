"""FLOPs of a training step: the model's (analytic) and the compiled program's, and MFU.

`compiled.cost_analysis()["flops"]` undercounts any program with a loop: XLA's
HloCostAnalysis adds a `while` body's cost once, whatever its trip count, so a
32-layer scanned model reports about one layer's worth.

The correction is read from the HLO. We emulate HloCostAnalysis' counting rules per
instruction (dot: 2·|result|·|contracted dims|; elementwise arithmetic: one per
result element; reduce: |input| - |result|; transcendentals, data movement and
collectives: none), sum them two ways,

  once      every computation counted once      (what cost_analysis does)
  per_step  every computation times the number of times it runs per step
            (product of the trip counts of the loops around it: `hlo.collectives`'
            trip-count logic, from XLA's `known_trip_count`)

and report  corrected = cost_analysis + (per_step - once).

Dots are counted exactly; the elementwise rules approximate XLA's within ~1% of the
non-dot FLOPs, which are themselves a few % of a transformer's. The deviceless GPU
compile has no cost_analysis (None): there `per_step` alone is the figure.
Checked in tests/test_dryrun.py against cost_analysis of the same step with every
scan unrolled (no loops left, so nothing to correct).
"""
from __future__ import annotations

import dataclasses
import re

import numpy as np

from jaxpar.measure import hlo

# Opcodes HloCostAnalysis counts as transcendentals (a separate tally), or as no FLOPs at all.
TRANSCENDENTAL = {"exponential", "exponential-minus-one", "log", "log-plus-one", "tanh", "rsqrt", "sqrt",
                  "cbrt", "power", "logistic", "sine", "cosine", "tan", "atan2", "erf"}
NO_FLOPS = {"parameter", "constant", "broadcast", "reshape", "bitcast", "copy", "transpose", "slice",
            "dynamic-slice", "dynamic-update-slice", "concatenate", "pad", "tuple", "get-tuple-element",
            "iota", "fusion", "while", "call", "conditional", "custom-call", "convert", "bitcast-convert",
            "reverse", "gather", "scatter", "after-all", "partition-id", "replica-id", "copy-start",
            "copy-done", "optimization-barrier", "rng-bit-generator", "rng", "rng-get-and-update-state",
            "send", "recv", "send-done", "recv-done", "infeed", "outfeed", "domain", "add-dependency"}
_ASYNC = ("-start", "-done", "-update")
# cuBLAS GEMM custom calls (GPU, when XLA does not emit a Triton gemm fusion); their dims are in backend_config.
_GEMM_TARGETS = ("__cublas$gemm", "__cublas$lt$matmul")


def _elements(shape_text: str) -> int:
    return sum(int(np.prod(dims, dtype=np.int64)) for _, dims in hlo.parse_shapes(shape_text))


def _first_operand(line: str, opcode: str) -> str | None:
    m = re.search(re.escape(opcode) + r"\(\s*(?:[a-z][a-z0-9]*\[[^\]]*\](?:\{[^}]*\})?\s+)?%?([\w.\-]+)", line)
    return m.group(1) if m else None


def _contracted(line: str, lhs_dims: tuple[int, ...]) -> int:
    m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", line)
    if m:
        dims = [int(d) for d in m.group(1).split(",") if d]
    else:   # cuBLAS custom call: "lhs_contracting_dimensions":["1"]
        m = re.search(r'"lhs_contracting_dimensions"\s*:\s*\[([^\]]*)\]', line)
        dims = [int(d) for d in re.findall(r"\d+", m.group(1))] if m else []
    return int(np.prod([lhs_dims[d] for d in dims], dtype=np.int64)) if dims else 1


def instruction_flops(ins, shapes: dict) -> float:
    """FLOPs of one HLO instruction under HloCostAnalysis' rules (see module docstring)."""
    op = ins.opcode
    if op == "dot" or (op == "custom-call" and any(t in ins.line for t in _GEMM_TARGETS)):
        lhs = _first_operand(ins.line, op)
        lhs_shapes = hlo.parse_shapes(shapes.get((ins.computation, lhs), ""))
        if not lhs_shapes:
            return 0.0
        result = hlo.parse_shapes(ins.shape_text)[0][1]      # a gemm custom call's result may be a tuple
        return 2.0 * int(np.prod(result, dtype=np.int64)) * _contracted(ins.line, lhs_shapes[0][1])
    if op == "reduce":
        operand = _first_operand(ins.line, op)
        return float(max(_elements(shapes.get((ins.computation, operand), "")) - _elements(ins.shape_text), 0))
    if op in TRANSCENDENTAL or op in NO_FLOPS or op.endswith(_ASYNC) or op in hlo.COLLECTIVE_OPS:
        return 0.0
    return float(_elements(ins.shape_text))   # elementwise arithmetic, compare, select, ...


@dataclasses.dataclass(frozen=True)
class HloFlops:
    """FLOPs of one device's program read from its HLO text."""

    once: float             # every computation counted once, like cost_analysis
    per_step: float         # every computation times the runs per step
    dot_once: float
    dot_per_step: float
    trip_counts_known: bool


def hlo_flops(hlo_text: str) -> HloFlops:
    """Count FLOPs in post-optimization HLO text, once per computation and per step."""
    instructions, entry = hlo.parse_module(hlo_text)
    runs = hlo.runs_per_computation(instructions, entry)
    shapes = {(ins.computation, ins.name): ins.shape_text for ins in instructions}
    once = per_step = dot_once = dot_per_step = 0.0
    known = True
    for ins in instructions:
        flops = instruction_flops(ins, shapes)
        if not flops:
            continue
        n, ok = runs(ins.computation)
        known = known and ok
        once, per_step = once + flops, per_step + flops * n
        if ins.opcode in ("dot", "custom-call"):
            dot_once, dot_per_step = dot_once + flops, dot_per_step + flops * n
    return HloFlops(once, per_step, dot_once, dot_per_step, known)


def cost_analysis_flops(compiled) -> float | None:
    """`cost_analysis()['flops']` (per device), or None where the backend gives none (deviceless GPU)."""
    try:
        ca = compiled.cost_analysis()
    except Exception:   # noqa: BLE001 - some backends raise instead of returning None
        return None
    if isinstance(ca, (list, tuple)):   # older jax returned one dict per program
        ca = ca[0] if ca else None
    if not ca or "flops" not in ca:
        return None
    return float(ca["flops"])


def compiled_flops(compiled, hlo_text: str | None = None, kernel_flops: float | None = None) -> dict:
    """Per-device FLOPs per step of a compiled program, corrected for loop trip counts.

    `kernel_flops`: the fused kernels' FLOPs per step (`jaxpar.kernels.costs.kernel_flops` of the
    step's jaxpr). Added when the program runs them as custom calls (GPU), which count as zero;
    on CPU the kernels run interpreted as XLA loops the HLO count already includes.
    """
    from jaxpar.kernels.costs import hlo_has_kernels
    text = hlo_text if hlo_text is not None else compiled.as_text()
    counted = hlo_flops(text)
    raw = cost_analysis_flops(compiled)
    if raw is None:
        corrected, method = counted.per_step, "HLO count (no cost_analysis on this backend)"
    else:
        corrected, method = raw + counted.per_step - counted.once, "cost_analysis + HLO loop correction"
    added = kernel_flops if kernel_flops and hlo_has_kernels(text) else 0.0
    if added:
        corrected, method = corrected + added, method + " + kernel cost estimates (custom calls count zero)"
    return {"cost_analysis": raw, "hlo_once": counted.once, "hlo_per_step": counted.per_step,
            "dot_per_step": counted.dot_per_step, "kernels": kernel_flops or 0.0, "kernels_added": added,
            "corrected": corrected, "method": method, "trip_counts_known": counted.trip_counts_known}


# ----------------------------------------------------------------------------- analytic and MFU

def model_flops_per_step(model_cfg, batch_size: int, seq_len: int) -> float:
    """Model FLOPs of one optimizer step over the whole batch (all devices): the MFU numerator."""
    from jaxpar.model.counting import train_flops_per_token
    return train_flops_per_token(model_cfg, seq_len) * batch_size * seq_len


def mfu(model_flops: float, step_time_s: float, num_devices: int, peak_flops_per_device: float) -> float:
    """Model FLOPs utilisation: model FLOPs per second / the devices' summed peak."""
    return model_flops / (step_time_s * num_devices * peak_flops_per_device)


class Throughput:
    """Tokens/s and MFU of single steps against a peak, which a measured peak cannot fall below.

    MFU above 100% is impossible. A measured peak (the CPU probe) can be beaten by the run
    itself when the probe ran while the host was busier: a step that does so raises the peak
    to its own rate (the first time with a `notice`; `describe` states the final peak), so
    the peak is the best of the probe and the run's fastest step. A datasheet peak is never raised: a step
    above it means the FLOP count or the table is wrong, and its MFU is shown as it is.
    """

    def __init__(self, flops_per_step: float, tokens_per_step: int, devices: int, peak, notice=print):
        self.flops_per_step, self.tokens_per_step, self.devices = flops_per_step, tokens_per_step, devices
        self.peak, self.source, self.measured = peak.per_device, peak.source, peak.measured
        self.notice = notice
        self.above_at: int | None = None

    def step(self, step: int, seconds: float | None) -> dict:
        """step_time_s, tokens_per_s and mfu of one step (None for an untimed step)."""
        if not seconds:
            return {"step_time_s": None, "tokens_per_s": None, "mfu": None}
        rate = self.flops_per_step / seconds / self.devices      # achieved model FLOP/s per device
        if self.peak and rate > self.peak:
            self._above_peak(step, rate)
        return {"step_time_s": seconds, "tokens_per_s": self.tokens_per_step / seconds,
                "mfu": rate / self.peak if self.peak else None}

    def _above_peak(self, step: int, rate: float) -> None:
        first, self.above_at = self.above_at is None, step
        if first:
            self.notice(f"step {step} ran at {flop_rate(rate)} per device, above the "
                        + (f"measured peak {flop_rate(self.peak)} (the probe ran while the host was busier): the "
                           "peak is now the fastest step's rate" if self.measured else
                           f"datasheet peak {flop_rate(self.peak)}: the model's FLOP count or the peak table is wrong"))
        if self.measured:
            self.peak = rate

    def describe(self) -> str:
        if not self.peak:
            return f"MFU is not computed: {self.source}"
        above = ""
        if self.above_at is not None:
            above = (f"; raised to the rate of the fastest step (step {self.above_at}), which beat the probe"
                     if self.measured else f"; step {self.above_at} ran above it")
        return f"MFU is measured against a peak of {flop_rate(self.peak)} per device: {self.source}{above}"

    def summary(self) -> dict:
        return {"peak_flops_per_device": self.peak, "peak_source": self.describe()}


def flop_rate(per_second: float) -> str:
    return f"{per_second / 1e12:.4g} TFLOP/s" if per_second >= 1e12 else f"{per_second / 1e9:.4g} GFLOP/s"
