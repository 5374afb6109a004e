"""Collectives found in compiled HLO, checked against hand-computed bytes (8 virtual CPU devices)."""
import re
from collections import Counter
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.measure import hlo
from jaxpar.measure.executed import executed_collectives, tick_parts
from jaxpar.parallel.pipeline_program import part_ticks, program_for

N = 8


def auto_mesh(shape, names, devices=None):
    devices = jax.devices()[: int(np.prod(shape))] if devices is None else devices
    return Mesh(np.asarray(devices, dtype=object).reshape(shape), names, axis_types=(AxisType.Auto,) * len(names))


def sds(shape, mesh, spec):
    return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, spec))


def compiled_text(fn, *args):
    return jax.jit(fn).lower(*args).compile().as_text()


def mlp_loss(params, x):
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"]) ** 2)


def test_data_parallel_grad_all_reduce_bytes():
    """Replicated params, sharded batch: the gradient is all-reduced once, 2(N-1)/N x gradient bytes."""
    mesh = auto_mesh((N,), ("data",))
    shapes = {"w1": (16, 32), "b1": (32,), "w2": (32, 4)}
    params = {k: sds(s, mesh, P()) for k, s in shapes.items()}
    grad_bytes = 4 * sum(int(np.prod(s)) for s in shapes.values())
    found = hlo.collectives(compiled_text(jax.grad(mlp_loss), params, sds((64, 16), mesh, P("data"))), mesh)

    assert {c.op for c in found} == {"all-reduce"}
    assert all(c.axes == ("data",) and c.group_size == N and c.runs_per_step == 1 for c in found)
    assert sum(c.result_bytes for c in found) == grad_bytes
    summary = hlo.summarize(found)
    assert summary["total"]["bytes"] == pytest.approx(grad_bytes * 2 * (N - 1) / N)
    assert summary["by_axis"]["data"]["bytes"] == pytest.approx(grad_bytes * 2 * (N - 1) / N)


def test_fsdp_matmul_gather_and_gradient_reduction():
    """FSDP weight (rows sharded): forward all-gathers it; the gradient is reduced back to shards.

    XLA:CPU lowers the gradient's reduce-scatter to an all-reduce of the full gradient
    followed by a dynamic-slice, so it costs 2(N-1)/N x W instead of
    (N-1)/N x W; a GPU compile emits a real reduce-scatter. Either form is accepted.
    """
    mesh = auto_mesh((N,), ("fsdp",))
    w_bytes = 64 * 32 * 4

    def loss(w, x):
        return jnp.mean((x @ w) ** 2)

    step = jax.jit(jax.grad(loss), out_shardings=NamedSharding(mesh, P("fsdp", None)))
    text = step.lower(sds((64, 32), mesh, P("fsdp", None)), sds((64, 64), mesh, P("fsdp"))).compile().as_text()
    found = hlo.collectives(text, mesh)
    by_op = {c.op: c for c in found}

    gather = by_op["all-gather"]
    assert gather.result_bytes == w_bytes and gather.axes == ("fsdp",)
    assert gather.bytes_per_step == pytest.approx(w_bytes * (N - 1) / N)
    if "reduce-scatter" in by_op:
        scatter = by_op["reduce-scatter"]
        assert scatter.result_bytes == w_bytes // N
        assert scatter.bytes_per_step == pytest.approx(w_bytes * (N - 1) / N)
    else:  # the CPU form
        reduce = by_op["all-reduce"]
        assert reduce.result_bytes == w_bytes and reduce.axes == ("fsdp",)
        assert reduce.bytes_per_step == pytest.approx(w_bytes * 2 * (N - 1) / N)
        assert "dynamic-slice" in text
    assert len(found) == 2


def scanned_psum_text(mesh, length=5):
    def body(a):
        def layer(carry, _):
            return carry + jax.lax.psum(carry, "b"), None
        return jax.lax.scan(layer, a, None, length=length)[0]

    fn = jax.shard_map(body, mesh=mesh, in_specs=P("a", "b"), out_specs=P("a", "b"))
    return compiled_text(fn, jnp.ones((8, 16)))


def test_psum_in_scan_counts_trip_count():
    mesh = auto_mesh((2, 4), ("a", "b"))
    text = scanned_psum_text(mesh)
    (c,) = hlo.collectives(text, mesh)
    assert c.op == "all-reduce" and c.axes == ("b",) and c.computation != "ENTRY"
    assert c.runs_per_step == 5 and c.trip_count_known
    per_run = (8 // 2) * (16 // 4) * 4 * 2 * 3 / 4     # local f32[4,4], N=4
    assert c.bytes_per_run == pytest.approx(per_run)
    assert c.bytes_per_step == pytest.approx(5 * per_run)

    # without XLA's known_trip_count annotation the loop condition's constant is used
    stripped = re.sub(r',"known_trip_count":\{"n":"\d+"\}', "", text)
    assert "known_trip_count" not in stripped
    (c,) = hlo.collectives(stripped, mesh)
    assert c.runs_per_step == 5 and c.trip_count_known


def test_axis_attribution_on_2x4_mesh():
    mesh = auto_mesh((2, 4), ("a", "b"))

    def body(x):
        return jax.lax.psum(x, "a"), jax.lax.psum(x, "b"), jax.lax.psum(x, ("a", "b"))

    fn = jax.shard_map(body, mesh=mesh, in_specs=P("a", "b"), out_specs=(P(None, "b"), P("a"), P()))
    found = hlo.collectives(compiled_text(fn, jnp.ones((8, 16))), mesh)
    assert sorted(c.axes for c in found) == [("a",), ("a", "b"), ("b",)]
    groups = {c.axes: c.replica_groups for c in found}
    assert groups[("a",)] == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert groups[("b",)] == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert hlo.summarize(found)["by_axis"].keys() == {"a", "b", "a+b"}


def test_device_ids_are_mesh_positions():
    """With the mesh's devices permuted, HLO ids still count positions in mesh.devices.flat."""
    devices = jax.devices()
    mesh = auto_mesh((2, 4), ("a", "b"), devices=[devices[i] for i in (5, 2, 7, 0, 3, 6, 1, 4)])
    fn = jax.shard_map(lambda x: jax.lax.psum(x, "b"), mesh=mesh, in_specs=P("a", "b"), out_specs=P("a"))
    (c,) = hlo.collectives(compiled_text(fn, jnp.ones((8, 16))), mesh)
    assert c.replica_groups == ((0, 1, 2, 3), (4, 5, 6, 7)) and c.axes == ("b",)


def test_auto_sharding_mesh_axes_form_and_tuple_shapes():
    """GSPMD prints `replica_groups=mesh[...] {...}` with XLA's own axis names; we match by groups."""
    mesh = auto_mesh((2, 4), ("a", "b"))
    shapes = {"w1": (16, 32), "b1": (32,), "w2": (32, 4)}
    params = {k: sds(s, mesh, P()) for k, s in shapes.items()}
    text = compiled_text(jax.grad(mlp_loss), params, sds((64, 16), mesh, P("b")))
    found = hlo.collectives(text, mesh)
    assert "replica_groups=mesh[" in text or "replica_groups={" in text
    assert all(c.axes == ("b",) and c.group_size == 4 for c in found)
    assert sum(len(c.shapes) for c in found) >= 2        # the gradients travel as one tuple all-reduce


@pytest.mark.parametrize("text, expected", [
    ("{{0,1},{2,3}}", [[0, 1], [2, 3]]),
    ("{}", [list(range(8))]),
    ("[2,4]<=[8]", [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ("[4,2]<=[2,4]T(1,0)", [[0, 4], [1, 5], [2, 6], [3, 7]]),
    ("[1,8]<=[2,2,2]T(2,1,0)", [[0, 4, 2, 6, 1, 5, 3, 7]]),
    ("mesh['axis_0'=8,'axis_1'=1] {'axis_0'}", [list(range(8))]),
    ("mesh['axis_0'=4,'axis_1'=1,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_0'}",
     [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ("mesh['axis_0'=2,'axis_1'=1,'axis_2'=4] {'axis_0'}", [[0, 4], [1, 5], [2, 6], [3, 7]]),
    ("mesh['a'=8] {'a':(2)2}", [[0, 2], [1, 3], [4, 6], [5, 7]]),
])
def test_parse_replica_groups(text, expected):
    assert hlo.parse_replica_groups(text, num_devices=8) == expected


SYNTHETIC = """HloModule synthetic, num_partitions=8

%body (p: (s32[], f32[16])) -> (s32[], f32[16]) {
  %p = (s32[], f32[16]{0}) parameter(0)
  %x = f32[16]{0} get-tuple-element(%p), index=1
  %ags = (f32[16]{0}, f32[64]{0}) all-gather-start(%x), channel_id=1, replica_groups=[2,4]<=[8], dimensions={0}
  %agd = f32[64]{0} all-gather-done(%ags)
  %cp = bf16[16]{0} collective-permute(%x), channel_id=2, source_target_pairs={{0,4},{4,0},{1,5},{5,1},{2,6},{6,2},{3,7},{7,3}}
  ROOT %t = (s32[], f32[16]{0}) tuple(%i, %x)
}

%cond (p.1: (s32[], f32[16])) -> pred[] {
  %p.1 = (s32[], f32[16]{0}) parameter(0)
  %c = s32[] constant(3)
  ROOT %lt = pred[] compare(%i.1, %c), direction=LT
}

ENTRY %main (a: f32[16]) -> f32[16] {
  %a = f32[16]{0} parameter(0)
  %w = (s32[], f32[16]{0}) while(%t0), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"7"}}
  %rs = f32[2]{0} reduce-scatter(%a), channel_id=3, replica_groups=[1,8]<=[8], use_global_device_ids=true, dimensions={0}, to_apply=%add
  ROOT %r = f32[16]{0} get-tuple-element(%w), index=1
}
"""


def test_synthetic_async_iota_permute_and_trip_count():
    mesh = auto_mesh((2, 4), ("a", "b"))
    found = {c.op: c for c in hlo.collectives(SYNTHETIC, mesh)}
    assert set(found) == {"all-gather", "collective-permute", "reduce-scatter"}

    ag = found["all-gather"]                     # counted once, shaped like the -done result
    assert ag.is_async and ag.shape == "f32[64]" and ag.axes == ("b",)
    assert ag.runs_per_step == 7                 # known_trip_count wins over the condition's constant
    assert ag.bytes_per_step == pytest.approx(7 * 64 * 4 * 3 / 4)

    cp = found["collective-permute"]
    assert cp.axes == ("a",) and cp.group_size == 2
    assert cp.bytes_per_step == pytest.approx(7 * 16 * 2)

    rs = found["reduce-scatter"]                 # (N-1)/N of the input, which is N x the f32[2] output
    assert rs.runs_per_step == 1 and rs.axes == ("a", "b")
    assert rs.bytes_per_step == pytest.approx(7 / 8 * 16 * 4)


def test_summary():
    mesh = auto_mesh((2, 4), ("a", "b"))
    found = hlo.collectives(SYNTHETIC, mesh)
    summary = hlo.summarize(found)
    assert summary["by_op"]["all-gather"]["count"] == 7
    assert summary["total"]["instructions"] == 3
    assert summary["total"]["bytes"] == pytest.approx(sum(c.bytes_per_step for c in found))
    assert set(summary["by_axis"]) == {c.axis_label for c in found}


def test_no_mesh_leaves_axes_unknown():
    (c,) = [c for c in hlo.collectives(SYNTHETIC) if c.op == "reduce-scatter"]
    assert c.axes is None and c.axis_label == "?" and c.group_size == 8


def test_dtype_bytes():
    assert [hlo.dtype_bytes(t) for t in ("f32", "bf16", "f8e4m3fn", "pred", "s4", "c64")] == [4, 2, 1, 1, 0.5, 8]


DATA = Path(__file__).parent / "data"


@pytest.mark.parametrize("excerpt, schedule, ticks, static_runs", [
    ("h100_pipeline_tick_loop.hlo", "1f1b", 10, [5, 5]),       # the loop unrolled twice: 5 trips of 2 copies
    ("h100_peeled_tick_loop.hlo", "zb-h1", 13, [1, 6, 6]),     # + one tick peeled out of it
])
def test_unrolled_tick_loop_runs_each_send_once_per_tick(excerpt, schedule, ticks, static_runs):
    """XLA:GPU's while-loop double buffering (in jaxpar's GPU flags) unrolls the pipeline's tick loop twice, and
    peels a tick out of it where the count is odd: each send's switch is there two or three times, each copy run
    on some of the ticks (tests/data: excerpts of deviceless H100 compiles, p=2 m=4). Each stage must still run
    each send on the ticks its table gives it."""
    text = (DATA / excerpt).read_text()
    program = program_for(schedule, 2, 4, 1)
    parts = tick_parts(text)
    static = hlo.collectives(text, auto_mesh((2,), ("pipe",)))
    assert program.ticks == ticks
    for part in ("send_down_1", "send_up_1"):
        assert sorted(c.runs_per_step for c in static if parts[c.name] == part) == static_runs
    table = part_ticks(program)
    buffer = 2 * 32 * 64 * 4                                                # one f32[2,32,64] microbatch activation
    for stage in range(2):
        found = executed_collectives(text, auto_mesh((2,), ("pipe",)), program, stage)
        runs = Counter()
        for c in found:
            runs[parts[c.name]] += c.runs_per_step
        assert runs == {part: int(table[part][stage]) for part in ("send_down_1", "send_up_1")}
        assert sum(c.bytes_per_step for c in found) == sum(runs.values()) * buffer > 0
        assert {c.axis_label for c in found} == {"pipe"}


def test_sends_merged_across_routes_count_both_routes_ticks():
    """Interleaved at p=2 sends down and up over the same pairs; XLA:GPU merged the two routes' branches and all 12
    permutes say `pipeline_send_down_k` (excerpt of a deviceless H100 compile, m=4). A stage's sends over a set of
    pairs must run on the ticks of every route that sends over it."""
    text = (DATA / "h100_interleaved_sends.hlo").read_text()
    program = program_for("interleaved", 2, 4, 2)
    assert set(tick_parts(text).values()) == {"send_down_1", "send_down_2", "send_down_3"}
    ticks = part_ticks(program)
    for stage in range(2):
        runs = Counter()
        for c in executed_collectives(text, auto_mesh((2,), ("pipe",)), program, stage):
            runs[frozenset(c.pairs)] += c.runs_per_step
        expected = Counter()
        for route, patterns in program.sends.items():
            for k, pairs in enumerate(patterns[1:], start=1):
                expected[frozenset(pairs)] += int(ticks[f"send_{route}_{k}"][stage])
        assert runs == expected and sum(runs.values()) > 0


def test_combined_all_reduce_without_scope_runs_with_its_part():
    """XLA:GPU combined two of the head's tensor all-reduces into one that has no op_name (excerpt of a deviceless
    H100 compile, 1F1B pipe=2 x tensor=2, m=4): it runs on the head's ticks, as the scoped one beside it does."""
    text = (DATA / "h100_combined_all_reduce.hlo").read_text()
    program = program_for("1f1b", 2, 4, 1)
    head = part_ticks(program)["head"]
    for stage in range(2):
        runs = Counter()
        for c in executed_collectives(text, auto_mesh((2, 2), ("pipe", "tensor")), program, stage):
            runs[c.shape] += c.runs_per_step
        assert runs == {"f32[128]": head[stage], "f32[2,32]": head[stage]}
    assert max(head) > 0


def test_unscoped_collectives_beside_the_branch_rope_run_with_their_part():
    """XLA:GPU combined the MoE router's statistics psums into two f32[16] all-reduces without op_name, in the F
    branch's computation beside RoPE's cos and sin, which are scoped in the tick branch outside `pipeline_F`
    (excerpt of the Mixtral recipe's deviceless H100 compile, interleaved p=4 v=8 m=16). They run on F's ticks,
    not on every tick of the 262."""
    text = (DATA / "h100_router_all_reduce_beside_rope.hlo").read_text()
    combined = ["all-reduce-start.1", "all-reduce-start.2", "all-reduce-start.4", "all-reduce-start.5"]
    assert [tick_parts(text).get(name) for name in combined] == ["F"] * 4
    program = program_for("interleaved", 4, 16, 8)
    forward = part_ticks(program)["F"]
    assert program.ticks == 262 and 0 < max(forward) < program.ticks
    for stage in range(4):
        runs = sum(c.runs_per_step for c in executed_collectives(text, None, program, stage) if c.shape == "f32[16]")
        assert runs == 2 * forward[stage]
