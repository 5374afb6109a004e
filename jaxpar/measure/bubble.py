"""The pipeline bubble in theory: the fraction of a schedule's stage-time that is idle.

Definition (the one `parallel.schedules.Schedule.bubble` measures on a table): with p
stages, every action (a forward F, a backward B, a weight-gradient W) taking one tick
and every stage waiting for what it needs, bubble = idle (stage, tick) cells / all
cells. With t_F = t_B (and t_W = t_B for the zero-bubble split):

  GPipe, 1F1B        (p-1) / (m + p - 1)          same bubble; 1F1B only bounds the memory
  interleaved 1F1B   (p-1) / (v*m + p - 1)        v chunks per stage, each 1/v of a stage's work
  ZB-H1              (p-1) / (3m + p - 1)         B and W split; W fills 1F1B's bubbles

  DualPipeV          (p-1) / (3m + p - 1)         2p model stages in a V; B and W split, F&B blocks

DualPipeV's published bubble (DeepSeek-V3 report, deepseek-ai/DualPipe) is (PP/2-1)(F&B+B-3W) idle
time per device, PP = 2p model stages, B a full backward, F&B an overlapped forward-and-backward
pair (`dualpipe_idle`). A tick table runs no two actions at once, so F&B = F + B = 3 ticks, B = 2,
W = 1: (p-1)·2 idle ticks per stage out of 6m + 2(p-1), the fraction above.

For the interleaved schedule a tick is a chunk's work (1/v of a stage's), so its table
counts v*m microbatch-chunks per stage. The circular (compiler-driven) pipeline runs
v*m + p - 1 scan iterations of which v*m do useful work per stage, the same fraction as
the interleaved schedule, in forward and again in backward.
"""
from __future__ import annotations

from fractions import Fraction


def bubble_fraction(schedule: str, p: int, m: int, v: int = 1) -> Fraction:
    """The textbook bubble fraction of a schedule with p stages, m microbatches, v chunks per stage."""
    if schedule in ("gpipe", "1f1b", "pipedream-2bw"):   # 2BW: 1F1B's table per step (parallel/pipedream.py)
        return Fraction(p - 1, m + p - 1)
    if schedule in ("interleaved", "circular"):
        return Fraction(p - 1, v * m + p - 1)
    if schedule in ("zb-h1", "dualpipev"):
        return Fraction(p - 1, 3 * m + p - 1)
    raise ValueError(f"no bubble formula for schedule '{schedule}'")


def dualpipe_idle(pp: int, f_and_b: float, b: float, w: float) -> float:
    """DualPipe's published bubble per device, (PP/2 - 1)(F&B + B - 3W), PP the model stages (2p for DualPipeV)."""
    return (pp / 2 - 1) * (f_and_b + b - 3 * w)


def p2p_bytes(model_stages: int, m: int, micro_batch: int, seq_len: int, d_model: int,
              bytes_per_element: float) -> float:
    """Bytes all stages send per step: each microbatch's activation crosses K-1 stage boundaries forward and
    its gradient K-1 backward: 2 (K-1) m b s h e, K = p model stages (p·v when interleaved)."""
    return 2 * (model_stages - 1) * m * micro_batch * seq_len * d_model * bytes_per_element
