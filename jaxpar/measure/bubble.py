"""The pipeline bubble in theory: the fraction of a schedule's stage-time that is idle.

Definition (the one `parallel.schedules.Schedule.bubble` measures on a table): with p
stages, every action (a forward F, a backward B, a weight-gradient W) taking one tick
and every stage waiting for what it needs, bubble = idle (stage, tick) cells / all
cells. With t_F = t_B (and t_W = t_B for the zero-bubble split):

  GPipe, 1F1B        (p-1) / (m + p - 1)          same bubble; 1F1B only bounds the memory
  interleaved 1F1B   (p-1) / (v*m + p - 1)        v chunks per stage, each 1/v of a stage's work
  ZB-H1              (p-1) / (3m + p - 1)         B and W split; W fills 1F1B's bubbles

For the interleaved schedule a tick is a chunk's work (1/v of a stage's), so its table
counts v*m microbatch-chunks per stage. The circular (compiler-driven) pipeline runs
v*m + p - 1 scan iterations of which v*m do useful work per stage, the same fraction as
the interleaved schedule, in forward and again in backward.
"""
from __future__ import annotations

from fractions import Fraction


def bubble_fraction(schedule: str, p: int, m: int, v: int = 1) -> Fraction:
    """The textbook bubble fraction of a schedule with p stages, m microbatches, v chunks per stage."""
    if schedule in ("gpipe", "1f1b"):
        return Fraction(p - 1, m + p - 1)
    if schedule in ("interleaved", "circular"):
        return Fraction(p - 1, v * m + p - 1)
    if schedule == "zb-h1":
        return Fraction(p - 1, 3 * m + p - 1)
    raise ValueError(f"no bubble formula for schedule '{schedule}'")


def p2p_bytes(model_stages: int, m: int, micro_batch: int, seq_len: int, d_model: int,
              bytes_per_element: float) -> float:
    """Bytes all stages send per step: each microbatch's activation crosses K-1 stage boundaries forward and
    its gradient K-1 backward: 2 (K-1) m b s h e, K = p model stages (p·v when interleaved)."""
    return 2 * (model_stages - 1) * m * micro_batch * seq_len * d_model * bytes_per_element
