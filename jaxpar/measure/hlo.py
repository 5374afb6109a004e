"""Collectives in a compiled program: which, over which mesh axes, how often, how many bytes.

The input is the post-SPMD HLO text of a compiled program (`compiled.as_text()`),
where XLA has already inserted every collective the shardings require. The
pre-partitioning StableHLO (`lowered.as_text()`) has none of them.

For each collective instruction we report its result shapes, its replica groups
(device ids are positions in the mesh's flattened device list, `mesh.devices.flat`:
the compiled program's device assignment is that list, so id k is the k-th mesh
position whatever the physical device id), the mesh axes those groups span, how
many times it runs per step (inside `while` loops, e.g. `lax.scan`, it runs once
per trip), and the bytes each device sends per step under a ring cost model.

Replica groups come in three spellings and all are parsed:
  explicit   replica_groups={{0,1},{2,3}}
  iota       replica_groups=[2,4]<=[8]   or   [4,2]<=[2,4]T(1,0)
  mesh axes  replica_groups=mesh['axis_0'=2,'axis_1'=4], device_ids=([4,2]T(1,0)) {'axis_1'}
             (the form XLA 0.10's SPMD partitioner prints on CPU; its axis names are
             XLA's own, not the JAX mesh's, so axes are matched by device groups)

Trip counts: we rely on the `known_trip_count` that XLA's while-loop analysis
writes into the loop's `backend_config` (present for every `scan`/`fori_loop` with
static bounds); when it is missing we fall back to the integer constant that the
loop condition compares against (assumes a 0-based counter with step 1), and if
that fails too we count the loop once and mark the collective `trip_count_known=False`.

Overflow rounds: the collectives of the expert exchange's overflow round (parallel/expert_exchange.py, a
`lax.cond` branch in the `expert_overflow` scope) run only on a step whose routing overflows the exchange's
capacity; they are listed with `on_overflow=True` and 0 runs per step: the count is the step without overflow.
"""
from __future__ import annotations

import dataclasses
import itertools
import re
from collections import defaultdict
from typing import TYPE_CHECKING, Any

import numpy as np

from jaxpar.measure.hlo_module import matching_bracket, parse_module, runs_per_computation

if TYPE_CHECKING:
    import jax

OVERFLOW_SCOPE = "expert_overflow"     # parallel/expert_exchange.py's overflow round

# HLO opcode -> our name. `-start` variants are the async form (GPU); counted once.
COLLECTIVE_OPS = (
    "all-reduce", "all-gather", "reduce-scatter", "all-to-all",
    "collective-permute", "ragged-all-to-all", "collective-broadcast",
)


def ring_factor(op: str, group_size: int) -> float:
    """Bytes each device sends, as a multiple of the op's (result) buffer, under a ring model.

    all-reduce = reduce-scatter + all-gather: 2(N-1)/N of the buffer. all-gather sends
    (N-1)/N of its output; reduce-scatter (N-1)/N of its input, which is N x its output.
    all-to-all keeps 1/N of its buffer and sends the rest. A permute or broadcast sends
    the buffer once.
    """
    n = group_size
    if n <= 1:
        return 0.0
    if op == "all-reduce":
        return 2.0 * (n - 1) / n
    if op in ("all-gather", "all-to-all", "ragged-all-to-all"):
        return (n - 1) / n
    if op == "reduce-scatter":
        return float(n - 1)  # (N-1)/N x input, input = N x result
    return 1.0  # collective-permute, collective-broadcast


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of a compiled program."""

    name: str                                   # HLO instruction name, e.g. "all-reduce.3"
    op: str                                     # one of COLLECTIVE_OPS
    is_async: bool                              # written as an `-start`/`-done` pair
    shapes: tuple[tuple[str, tuple[int, ...]], ...]   # (dtype, dims) per result; tuples have several
    result_bytes: int                           # bytes of the result buffer(s), per device
    replica_groups: tuple[tuple[int, ...], ...]
    group_size: int                             # N
    axes: tuple[str, ...] | None                # mesh axes the groups span; () = no-op; None = unknown
    computation: str                            # HLO computation holding the instruction
    runs_per_step: int                          # product of the trip counts of the enclosing loops
    trip_count_known: bool = True
    on_overflow: bool = False                   # the expert exchange's overflow round: counted 0 times
    pairs: tuple[tuple[int, int], ...] = ()     # a collective-permute's source -> target device pairs

    @property
    def shape(self) -> str:
        parts = [f"{dtype}[{','.join(map(str, dims))}]" for dtype, dims in self.shapes]
        return parts[0] if len(parts) == 1 else "(" + ", ".join(parts) + ")"

    @property
    def axis_label(self) -> str:
        if self.axes is None:
            return "?"
        return "+".join(self.axes) if self.axes else "-"

    @property
    def bytes_per_run(self) -> float:
        """Bytes each device sends for one execution (ring model)."""
        return ring_factor(self.op, self.group_size) * self.result_bytes

    @property
    def bytes_per_step(self) -> float:
        return self.bytes_per_run * self.runs_per_step


# ----------------------------------------------------------------------------- shapes

_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")


def dtype_bytes(dtype: str) -> float:
    """Bytes per element of an HLO element type: f32 -> 4, bf16 -> 2, f8e4m3fn -> 1, pred -> 1, s4 -> 0.5."""
    if dtype == "pred":
        return 1.0
    if dtype == "token":
        return 0.0
    bits = re.search(r"\d+", dtype)
    if not bits:
        raise ValueError(f"unknown HLO element type '{dtype}'")
    return int(bits.group()) / 8.0


def parse_shapes(shape_text: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """`f32[8,32]{1,0}` or `(f32[], bf16[4,2]{1,0})` -> (("f32", ()), ("bf16", (4, 2)))."""
    out = []
    for dtype, dims in _ARRAY.findall(shape_text):
        # dynamic dimensions print as `<=8`; the bound is what is allocated
        out.append((dtype, tuple(int(d) for d in re.findall(r"\d+", dims))))
    return tuple(out)


def shapes_bytes(shapes) -> int:
    return int(sum(dtype_bytes(dtype) * int(np.prod(dims, dtype=np.int64)) for dtype, dims in shapes))


# ----------------------------------------------------------------------------- replica groups

def _ints(text: str) -> list[int]:
    return [int(v) for v in re.findall(r"\d+", text)]


_IOTA = re.compile(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_IOTA_ARRAY = re.compile(r"^\[([\d,]+)\](?:T\(([\d,]+)\))?$")


def expand_iota(reshape_dims, perm=None) -> np.ndarray:
    """iota(prod(dims)) reshaped to `dims`, then transposed by `perm`: XLA's iota device list."""
    ids = np.arange(int(np.prod(reshape_dims))).reshape(reshape_dims)
    return ids.transpose(perm) if perm else ids


def _iota_groups(text: str) -> list[list[int]]:
    """`[G,N]<=[dims]T(perm)`: G groups of N devices."""
    m = _IOTA.fullmatch(text.strip())
    if not m:
        raise ValueError(f"not an iota replica group list: {text!r}")
    groups_shape = _ints(m.group(1))
    ids = expand_iota(_ints(m.group(2)), _ints(m.group(3)) if m.group(3) else None)
    return ids.reshape(groups_shape[0], -1).tolist()


def _mesh_axes_groups(text: str) -> list[list[int]]:
    """`mesh['a'=2,'b'=4], device_ids=(...) {'b'}`: devices that differ only along the listed axes.

    A listed axis may be a sub-axis `'a':(pre)size`: axis `a` (size n) is viewed as
    [pre, size, n/(pre*size)] (major to minor) and the group spans the middle factor.
    """
    m = re.match(r"mesh\[([^\]]*)\]", text)
    if not m:
        raise ValueError(f"not a mesh-axes replica group list: {text!r}")
    axes = [(name, int(size)) for name, size in re.findall(r"'?([^',=\s]+)'?=(\d+)", m.group(1))]
    names = [a for a, _ in axes]
    sizes = [s for _, s in axes]
    total = int(np.prod(sizes))
    rest = text[m.end():]
    devices = np.arange(total)
    d = re.search(r"device_ids=\(", rest)
    if d:
        inner = rest[d.end() - 1:matching_bracket(rest, d.end() - 1)][1:-1].strip()
        iota = _IOTA_ARRAY.match(inner)
        full = _IOTA.fullmatch(inner)
        if full:
            devices = expand_iota(_ints(full.group(2)), _ints(full.group(3)) if full.group(3) else None)
        elif iota:
            devices = expand_iota(_ints(iota.group(1)), _ints(iota.group(2)) if iota.group(2) else None)
        else:
            devices = np.array(_ints(inner))
        rest = rest[matching_bracket(rest, d.end() - 1):]
    brace = rest.index("{")
    refs: list[tuple[int, Any, Any]] = []   # (mesh axis, pre-size, sub-axis size); both None: the whole axis
    for item in rest[brace + 1:matching_bracket(rest, brace) - 1].split(","):
        item = item.strip()
        if not item:
            continue
        sub_axis = re.fullmatch(r"'?([^':]+)'?:\((\d+)\)(\d+)", item)
        if sub_axis:
            refs.append((names.index(sub_axis.group(1)), int(sub_axis.group(2)), int(sub_axis.group(3))))
        else:
            refs.append((names.index(item.strip("'")), None, None))
    # split every mesh axis into the factors the sub-axes need (major to minor)
    dims: list[int] = []
    grouped_dims: dict[int, list[int]] = {}
    for axis, size in enumerate(sizes):
        cuts = {1, size}
        for a, pre, sub in refs:
            if a == axis and pre is not None:
                cuts |= {pre, pre * sub}
        bounds = sorted(cuts)
        for lo, hi in zip(bounds, bounds[1:]):
            for i, (a, pre, sub) in enumerate(refs):
                if a == axis and (pre is None or (pre <= lo and hi <= pre * sub)):
                    grouped_dims.setdefault(i, []).append(len(dims))
            dims.append(hi // lo)
        if size == 1:
            for i, (a, _, _) in enumerate(refs):
                if a == axis:
                    grouped_dims.setdefault(i, []).append(len(dims))
            dims.append(1)
    grouped = [g for i in range(len(refs)) for g in grouped_dims.get(i, [])]
    kept = [i for i in range(len(dims)) if i not in grouped]
    arranged = devices.reshape(dims).transpose(kept + grouped)
    group_size = int(np.prod([dims[g] for g in grouped])) if grouped else 1
    return arranged.reshape(-1, group_size).tolist()


def parse_replica_groups(text: str, num_devices: int) -> list[list[int]]:
    """Any of the three spellings (see module docstring); `{}` means one group of all devices."""
    text = text.strip()
    if text.startswith("{"):
        inner = text[1:-1].strip()
        if not inner:
            return [list(range(num_devices))]
        return [_ints(g) for g in re.findall(r"\{([^{}]*)\}", inner)]
    if text.startswith("["):
        return _iota_groups(text)
    if text.startswith("mesh"):
        return _mesh_axes_groups(text)
    raise ValueError(f"unrecognised replica_groups: {text[:80]!r}")


def _replica_groups_text(line: str) -> str | None:
    key = "replica_groups="
    at = line.find(key)
    if at < 0:
        return None
    start = at + len(key)
    if line[start] == "{":
        return line[start:matching_bracket(line, start)]
    if line[start] == "[":
        m = _IOTA.match(line, start)
        if m is None:
            raise ValueError(f"unrecognised replica_groups: {line[start:start + 80]!r}")
        return m.group(0)
    if line.startswith("mesh", start):
        end = matching_bracket(line, line.index("[", start))          # mesh[...]
        if line.startswith(", device_ids=", end):
            end = matching_bracket(line, line.index("(", end))        # device_ids=(...)
        brace = line.index("{", end)
        return line[start:matching_bracket(line, brace)]
    raise ValueError(f"unrecognised replica_groups in: {line[:160]!r}")


def _permute_pairs(line: str) -> tuple[tuple[int, int], ...]:
    """A collective-permute's source_target_pairs, as (source, target) device ids."""
    m = re.search(r"source_target_pairs=\{", line)
    found = re.findall(r"\{(\d+),(\d+)\}", line[m.end() - 1:matching_bracket(line, m.end() - 1)]) if m else []
    return tuple((int(s), int(t)) for s, t in found)


def _permute_groups(pairs) -> list[list[int]]:
    """Connected components of a collective-permute's source->target pairs (e.g. one ring per group)."""
    parent: dict[int, int] = {}

    def find(v):
        parent.setdefault(v, v)
        while parent[v] != v:
            parent[v] = parent[parent[v]]
            v = parent[v]
        return v

    for s, t in pairs:
        parent[find(s)] = find(t)
    groups = defaultdict(list)
    for v in parent:
        groups[find(v)].append(v)
    return sorted(sorted(g) for g in groups.values())


# ----------------------------------------------------------------------------- mesh axes

def mesh_axis_groups(mesh) -> dict[tuple[str, ...], frozenset[frozenset[int]]]:
    """For each subset of mesh axes (size-1 axes left out), the device groups that vary exactly those axes.

    Devices are mesh positions: id k is `mesh.devices.flat[k]`.
    """
    names = list(mesh.axis_names)
    sizes = [int(mesh.shape[n]) for n in names]
    ids = np.arange(int(np.prod(sizes))).reshape(sizes)
    live = [i for i, s in enumerate(sizes) if s > 1]
    table: dict[frozenset, tuple[str, ...]] = {}
    for r in range(1, len(live) + 1):
        for subset in itertools.combinations(live, r):
            others = [i for i in range(len(sizes)) if i not in subset]
            arranged = ids.transpose(others + list(subset)).reshape(-1, int(np.prod([sizes[i] for i in subset])))
            groups = frozenset(frozenset(row) for row in arranged.tolist())
            table.setdefault(groups, tuple(names[i] for i in subset))
    return {axes: groups for groups, axes in table.items()}


def match_axes(groups, axis_groups) -> tuple[str, ...] | None:
    """Which mesh axes `groups` span: () when every group is a single device, None when no subset matches."""
    if all(len(g) <= 1 for g in groups):
        return ()
    key = frozenset(frozenset(g) for g in groups)
    for axes, candidate in axis_groups.items():
        if candidate == key:
            return axes
    return None


def permute_axes(groups, axis_groups) -> tuple[str, ...] | None:
    """Which mesh axes a collective-permute's pairs run along: `match_axes`, else (a permute over some of an
    axis's pairs only, as a pipeline tick sends) the fewest axes whose groups each hold a whole component."""
    exact = match_axes(groups, axis_groups)
    if exact is not None:
        return exact
    fits = [axes for axes, candidate in axis_groups.items()
            if all(any(set(g) <= group for group in candidate) for g in groups)]
    return min(fits, key=len) if fits else None


def _num_devices(hlo_text: str) -> int:
    partitions = re.search(r"num_partitions=(\d+)", hlo_text)
    replicas = re.search(r"replica_count=(\d+)", hlo_text)
    return (int(partitions.group(1)) if partitions else 1) * (int(replicas.group(1)) if replicas else 1)


def compiled_hlo(compiled: jax.stages.Compiled) -> str:
    """The compiled program's HLO text (jax types it optional: a backend may keep none, and then there is nothing
    to read)."""
    text = compiled.as_text()
    if text is None:
        raise ValueError("this backend keeps no HLO text of the compiled program")
    return text


def collectives(hlo_text: str, mesh=None) -> list[Collective]:
    """Every collective in post-SPMD HLO text, in program order; pass the mesh to name axes."""
    instructions, entry = parse_module(hlo_text)
    runs = runs_per_computation(instructions, entry)
    num_devices = _num_devices(hlo_text)
    axis_groups = mesh_axis_groups(mesh) if mesh is not None else None
    done_shapes = {}
    for ins in instructions:
        if ins.opcode.endswith("-done"):
            operand = re.search(r"-done\(\s*%?([\w.\-]+)", ins.line)
            if operand:
                done_shapes[operand.group(1)] = ins.shape_text

    found = []
    for ins in instructions:
        is_async = ins.opcode.endswith("-start")
        op = ins.opcode[: -len("-start")] if is_async else ins.opcode
        if op not in COLLECTIVE_OPS:
            continue
        shapes = parse_shapes(ins.shape_text)
        if is_async:
            if ins.name in done_shapes:         # the -done result is the collective's output
                shapes = parse_shapes(done_shapes[ins.name])
            elif op in ("all-gather", "collective-permute") and len(shapes) >= 2:
                shapes = shapes[1:2]            # start tuple is (input, output, ...)
        pairs = _permute_pairs(ins.line) if op == "collective-permute" else ()
        if op == "collective-permute":
            groups = _permute_groups(pairs)
        else:
            text = _replica_groups_text(ins.line)
            groups = parse_replica_groups(text, num_devices) if text else [list(range(num_devices))]
        group_size = max((len(g) for g in groups), default=1)
        n, known = runs(ins.computation)
        on_overflow = f"/{OVERFLOW_SCOPE}/" in (re.search(r'op_name="([^"]*)"', ins.line) or [""])[0]
        found.append(Collective(
            name=ins.name, op=op, is_async=is_async, shapes=shapes,
            result_bytes=shapes_bytes(shapes),
            replica_groups=tuple(tuple(g) for g in groups), group_size=group_size,
            axes=None if axis_groups is None else
            (permute_axes if op == "collective-permute" else match_axes)(groups, axis_groups),
            computation=ins.computation, runs_per_step=0 if on_overflow else n, trip_count_known=known,
            on_overflow=on_overflow, pairs=pairs,
        ))
    return found


# ----------------------------------------------------------------------------- reports

def _bucket() -> dict[str, float]:
    return {"instructions": 0, "count": 0, "bytes": 0.0}


def summarize(found: list[Collective]) -> dict:
    """Totals per op type, per mesh axis and overall: runs per step and bytes sent per device per step."""
    by_op: defaultdict[str, dict[str, float]] = defaultdict(_bucket)
    by_axis: defaultdict[str, dict[str, float]] = defaultdict(_bucket)
    total = _bucket()
    for c in found:
        for bucket in (by_op[c.op], by_axis[c.axis_label], total):
            bucket["instructions"] += 1
            bucket["count"] += c.runs_per_step
            bucket["bytes"] += c.bytes_per_step
    return {"by_op": dict(by_op), "by_axis": dict(by_axis), "total": total}
