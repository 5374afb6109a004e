"""Pipeline schedules as data: a table of ticks x stages, each cell F, B, W or idle.

A schedule is built the way torch.distributed.pipelining writes one: each stage (a
device on the `pipe` axis) gets an ordered list of actions, and a lock-step run of
those lists gives the table. At every tick each stage runs its next action if what
it needs was produced at an earlier tick (an activation or gradient sent at tick t
arrives at tick t+1), else it idles. Every action takes one tick.

  F(i, c)  forward of microbatch i through the stage's chunk c
  B(i, c)  backward: the input gradient (and, unless the schedule splits the backward,
           the weight gradient too)
  W(i, c)  zero-bubble only: the weight gradient of a B done earlier

Stage s holds chunks c = 0..v-1; chunk c of stage s is model stage c*p + s (Megatron's
interleaved assignment, `shape` "loop"; v = 1 is the plain pipeline), or under DualPipeV's
`shape` "v" (v = 2) chunk 0 is model stage s and chunk 1 model stage 2p-1-s: the microbatch
goes down the stages and back up, so stage 0 holds the first and the last model stage. `validate` checks a table before
anything compiles: every action present exactly once on the stage that holds it, every
dependency met at an earlier tick, and at most `in_flight_bound` chunk-microbatches
alive on any stage (an F done whose B, or W when split, is not).

`bubble_fraction` is the textbook idle fraction each table's `Schedule.bubble` measures (p stages, m
microbatches, v chunks per stage): GPipe and 1F1B (p-1)/(m+p-1), interleaved and circular (p-1)/(v·m+p-1),
ZB-H1 and DualPipeV (p-1)/(3m+p-1) (DualPipeV: 2p model stages in a V, F&B blocks: a tick table runs no
two actions at once, so F&B = 3 ticks, B = 2, W = 1, and DeepSeek's published idle (PP/2-1)(F&B+B-3W),
`dualpipe_idle`, is (p-1)·2 ticks per stage of 6m + 2(p-1)); PipeDream-2BW runs 1F1B's table; no
pipeline (p = 1), none.
"""
from __future__ import annotations

import dataclasses
from collections import Counter, deque
from fractions import Fraction
from typing import NamedTuple

NAMES = ("gpipe", "1f1b", "interleaved", "zb-h1", "dualpipev", "pipedream-2bw")
SHAPES = ("loop", "v")


def chunks_per_stage(name: str, virtual: int = 0) -> int:
    """v: `virtual` (parallel.pipe_virtual), 0 meaning the schedule's own: 2 for interleaved (Megatron's
    smallest v) and DualPipeV (its V), 1 for the others."""
    return virtual or (2 if name in ("interleaved", "dualpipev") else 1)


def pipeline_microbatches(p: int, microbatches: int = 0) -> int:
    """m: `microbatches` (parallel.pipe_microbatches), 0 meaning 2 x p, enough for every schedule's warm-up."""
    return microbatches or 2 * p


class Action(NamedTuple):
    kind: str          # "F", "B" or "W"
    microbatch: int
    chunk: int = 0

    def __str__(self):
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")


class ScheduleError(ValueError):
    """A table that breaks a dependency, misses an action or exceeds its in-flight bound."""


@dataclasses.dataclass(frozen=True)
class Schedule:
    name: str
    stages: int                    # p
    microbatches: int              # m
    virtual: int                   # v: chunks per stage
    split_backward: bool           # B is the input gradient only, W the weight gradient
    in_flight_bound: int           # claimed: chunk-microbatches alive per stage, at most
    grid: tuple                    # grid[tick][stage] -> Action | None
    shape: str = "loop"            # chunk placement: "loop" (c*p + s) or "v" (DualPipeV)

    @property
    def ticks(self) -> int:
        return len(self.grid)

    @property
    def model_stages(self) -> int:
        return self.stages * self.virtual

    def model_stage(self, stage: int, chunk: int) -> int:
        return model_stage(stage, chunk, self.stages, self.shape)

    def placement(self, k: int) -> tuple[int, int]:
        """Model stage k -> (stage, chunk) that holds it."""
        return placement(k, self.stages, self.shape)

    def idle_ticks(self) -> list[int]:
        """Per stage: the ticks it idles (the bubble in units of one action)."""
        return [sum(row[s] is None for row in self.grid) for s in range(self.stages)]

    def bubble(self) -> Fraction:
        """Idle cells / all cells of the table (every action one tick)."""
        idle = sum(cell is None for row in self.grid for cell in row)
        return Fraction(idle, self.ticks * self.stages)

    def in_flight(self) -> list[int]:
        """Per stage: the most chunk-microbatches alive at once (F done, last backward action not yet)."""
        last = "W" if self.split_backward else "B"
        peaks = []
        for s in range(self.stages):
            alive = peak = 0
            for row in self.grid:
                cell = row[s]
                if cell is not None:
                    alive += (cell.kind == "F") - (cell.kind == last)
                    peak = max(peak, alive)
            peaks.append(peak)
        return peaks

    def picture(self) -> str:
        """The familiar schedule picture as text: one line per stage, one column per tick."""
        width = max(len(str(c)) for row in self.grid for c in row if c is not None)
        lines = []
        for s in range(self.stages):
            cells = [(str(row[s]) if row[s] is not None else ".").ljust(width) for row in self.grid]
            lines.append(f"stage {s}: " + " ".join(cells))
        return "\n".join(lines)


# ============================================================================ running per-stage orders

def model_stage(stage: int, chunk: int, p: int, shape: str = "loop") -> int:
    """The model stage chunk `chunk` of stage `stage` holds."""
    if shape == "v":
        return stage if chunk == 0 else 2 * p - 1 - stage
    return chunk * p + stage


def placement(k: int, p: int, shape: str = "loop") -> tuple[int, int]:
    """Model stage k -> (stage, chunk)."""
    if shape == "v":
        return (k, 0) if k < p else (2 * p - 1 - k, 1)
    return k % p, k // p


def _needs(action: Action, stage: int, p: int, v: int, split: bool, shape: str = "loop") -> list[tuple[Action, int]]:
    """(action, stage) pairs that must be done at an earlier tick before `action` runs on `stage`."""
    k = model_stage(stage, action.chunk, p, shape)
    i = action.microbatch
    where = lambda k: placement(k, p, shape)
    if action.kind == "F":
        if k == 0:
            return []
        s, c = where(k - 1)
        return [(Action("F", i, c), s)]
    if action.kind == "B":
        out = [(Action("F", i, action.chunk), stage)]
        if k < p * v - 1:
            s, c = where(k + 1)
            out.append((Action("B", i, c), s))
        return out
    return [(Action("B", i, action.chunk), stage)]   # W after its own B


def run_orders(orders: list[list], v: int, split: bool, shape: str = "loop") -> tuple:
    """Lock-step list scheduling: each stage runs its next action as soon as its inputs exist.

    An item of an order may be a tuple of actions, a block (DualPipe's overlapped F&B): it runs on
    consecutive ticks, starts only when the inputs of all its actions are there, and what it produces
    counts as sent when the whole block is done (the pair's sends overlap the pair's compute)."""
    p = len(orders)
    items = [[(item,) if isinstance(item, Action) else tuple(item) for item in order] for order in orders]
    done: dict[tuple[Action, int], int] = {}
    position, inside = [0] * p, [0] * p            # the current item, and how far into it the stage is
    grid: list[tuple] = []
    total = sum(len(item) for order in items for item in order)
    while any(position[s] < len(items[s]) for s in range(p)):
        tick = len(grid)
        row = []
        for s in range(p):
            block = items[s][position[s]] if position[s] < len(items[s]) else ()
            ready = inside[s] > 0 or all(done.get(need, tick) < tick for action in block
                                         for need in _needs(action, s, p, v, split, shape)
                                         if need[1] != s or need[0] not in block)
            row.append(block[inside[s]] if block and ready else None)
        for s, action in enumerate(row):
            if action is not None:
                inside[s] += 1
                block = items[s][position[s]]
                if inside[s] == len(block):            # a block's results leave when it is done
                    done.update({(member, s): tick for member in block})
                    position[s], inside[s] = position[s] + 1, 0
        grid.append(tuple(row))
        if tick > 4 * total + 4 * p:
            raise ScheduleError("per-stage orders deadlock: some action waits for one that never runs")
    return tuple(grid)


# ============================================================================ the schedules

def gpipe(p: int, m: int) -> Schedule:
    """GPipe (Huang et al. 2019): every forward, then every backward; all m microbatches stay alive."""
    orders = [[Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)] for _ in range(p)]
    return Schedule("gpipe", p, m, 1, False, m, run_orders(orders, 1, False))


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B / PipeDream-Flush (Narayanan et al. 2019): stage s runs p-s-1 warm-up forwards, then
    alternates one forward and one backward, then drains; stage 0 holds at most p microbatches."""
    orders = []
    for s in range(p):
        warm = min(p - s - 1, m)
        order = [Action("F", i) for i in range(warm)]
        for i in range(m - warm):
            order += [Action("F", warm + i), Action("B", i)]
        order += [Action("B", i) for i in range(m - warm, m)]
        orders.append(order)
    return Schedule("1f1b", p, m, 1, False, p, run_orders(orders, 1, False))


def interleaved(p: int, v: int, m: int) -> Schedule:
    """Interleaved 1F1B (Narayanan et al. 2021, Megatron's virtual stages): each stage holds v chunks,
    so a microbatch loops over the stages v times. Forwards go in groups of p microbatches per chunk
    (chunk 0 for microbatches 0..p-1, chunk 1 for the same ones, ...), backwards mirror them with the
    chunks reversed; stage s warms up with 2(p-s-1) + (v-1)p forwards. Needs m divisible by p."""
    def forward(k):   # the k-th forward on a stage -> (microbatch, chunk)
        group, within = divmod(k, p * v)
        return group * p + within % p, within // p

    total = m * v
    orders = []
    for s in range(p):
        warm = min(2 * (p - s - 1) + (v - 1) * p, total)
        fwd = [Action("F", *forward(k)) for k in range(total)]
        bwd = [Action("B", i, v - 1 - c) for i, c in (forward(k) for k in range(total))]
        order = fwd[:warm]
        for k in range(total - warm):
            order += [fwd[warm + k], bwd[k]]
        order += bwd[total - warm:]
        orders.append(order)
    bound = v * p + p - 1   # stage 0: warm-up 2(p-1) + (v-1)p, plus the one in flight
    return Schedule("interleaved", p, m, v, False, bound, run_orders(orders, v, False))


def zb_h1(p: int, m: int) -> Schedule:
    """ZB-H1 (Qi et al. 2024, zero bubble with 1F1B's memory): the backward is split into B (input
    gradient, on the critical path) and W (weight gradient, needed by nobody else). Stage s runs p-s
    warm-up forwards, then B, W, F in turn with its W's running s microbatches late, then drains the
    last s W's: the downstream stages hurry their B's and the W's fill what were 1F1B's bubbles.
    At most p microbatches alive per stage (a microbatch is alive until its W)."""
    orders = []
    for s in range(p):
        warm = min(p - s, m)
        order = [Action("F", i) for i in range(warm)]
        for i in range(m):
            order.append(Action("B", i))
            if i >= s:
                order.append(Action("W", i - s))
            if warm + i < m:
                order.append(Action("F", warm + i))
        order += [Action("W", i) for i in range(max(m - s, 0), m)]
        orders.append(order)
    return Schedule("zb-h1", p, m, 1, True, p, run_orders(orders, 1, True))


def dualpipev(p: int, m: int, blocks: bool = True) -> Schedule:
    """DualPipeV (DeepSeek-V3's DualPipe cut in half, as in deepseek-ai/DualPipe and torchtitan's
    ScheduleDualPipeV): 2p model stages in a V over p stages, chunk 0 going down, chunk 1 coming back.
    Stage r warms up with 2(p-r-1) forwards of chunk 0, then r+1 pairs F0 F1, then p-r-1 rounds of
    zero-bubble I1 W F1; the steady state alternates "F0 & B1" and "F1 & B0" (a forward of one chunk
    overlapped with a full backward of the other in DualPipe; here one after the other: F, B, W);
    the drain splits the backward (B now, W later) to fill the bubbles. Needs m >= 2p.
    A full backward is B then W at once; a split one queues its W for the next free slot.
    `blocks=False` (lab only) runs the same orders with each action sending as soon as it is done."""
    if m < 2 * p:
        raise ScheduleError(f"dualpipev needs at least 2p = {2 * p} microbatches, got {m}")
    orders = []
    for r in range(p):
        count: Counter = Counter()
        pending: deque = deque()
        order = []

        def run(kind, chunk):
            i = count[kind, chunk]
            count[kind, chunk] += 1
            order.append(Action(kind, i, chunk))
            return i

        def backward(chunk, full=True):
            i = run("B", chunk)
            if full:
                order.append(Action("W", i, chunk))
            else:
                pending.append(Action("W", i, chunk))

        def weight():
            if pending:
                order.append(pending.popleft())

        def f_and_b(forward_chunk, backward_chunk):      # DualPipe's overlapped pair: one block
            start = len(order)
            run("F", forward_chunk)
            backward(backward_chunk)
            if blocks:
                order[start:] = [tuple(order[start:])]

        for _ in range(2 * (p - r - 1)):
            run("F", 0)
        for _ in range(r + 1):
            run("F", 0), run("F", 1)
        for _ in range(p - r - 1):
            backward(1, full=False), weight(), run("F", 1)
        for i in range(m - 2 * p + r + 1):
            if i == 0 and r == p - 1:      # the bottom of the V: not overlapped, to shorten the bubble
                run("F", 0), backward(1)
            else:
                f_and_b(0, 1)
            f_and_b(1, 0)
        for _ in range(p - r - 1):
            backward(1), f_and_b(1, 0)
        split = False
        for i in range(r + 1):        # the second half of the last backwards is split
            split = split or (i == (r + 1) // 2 and r % 2 == 1)
            backward(1, full=not split)
            split = split or (i == (r + 1) // 2 and r % 2 == 0)
            backward(0, full=not split)
        for _ in range(p - r - 1):
            weight(), backward(0, full=not split)
        while pending:
            weight()
        orders.append(order)
    bound = 2 * p + 1     # the published activation memory: PP + 1 chunks with PP = 2p model stages
    return Schedule("dualpipev", p, m, 2, True, bound, run_orders(orders, 2, True, "v"), "v")


def build(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """The named schedule for p stages, m microbatches (v chunks per stage for `interleaved`; dualpipev has 2)."""
    if name == "gpipe":
        return gpipe(p, m)
    if name == "1f1b":
        return one_f_one_b(p, m)
    if name == "interleaved":
        return interleaved(p, v, m)
    if name == "zb-h1":
        return zb_h1(p, m)
    if name == "dualpipev":
        return dualpipev(p, m)
    if name == "pipedream-2bw":      # 1F1B's table per step; the staleness is the optimizer's (parallel/pipedream.py)
        return dataclasses.replace(one_f_one_b(p, m), name="pipedream-2bw")
    raise ScheduleError(f"unknown schedule '{name}'; valid: {', '.join(NAMES)}")


# ============================================================================ validation

def validate(schedule: Schedule) -> None:
    """Raise ScheduleError unless every action runs once, after what it needs, within the bound."""
    p, v, m, split = schedule.stages, schedule.virtual, schedule.microbatches, schedule.split_backward
    kinds = ("F", "B", "W") if split else ("F", "B")
    when: dict[tuple[Action, int], int] = {}
    for tick, row in enumerate(schedule.grid):
        if len(row) != p:
            raise ScheduleError(f"tick {tick} has {len(row)} cells for {p} stages")
        for s, action in enumerate(row):
            if action is None:
                continue
            if action.kind not in kinds or not (0 <= action.microbatch < m and 0 <= action.chunk < v):
                raise ScheduleError(f"tick {tick} stage {s}: {action} is not an action of this schedule")
            if (action, s) in when:
                raise ScheduleError(f"{action} runs twice on stage {s} (ticks {when[(action, s)]} and {tick})")
            when[(action, s)] = tick
    for s in range(p):
        for c in range(v):
            for i in range(m):
                for kind in kinds:
                    if (Action(kind, i, c), s) not in when:
                        raise ScheduleError(f"{Action(kind, i, c)} never runs on stage {s}")
    for (action, s), tick in when.items():
        for need in _needs(action, s, p, v, split, schedule.shape):
            if when[need] >= tick:
                raise ScheduleError(f"{action} on stage {s} at tick {tick} needs {need[0]} of stage {need[1]}, "
                                    f"which runs at tick {when[need]}")
    peaks = schedule.in_flight()
    if max(peaks) > schedule.in_flight_bound:
        worst = peaks.index(max(peaks))
        raise ScheduleError(f"stage {worst} holds {max(peaks)} chunk-microbatches at once; "
                            f"{schedule.name} claims at most {schedule.in_flight_bound}")


# ============================================================================ theory

def bubble_fraction(schedule: str, p: int, m: int, v: int = 1) -> Fraction:
    """The textbook bubble fraction of a schedule with p stages, m microbatches, v chunks per stage (module doc)."""
    if p == 1:
        return Fraction(0)
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
