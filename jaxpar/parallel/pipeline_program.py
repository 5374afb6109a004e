"""A pipeline schedule compiled into integer tables: what each stage runs at each tick, on which microbatch and
chunk, and which buffer slot it reads and writes (the executor, pipeline_executor.py, runs these tables).

Split out of pipeline.py so that the table logic (pure numpy, no JAX) stands on its own: the planner's
predictions, the measured timelines and the lab read the same tables.
"""
from __future__ import annotations

import dataclasses
import functools

import numpy as np

from jaxpar.parallel.schedules import Schedule, build, run_orders

# a table cell: F and B on the first / a middle / the last model stage differ in what they do around the chunk
IDLE, F_FIRST, F_MID, F_LAST, B_FIRST, B_MID, W = range(7)


def forward_only(schedule: Schedule) -> Schedule:
    """The forwards of a schedule, in each stage's order, run as early as they can (evaluation)."""
    orders = [[row[s] for row in schedule.grid if row[s] is not None and row[s].kind == "F"]
              for s in range(schedule.stages)]
    return dataclasses.replace(schedule, name=f"{schedule.name} forward", split_backward=False,
                               grid=run_orders(orders, schedule.virtual, False, schedule.shape))


# ============================================================================ table -> program

class _Slots:
    """The slots of one stage's buffer: a new item takes the lowest free slot; `size` is the most used."""

    def __init__(self) -> None:
        self.held: dict = {}
        self.size = 0

    def take(self, key) -> int:
        used = set(self.held.values())
        slot = next(i for i in range(len(used) + 1) if i not in used)
        self.held[key] = slot
        self.size = max(self.size, slot + 1)
        return slot

    def free(self, key) -> int:
        return self.held.pop(key)


@dataclasses.dataclass(frozen=True)
class Program:
    """A schedule as integer tables [ticks, stages], and the buffer sizes its slots need.

    branch, microbatch, chunk: what the stage runs. act / grad: the slot of the activation
    F reads / the gradient B reads (F on the last model stage writes its dy there). stash:
    where F keeps its residuals and B finds them; wstash: where B keeps the taps for W.
    <route>_act_in / <route>_grad_in: the slot an activation / gradient arriving by that route is
    filed into (the extra last slot of the buffer takes what arrives when nothing was sent).
    Routes: `down` (from stage s-1: activations, and DualPipeV's chunk-1 gradients), `up` (from
    s+1: gradients, and DualPipeV's chunk-1 activations), `local` (the V's bottom hands its
    chunk 0 to its own chunk 1). flip: this cell's send travels against the usual direction.
    """

    schedule: Schedule
    table: dict
    slots: dict
    sends: dict = dataclasses.field(default_factory=dict)

    @property
    def ticks(self) -> int:
        return self.schedule.ticks


ROUTES = ("down", "up", "local")
ARRIVALS = tuple(f"{route}_{buffer}_in" for route in ROUTES for buffer in ("act", "grad"))
FIELDS = ("branch", "microbatch", "chunk", "act", "grad", "stash", "wstash", "flip", *ARRIVALS)


def _route(schedule: Schedule, buffer: str, sender: int, receiver: int, flip: bool) -> str:
    """How a send reaches `receiver`: activations go down the stages and gradients up, reversed on the V's
    way back (flip); a stage sending to itself keeps it (the V's bottom)."""
    if sender == receiver and schedule.shape == "v":
        return "local"
    return ("down" if buffer == "act" else "up") if not flip else ("up" if buffer == "act" else "down")


def compile_program(schedule: Schedule) -> Program:
    p, K, T = schedule.stages, schedule.model_stages, schedule.ticks
    table = {f: np.zeros((T, p), np.int32) for f in FIELDS}
    for field in ARRIVALS:
        table[field][:] = -1
    pools = [{b: _Slots() for b in ("act", "grad", "stash", "wstash")} for _ in range(p)]
    pairs: list[dict[str, set]] = [{"down": set(), "up": set()} for _ in range(T)]
    for t, row in enumerate(schedule.grid):
        arrivals = []
        for s, action in enumerate(row):
            if action is None:
                continue
            k, key, pool = schedule.model_stage(s, action.chunk), (action.microbatch, action.chunk), pools[s]
            table["microbatch"][t, s], table["chunk"][t, s] = action.microbatch, action.chunk
            flip = schedule.shape == "v" and action.chunk == 1
            table["flip"][t, s] = flip
            if action.kind == "F":
                table["branch"][t, s] = F_FIRST if k == 0 else F_LAST if k == K - 1 else F_MID
                if k > 0:
                    table["act"][t, s] = pool["act"].free(key)
                table["stash"][t, s] = pool["stash"].take(key)
                if k == K - 1:
                    table["grad"][t, s] = pool["grad"].take(key)
                else:
                    arrivals.append(("act", s, schedule.placement(k + 1), action.microbatch, flip))
            elif action.kind == "B":
                table["branch"][t, s] = B_FIRST if k == 0 else B_MID
                table["grad"][t, s] = pool["grad"].free(key)
                table["stash"][t, s] = pool["stash"].free(key)
                if schedule.split_backward:
                    table["wstash"][t, s] = pool["wstash"].take(key)
                if k > 0:
                    arrivals.append(("grad", s, schedule.placement(k - 1), action.microbatch, flip))
            else:
                table["branch"][t, s] = W
                table["wstash"][t, s] = pool["wstash"].free(key)
        for buffer, sender, (s, chunk), microbatch, flip in arrivals:
            route = _route(schedule, buffer, sender, s, flip)
            table[f"{route}_{buffer}_in"][t, s] = pools[s][buffer].take((microbatch, chunk))
            if route != "local":
                pairs[t][route].add((sender, s))
    slots = {b: max(pool[b].size for pool in pools) for b in ("act", "grad", "stash", "wstash")}
    for field in ARRIVALS:
        table[field][table[field] < 0] = slots[field.split("_")[1]]     # nothing sent: the spare slot
    sends = {}
    for route in ("down", "up"):
        used = sorted({tuple(sorted(tick[route])) for tick in pairs if tick[route]})
        sends[route] = ((), *used)
        table[f"send_{route}"] = np.repeat(np.array([sends[route].index(tuple(sorted(tick[route])))
                                                     for tick in pairs], np.int32)[:, None], p, axis=1)
    return Program(schedule, table, slots, sends)


PARTS = {"F": (F_FIRST, F_MID, F_LAST), "embed": (F_FIRST,), "head": (F_LAST,), "B": (B_FIRST, B_MID),
         "embed_grad": (B_FIRST,), "W": (W,)}


def part_ticks(program: Program) -> dict[str, np.ndarray]:
    """Per part of a tick (PARTS): on how many ticks each stage runs it; per send `send_<route>_<k>` (the k-th
    set of pairs of `Program.sends`): on how many ticks each stage sends in it."""
    out = {part: np.isin(program.table["branch"], codes).sum(axis=0) for part, codes in PARTS.items()}
    p = program.schedule.stages
    for route, patterns in program.sends.items():
        for k, pairs in enumerate(patterns[1:], start=1):
            senders = np.isin(np.arange(p), [s for s, _ in pairs])
            out[f"send_{route}_{k}"] = (program.table[f"send_{route}"][:, 0] == k).sum() * senders
    return out


def sends_per_stage(program: Program) -> np.ndarray:
    """How many activations and gradients each stage sends per run of the program (the `local` hand-over of the
    V's bottom is not a send)."""
    ticks = part_ticks(program)
    return sum((ticks[f"send_{route}_{k}"] for route, patterns in program.sends.items()
                for k in range(1, len(patterns))), np.zeros(program.schedule.stages, np.int64))


@functools.lru_cache(maxsize=256)
def program_for(name: str, p: int, m: int, v: int) -> Program:
    """The compiled table of a schedule (cached: the planner asks for the same few many times)."""
    return compile_program(build(name, p, m, v))


@functools.lru_cache(maxsize=256)
def ticks_for(name: str, p: int, m: int, v: int) -> dict[str, np.ndarray]:
    """`part_ticks` of `program_for` (cached as it is: the planner predicts thousands of candidates)."""
    return part_ticks(program_for(name, p, m, v))


@functools.lru_cache(maxsize=256)
def most_sends_for(name: str, p: int, m: int, v: int) -> int:
    """The most activations and gradients one stage sends in `program_for`'s table (`sends_per_stage`)."""
    return int(sends_per_stage(program_for(name, p, m, v)).max())
