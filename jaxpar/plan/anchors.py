"""Published H100 runs the planner's compute efficiency η is fitted on, one η per framework.

Each anchor is a published run evaluated with ITS OWN strategy, model, cluster, batch, precision and
memory layout; η is the value at which the planner predicts its published tokens/s per GPU, and a
"check" anchor is predicted with its framework's fitted values. Sources and roles:
experiments/10_capstone/README.md, "How the model is built".

Every anchor is fitted and predicted with the calibration `jaxpar plan` predicts with (GPU_CALIBRATION:
the compiled schedules' measured overlap per layout and axis where recorded, plan/overlap.py, else the
assumed overlap), so the η a prediction uses is the η its model was fitted with.

One anchor per η means a fitted anchor's 1.00 is the fit's tolerance, not a test. What the η is worth
on a run it was not fitted on is `spread`: the framework's η predicting every anchor it was NOT fitted
on (leave-one-out), as predicted / published; `jaxpar plan` prints each prediction with that range.
"""
from __future__ import annotations

import dataclasses
import functools

from jaxpar.model.counting import ModelShape
from jaxpar.plan.fleet import gpu_cluster
from jaxpar.plan.steptime import GPU_CALIBRATION, Calibration

LLAMA2_70B = ModelShape.dense(vocab=32000, d_model=8192, layers=80, heads=64, kv_heads=8, head_dim=128, mlp_dim=28672)
LLAMA31_8B = ModelShape.dense(vocab=128256, d_model=4096, layers=32, heads=32, kv_heads=8, head_dim=128, mlp_dim=14336)
LLAMA2_7B = ModelShape.dense(vocab=32000, d_model=4096, layers=32, heads=32, kv_heads=32, head_dim=128, mlp_dim=11008)
H100_BF16_PEAK = 989e12


@dataclasses.dataclass(frozen=True)
class Anchor:
    name: str
    framework: str
    shape: ModelShape
    nodes: int
    per_node: int
    global_batch: int
    seq_len: int
    strategy: str              # the published run's strategy, in `jaxpar plan --strategy` syntax
    layout: str                # model-state layout (plan/layouts.py)
    published: float           # tokens/s per GPU
    role: str                  # "η" (fits η), "fp8" (fits the fp8 factor), "check"
    note: str = ""
    published_on: str = "not recorded"   # when the figure was published, where the source says


def _tokens_at_mfu(shape: ModelShape, seq_len: int, mfu: float) -> float:
    return mfu * H100_BF16_PEAK / shape.flops_per_token(seq_len)


CP_NOTE = "the recipe's TP 1, PP 1, CP 2, micro batch 1, 32 accumulation steps"
NEMO_2409 = "2024-09 (NeMo 24.09)"
# NeMo's published performance runs reduce and keep the gradients in bf16 (`optim.grad_sync_dtype=bf16` in
# NeMo-Framework-Launcher's H100 Llama examples), not Megatron's fp32 default: the layout says so.
BF16_GRADS = "distributed-optimizer-bf16-grads"
ANCHORS: tuple[Anchor, ...] = (
    Anchor("MaxText Llama-2-70B bf16", "jaxpar (XLA)", LLAMA2_70B, 8, 8, 256, 4096,
           "fsdp=64 m=1 remat=full bf16 flash", "jaxpar", _tokens_at_mfu(LLAMA2_70B, 4096, 0.51), "η",
           "published as ~51% MFU; cluster, batch and strategy are stand-ins", "not recorded (the course's quote)"),
    Anchor("NeMo 24.09 Llama-3.1-8B bf16", "NeMo", LLAMA31_8B, 1, 8, 128, 8192,
           "data=4 cp=2 m=32 remat=none bf16 flash", BF16_GRADS, 10153, "η", CP_NOTE, NEMO_2409),
    Anchor("NeMo 24.09 Llama-3.1-8B fp8", "NeMo", LLAMA31_8B, 1, 8, 128, 8192,
           "data=4 cp=2 m=32 remat=none fp8 flash", BF16_GRADS, 13555, "fp8", CP_NOTE, NEMO_2409),
    Anchor("NeMo 24.07 Llama-2-7B fp8", "NeMo", LLAMA2_7B, 1, 8, 128, 4096,
           "data=8 m=16 remat=none fp8 flash", BF16_GRADS, 16847, "check", "", "2024-07 (NeMo 24.07)"),
    Anchor("torchtitan Llama-3.1-8B FSDP eager", "torchtitan eager", LLAMA31_8B, 1, 8, 16, 8192,
           "fsdp=8 m=1 remat=dots bf16 flash", "jaxpar", 5762, "η", "500 W H100s; selective AC as remat=dots"),
    Anchor("torchtitan Llama-3.1-8B FSDP compiled", "torchtitan compile", LLAMA31_8B, 1, 8, 16, 8192,
           "fsdp=8 m=1 remat=dots bf16 flash", "jaxpar", 6667, "η", "500 W H100s; selective AC as remat=dots"),
)

# Recipes people copy, written with `--strategy`'s words for sequence and context parallelism and the distributed
# optimizer: checks.
LLAMA31_70B = ModelShape.dense(vocab=128256, d_model=8192, layers=80, heads=64, kv_heads=8, head_dim=128, mlp_dim=28672)
ANCHORS = ANCHORS + (
    Anchor("torchtitan Llama-3.1-70B FSDP x TP+SP compiled", "torchtitan compile", LLAMA31_70B, 32, 8, 512, 8192,
           "fsdp=32 tp=8 sp m=1 remat=full bf16 flash", "jaxpar", 597, "check",
           "500 W 96 GB H100s, planned as 80 GB SXM; local batch 16 per fsdp rank; overlap measured: the 7B's "
           "fsdp x tensor schedule (XLA's sharding, without SP: the closest recorded) on 64 H100s (lab 05)"),
    # async TP is collective matmul on the hand-written tensor axis: only a compiled schedule says how much of
    # that axis it hides (the assumed overlap hides no tensor collective): the measured table's figure
    Anchor("torchtitan Llama-3.1-70B FSDP x TP+SP async TP compiled", "torchtitan compile", LLAMA31_70B, 32, 8,
           512, 8192, "fsdp=32 tp=8 sp async-tp m=1 remat=full bf16 flash", "jaxpar", 652, "check",
           "500 W 96 GB H100s, planned as 80 GB SXM; local batch 16 per fsdp rank; overlap measured: the 7B's "
           "fsdp x tp+sp + collective matmul schedule on 64 H100s (lab 05)"),
    Anchor("NeMo 24.09 Llama-3.1-8B bf16, 128 GPUs", "NeMo", LLAMA31_8B, 16, 8, 2048, 8192,
           "data=64 cp=2 m=32 remat=none bf16 flash dist-opt=bf16-grads", BF16_GRADS, 10006, "check", CP_NOTE,
           NEMO_2409),
)

# η (of an ideal large GEMM, plan/gemm.py) and the fp8 factor per framework, as `fit_framework` finds them with
# GPU_CALIBRATION (tests/test_plan_model.py re-fits and compares). jaxpar's own fp8 factor is NeMo's: no published
# XLA fp8 run here.
FITTED = {
    "jaxpar (XLA)": {"compute": 0.6973, "fp8": 0.0},
    "NeMo": {"compute": 0.6619, "fp8": 0.7286},
    "torchtitan eager": {"compute": 0.3685, "fp8": 0.0},
    "torchtitan compile": {"compute": 0.4296, "fp8": 0.0},
}
FITTED_ON = "2026-12-02"
# `jaxpar plan --framework`: whose η predicts. jaxpar has no published GPU run: it borrows MaxText's (both XLA).
# NeMo trains LLMs with Megatron-Core, so a Megatron-Core recipe is predicted with NeMo's η.
FRAMEWORKS = {"jaxpar": "jaxpar (XLA)", "maxtext": "jaxpar (XLA)", "nemo": "NeMo", "megatron": "NeMo",
              "torchtitan": "torchtitan compile"}
# Whose kernels' kept activations the memory counts (plan/framework_memory.py); the others: XLA's (jaxpar's own).
ACTIVATIONS = {"NeMo": "Megatron-Core"}


def calibration(framework: str, base: Calibration = GPU_CALIBRATION) -> Calibration:
    """`base` (default: what `jaxpar plan` predicts with, the one the η is fitted with) with the framework's fitted η
    and fp8 factor."""
    values = FITTED[framework]
    return dataclasses.replace(base, compute=values["compute"],
                               fp8=values["fp8"] or FITTED["NeMo"]["fp8"],
                               activations=ACTIVATIONS.get(framework, "jaxpar"),
                               source=f"η fitted on {framework}'s published H100 runs (jaxpar/plan/anchors.py)")


def fitted_on(framework: str) -> tuple[Anchor, ...]:
    """The anchors the framework's calibration was fitted on: its η anchor, and the fp8 anchor whose factor it uses."""
    fp8_owner = framework if FITTED[framework]["fp8"] else "NeMo"
    return tuple(a for a in ANCHORS if (a.framework == framework and a.role == "η")
                 or (a.framework == fp8_owner and a.role == "fp8"))


@functools.cache
def leave_one_out(framework: str) -> tuple[tuple[str, float], ...]:
    """(anchor, predicted / published) for every anchor the framework's η was NOT fitted on, predicted with it."""
    calib, fitted = calibration(framework), fitted_on(framework)
    return tuple((a.name, predicted_over_published(a, calib)) for a in ANCHORS if a not in fitted)


def spread(framework: str) -> tuple[float, float]:
    """(low, high) factors on a predicted step time from `leave_one_out` (a run the η over-predicts by r takes r
    times the predicted step); 1 is always inside. Tokens/s and days scale the other way."""
    ratios = [r for _, r in leave_one_out(framework)]
    return min([1.0, *ratios]), max([1.0, *ratios])


def describe(framework: str) -> list[str]:
    """Lines for `jaxpar plan`: the η in use, what it is fitted on and when, and its leave-one-out range."""
    name = FRAMEWORKS.get(framework, framework)
    eta_anchor = next(a for a in ANCHORS if a.framework == name and a.role == "η")
    fp8 = next(a for a in fitted_on(name) if a.role == "fp8")
    low, high = spread(name)
    loo = ", ".join(f"{anchor} {r:.2f}" for anchor, r in leave_one_out(name))
    borrowed = " (no published jaxpar GPU run: MaxText's XLA run stands in)" if framework == "jaxpar" else ""
    return [f"Efficiency: {framework}: η = {FITTED[name]['compute']:.4f} fitted {FITTED_ON} on {eta_anchor.name} "
            f"(published: {eta_anchor.published_on}){borrowed}; fp8 factor {FITTED[fp8.framework]['fp8']:.4f} fitted "
            f"on {fp8.name} (published: {fp8.published_on}). Each fitted anchor reproduces its own figure (1.00, "
            "fitted): that is the fit, not a check.",
            f"Range: this η predicting the anchors it was not fitted on (leave-one-out, predicted / published): "
            f"{loo}. So each step time below is given with x{low:.2f}-x{high:.2f} of it (tokens/s and days the other "
            "way): a prediction, not a measurement."]


def evaluate_anchor(anchor: Anchor, calib: Calibration):
    """The planner's prediction of the anchor's own strategy (an `Evaluated`)."""
    from jaxpar.plan.planner import evaluate
    from jaxpar.plan.strategy import parse_strategy
    cand = parse_strategy(anchor.strategy, anchor.nodes * anchor.per_node)
    cluster = gpu_cluster("h100", anchor.nodes, anchor.per_node)
    return evaluate(anchor.shape, cand, cluster, anchor.global_batch, anchor.seq_len, 1e12, calibration=calib,
                    layout=anchor.layout)


def predicted_over_published(anchor: Anchor, calib: Calibration | None = None) -> float:
    calib = calib or calibration(anchor.framework)
    return evaluate_anchor(anchor, calib).tokens_per_s / (anchor.nodes * anchor.per_node) / anchor.published


def _bisect(ratio, low: float, high: float) -> float:
    """The x in [low, high] at which ratio(x) = 1 (ratio grows with x)."""
    for _ in range(40):
        mid = (low + high) / 2
        low, high = (mid, high) if ratio(mid) < 1 else (low, mid)
    return (low + high) / 2


def fit_framework(framework: str) -> dict[str, float]:
    """η on the framework's "η" anchor, then the fp8 factor on its "fp8" anchor (0 when it has none), each with
    the calibration `jaxpar plan` predicts with (GPU_CALIBRATION, measured overlap included)."""
    own = [a for a in ANCHORS if a.framework == framework]
    eta_anchor = next(a for a in own if a.role == "η")

    def fitting(**values) -> Calibration:
        return dataclasses.replace(GPU_CALIBRATION, activations=ACTIVATIONS.get(framework, "jaxpar"), **values)
    eta = _bisect(lambda x: predicted_over_published(eta_anchor, fitting(compute=x)), 0.05, 1.0)
    fp8_anchor = next((a for a in own if a.role == "fp8"), None)
    fp8 = (_bisect(lambda x: predicted_over_published(fp8_anchor, fitting(compute=eta, fp8=x)), 0.05, 1.0)
           if fp8_anchor else 0.0)
    return {"compute": round(eta, 4), "fp8": round(fp8, 4)}


def anchor_table() -> list[dict]:
    """Every anchor: its framework's η, the prediction of its own strategy, and predicted / published."""
    rows = []
    for a in ANCHORS:
        calib = calibration(a.framework)
        r = evaluate_anchor(a, calib)
        per_gpu = r.tokens_per_s / (a.nodes * a.per_node)
        rows.append({"anchor": a.name, "framework": a.framework, "role": a.role, "eta": calib.compute,
                     "fitted": a in fitted_on(a.framework), "published_on": a.published_on,
                     "fp8": calib.fp8, "strategy": a.strategy, "layout": a.layout,
                     "cluster": f"{a.nodes} x {a.per_node}", "batch": f"{a.global_batch} x {a.seq_len}",
                     "published": a.published, "predicted": per_gpu, "ratio": per_gpu / a.published,
                     "mfu": r.mfu, "fits": r.memory.fits, "memory_gb": r.memory.total / 1e9, "note": a.note})
    return rows
