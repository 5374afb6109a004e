"""The HLO module's structure: computations, their instructions, and how often each computation runs per step.

Split out of `hlo` (which finds the collectives): this part knows nothing about collectives, only how HLO text
nests computations (`while` bodies, calls, conditionals) and how many trips each loop makes; the FLOP count uses
it too.
"""
from __future__ import annotations

import dataclasses
import re
from collections import defaultdict
from collections.abc import Callable

_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s+(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_CALLEE_KEYS = re.compile(r"\b(calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)")
_CALLEE_LISTS = re.compile(r"\b(branch_computations|called_computations)=\{([^}]*)\}")


@dataclasses.dataclass
class _Instruction:
    name: str
    shape_text: str
    opcode: str
    line: str
    computation: str


def parse_module(hlo_text: str):
    """Split HLO text into computations of instructions; return (instructions, entry name)."""
    instructions, entry, current = [], None, None
    for line in hlo_text.splitlines():
        if not line.strip():
            continue
        if not line[0].isspace():
            m = _COMPUTATION.match(line)
            if m:
                current = m.group(2)
                if m.group(1):
                    entry = current
            continue
        m = _INSTRUCTION.match(line)
        if not m or current is None:
            continue
        rest = line[m.end():]
        if rest.startswith("("):
            end = matching_bracket(rest, 0)
            shape_text, rest = rest[:end], rest[end:]
        else:
            shape_text, _, rest = rest.partition(" ")
        op = re.match(r"\s*([\w\-]+)\(", rest)
        if op:
            instructions.append(_Instruction(m.group(1), shape_text, op.group(1), line, current))
    return instructions, entry


def trip_count(loop: _Instruction, by_computation) -> int | None:
    known = re.search(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"', loop.line)
    if known:
        return int(known.group(1))
    cond = re.search(r"\bcondition=%?([\w.\-]+)", loop.line)
    if cond:
        constants = [int(c) for ins in by_computation.get(cond.group(1), [])
                     if ins.opcode == "constant" and re.match(r"[su]\d+\[\]", ins.shape_text)
                     for c in re.findall(r"constant\((-?\d+)\)", ins.line)]
        if len(constants) == 1 and constants[0] >= 0:
            return constants[0]
    return None


def runs_per_computation(instructions, entry: str) -> Callable[[str], tuple[int, bool]]:
    """How many times each computation runs per execution of `entry`, and whether every trip count was known."""
    by_computation: defaultdict[str, list] = defaultdict(list)
    for ins in instructions:
        by_computation[ins.computation].append(ins)
    callers: defaultdict[str, list[tuple[str, int, bool]]] = defaultdict(list)  # callee -> [(caller, factor, known)]
    for ins in instructions:
        trips, known = 1, True
        if ins.opcode == "while":
            count = trip_count(ins, by_computation)
            trips, known = (count, True) if count is not None else (1, False)
        for key, callee in _CALLEE_KEYS.findall(ins.line):
            factor = trips if key == "body" else (trips + 1 if key == "condition" else 1)
            callers[callee].append((ins.computation, factor, known))
        for _, listed in _CALLEE_LISTS.findall(ins.line):
            for callee in re.findall(r"%?([\w.\-]+)", listed):
                callers[callee].append((ins.computation, 1, True))

    memo: dict[str, tuple[int, bool]] = {}

    def runs(comp, seen=()):
        if comp == entry:
            return 1, True
        if comp in memo:
            return memo[comp]
        total, all_known = 0, True
        for caller, factor, known in callers.get(comp, []):
            if caller in seen:
                continue
            n, k = runs(caller, seen + (comp,))
            total += n * factor
            all_known = all_known and k and known
        memo[comp] = (total, all_known)
        return memo[comp]

    return runs


def matching_bracket(text: str, start: int) -> int:
    """Index just past the bracket that closes the one at text[start]."""
    pairs = {"{": "}", "(": ")", "[": "]"}
    stack = []
    for i in range(start, len(text)):
        ch = text[i]
        if ch in pairs:
            stack.append(pairs[ch])
        elif stack and ch == stack[-1]:
            stack.pop()
            if not stack:
                return i + 1
    raise ValueError(f"unbalanced brackets in {text[start:start + 80]!r}")
