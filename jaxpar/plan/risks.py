"""Risks of a months-long run: failures per day, the checkpoint interval (Young/Daly), expected goodput.

  failures/day  = GPUs x a per-GPU failure rate; MTBF M = 1 / failures per second.
  Young (1974)  τ = sqrt(2·δ·M), δ = the time a checkpoint blocks training.
  Daly (2006)   τ = sqrt(2·δ·M)·(1 + sqrt(δ/(2M))/3 + δ/(18M)) - δ   (for δ < 2M), a higher-order correction.
  goodput       1 - δ/τ - (τ/2 + R)/M to first order: every interval pays δ to save, and every
                failure (one per M on average) loses half an interval of work and a restart R.

The per-GPU failure rate is an ANCHOR, not a measurement: Meta's Llama 3 report counts 419
unexpected interruptions in 54 days of pre-training on 16,384 H100s (Dubey et al. 2024),
4.7e-4 per GPU-day. δ and R come from what the caller measured (module 6's lab: the
blocking part of a checkpoint save, start-up + compile after a restart) or from stated
assumptions, scaled to the model's state.
"""
from __future__ import annotations

import dataclasses
import math

LLAMA3_INTERRUPTIONS, LLAMA3_DAYS, LLAMA3_GPUS = 419, 54, 16384
FAILURES_PER_GPU_DAY = LLAMA3_INTERRUPTIONS / (LLAMA3_DAYS * LLAMA3_GPUS)
DAY = 86400.0


@dataclasses.dataclass(frozen=True)
class Risk:
    gpus: int
    failures_per_day: float
    mtbf_s: float
    checkpoint_s: float           # δ
    restart_s: float              # R
    young_s: float
    daly_s: float
    goodput: float                # at the Daly interval
    run_days: float               # training time at 100% goodput
    wall_days: float              # run_days / goodput
    expected_failures: float


def young_interval(delta: float, mtbf: float) -> float:
    return math.sqrt(2 * delta * mtbf)


def daly_interval(delta: float, mtbf: float) -> float:
    if delta >= 2 * mtbf:
        return mtbf
    return math.sqrt(2 * delta * mtbf) * (1 + math.sqrt(delta / (2 * mtbf)) / 3 + delta / (18 * mtbf)) - delta


def goodput(interval: float, delta: float, restart: float, mtbf: float) -> float:
    return max(0.0, 1 - delta / interval - (interval / 2 + restart) / mtbf)


def assess(gpus: int, run_days: float, checkpoint_s: float, restart_s: float,
           failures_per_gpu_day: float = FAILURES_PER_GPU_DAY) -> Risk:
    per_day = gpus * failures_per_gpu_day
    mtbf = DAY / per_day
    young, daly = young_interval(checkpoint_s, mtbf), daly_interval(checkpoint_s, mtbf)
    g = goodput(daly, checkpoint_s, restart_s, mtbf)
    wall = run_days / g if g else math.inf
    return Risk(gpus, per_day, mtbf, checkpoint_s, restart_s, young, daly, g, run_days, wall, wall * per_day)
