"""Pipeline parallelism: schedule tables against their formulas, every schedule and 3D against one device,
1F1B's bounded memory, the split backward, one checkpoint layout, bad input, and 2 processes."""
import io
import json
import os
from fractions import Fraction
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from synthetic import counting_batches

from jaxpar.cli import main
from jaxpar.config import apply_overrides, load_config
from jaxpar.launch import launch
from jaxpar.measure import hlo
from jaxpar.measure.executed import step_collectives
from jaxpar.measure.flops import compiled_flops
from jaxpar.measure.memory import compiled_memory
from jaxpar.mesh import make_mesh
from jaxpar.model.transformer import ModelConfig, init_params, loss, run_blocks
from jaxpar.parallel import deferred
from jaxpar.parallel.pipeline_program import compile_program, sends_per_stage
from jaxpar.parallel.registry import make_strategy
from jaxpar.parallel.schedules import NAMES, Action, ScheduleError, bubble_fraction, build, dualpipe_idle, validate

STEPS, VOCAB = 5, 512
BASE = ["train.warmup_steps=1", "model.layers=4"]
TESTS_DIR = str(Path(__file__).parent)
FAST = {"xla_backend_optimization_level": 0}   # LLVM's -O0: compiles ~2.5x faster; the same HLO, same numbers
CASES = {
    "gpipe p=4 m=8": (["mesh.data=1", "mesh.pipe=4", "parallel.pipe=gpipe", "parallel.pipe_microbatches=8"], 4),
    "1f1b p=4 m=8": (["mesh.data=1", "mesh.pipe=4", "parallel.pipe=1f1b", "parallel.pipe_microbatches=8"], 4),
    "interleaved p=2 v=2 m=4": (["mesh.data=1", "mesh.pipe=2", "parallel.pipe=interleaved", "parallel.pipe_virtual=2",
                                 "parallel.pipe_microbatches=4"], 2),
    "zb-h1 p=4 m=8": (["mesh.data=1", "mesh.pipe=4", "parallel.pipe=zb-h1", "parallel.pipe_microbatches=8"], 4),
    "circular p=4 m=8": (["mesh.data=1", "mesh.pipe=4", "parallel.pipe=circular", "parallel.pipe_microbatches=8"], 4),
    "3d data=2 pipe=2 tensor=2": (["mesh.data=2", "mesh.pipe=2", "mesh.tensor=2", "parallel.pipe=1f1b",
                                   "parallel.pipe_microbatches=4"], 8),
    # Megatron's sequence parallelism inside the stages: they pass [b, s/t, h] on
    "sp: data=2 pipe=2 tensor=2 sequence": (["mesh.data=2", "mesh.pipe=2", "mesh.tensor=2", "parallel.pipe=1f1b",
                                             "parallel.tensor=manual", "parallel.sequence=true",
                                             "parallel.pipe_microbatches=4"], 8),
    # SP's collective matmuls inside the stages: each ring step an all-to-all swap over tensor=2 (collective_matmul.py;
    # the other schedules and an MoE model: lab 04's `moe` part)
    "sp rings: 1f1b data=2 pipe=2 tensor=2": (["mesh.data=2", "mesh.pipe=2", "mesh.tensor=2", "parallel.pipe=1f1b",
                                              "parallel.tensor=manual", "parallel.sequence=true",
                                              "parallel.tensor_overlap=bidirectional",
                                              "parallel.pipe_microbatches=4"], 8),
    # DualPipeV's V (device 0 holds model stages 0 and 3, device 1 stages 1 and 2: sends down, up and to itself)
    # with manual TP x FSDP inside its stages
    "dualpipev, manual tp: fsdp=2 pipe=2 tensor=2": (["mesh.data=1", "mesh.fsdp=2", "mesh.pipe=2", "mesh.tensor=2",
                                                      "parallel.pipe=dualpipev", "parallel.tensor=manual",
                                                      "parallel.pipe_microbatches=4"], 8),
}


def make(overrides, devices: int):
    config = load_config("configs/test.py")
    apply_overrides(config, BASE + overrides)
    model_cfg = ModelConfig.from_config(config.model, VOCAB)
    return make_strategy(config, model_cfg, make_mesh(config, jax.devices()[:devices]))


class Compiled:
    """A strategy with its step compiled once (run and inspected), from one shared initial state."""

    def __init__(self, strategy, initial):
        self.strategy = strategy
        with jax.set_mesh(strategy.mesh):
            self.step = strategy.lower_step().compile(compiler_options=FAST)
        self.initial = strategy.init_state() if initial is None else strategy.from_canonical(initial)

    def run(self, state=None, steps=STEPS):
        state = self.initial if state is None else state
        losses, norms = [], []
        for batch in counting_batches(self.strategy.config, steps, VOCAB)[:steps]:
            with jax.set_mesh(self.strategy.mesh):
                state, metrics = self.step(state, jax.device_put(batch, self.strategy.batch_sharding))
            losses.append(float(metrics["loss"]))
            norms.append(float(metrics["grad_norm"]))
        return np.array(losses), np.array(norms), state


@pytest.fixture(scope="module")
def initial():
    """The initial state every strategy starts from (same seed, same values: made once, on the host)."""
    return jax.device_get(make(["mesh.data=1"], 1).init_state())


@pytest.fixture(scope="module")
def built(initial):
    cache = {}

    def get(name):
        if name not in cache:
            overrides, devices = CASES.get(name, (["mesh.data=1"], 1))
            cache[name] = Compiled(make(overrides, devices), initial)
        return cache[name]
    return get


@pytest.fixture(scope="module")
def runs(built):
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = built(name).run()
        return cache[name]
    return get


# ---------------------------------------------------------------------------- schedules as data

@pytest.mark.parametrize("name", NAMES)
def test_each_table_bubble_equals_its_formula(name):
    for p in (2, 3, 4, 8):
        for m in (p, p + 1, 2 * p, 4 * p):
            for v in ((2, 3) if name == "interleaved" else (1,)):
                if name == "interleaved" and m % p or name == "dualpipev" and m < 2 * p:
                    continue
                schedule = build(name, p, m, v)
                validate(schedule)
                assert schedule.bubble() == bubble_fraction(name, p, m, v), (name, p, m, v)


@pytest.mark.parametrize("p", [4, 8])
def test_dualpipev_table_has_the_published_bubble_and_activation_memory(p):
    """DeepSeek's (PP/2-1)(F&B+B-3W) idle per device with PP = 2p model stages, a tick per F, B (input
    gradient) or W: F&B = F+B = 3 (nothing overlaps in a tick table), a full backward B = 2, W = 1; and
    PP+1 chunk-microbatches alive at most on each device."""
    for m in (2 * p, 2 * p + 1, 4 * p):
        schedule = build("dualpipev", p, m)
        validate(schedule)
        assert schedule.idle_ticks() == [dualpipe_idle(2 * p, f_and_b=3, b=2, w=1)] * p, m
        assert max(schedule.in_flight()) == 2 * p + 1
        assert schedule.placement(0) == (0, 0) and schedule.placement(2 * p - 1) == (0, 1)   # the V
        assert schedule.placement(p - 1) == (p - 1, 0) and schedule.placement(p) == (p - 1, 1)


def test_in_flight_bounds_gpipe_m_1f1b_and_zb_p():
    assert max(build("gpipe", 4, 16).in_flight()) == 16
    assert build("1f1b", 4, 16).in_flight() == [4, 3, 2, 1]
    assert max(build("zb-h1", 4, 16).in_flight()) == 4
    assert compile_program(build("1f1b", 4, 16)).slots["stash"] == 4
    assert compile_program(build("gpipe", 4, 16)).slots["stash"] == 16
    assert build("interleaved", 4, 8, 2).bubble() == Fraction(3, 19)


@pytest.mark.parametrize("name, v", [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved", 2), ("dualpipev", 2)])
def test_a_tick_sends_over_just_the_pairs_the_table_sends_on(name, v):
    """The program's sends: per tick and route, exactly the (sender, receiver) pairs of the F (not on the last
    model stage) and B (not on the first) cells, so a bubble tick sends nothing and a stage sends what the
    schedule does (m activations and m gradients per chunk it holds, the first and last model stage half)."""
    p, m = 4, 8
    program = compile_program(build(name, p, m, v))
    schedule, K = program.schedule, p * v
    for t, row in enumerate(schedule.grid):
        want: dict[str, set] = {"down": set(), "up": set()}
        for s, action in enumerate(row):
            if action is None or action.kind == "W":
                continue
            k = schedule.model_stage(s, action.chunk)
            if action.kind == "F" and k < K - 1 or action.kind == "B" and k > 0:
                receiver = schedule.placement(k + 1 if action.kind == "F" else k - 1)[0]
                forward = (action.kind == "F") != (schedule.shape == "v" and action.chunk == 1)
                if receiver != s:
                    want["down" if forward else "up"].add((s, receiver))
        for route in ("down", "up"):
            assert set(program.sends[route][program.table[f"send_{route}"][t, 0]]) == want[route], (t, route)
    model_stages = np.zeros(p, int)
    for s in range(p):
        for c in range(v):
            model_stages[s] += 2 - (schedule.model_stage(s, c) in (0, K - 1))
    local = 2 * m * (name == "dualpipev")      # the V's bottom hands chunk 0 to its own chunk 1: no send
    assert (sends_per_stage(program) + np.eye(p, dtype=int)[p - 1] * local == m * model_stages).all()


def test_a_bubble_tick_sends_nothing_on_the_devices():
    """The executor's `send` over every tick of 1F1B (p=4, m=8) on 4 devices: a stage receives its neighbour's
    buffer exactly on the ticks the table sends it that way, and zeros otherwise (a tick on which no stage sends
    moves nothing)."""
    from jax.sharding import PartitionSpec as P

    from jaxpar.parallel.pipeline_executor import send
    program, p = compile_program(build("1f1b", 4, 8)), 4
    mesh = jax.make_mesh((p,), ("pipe",), devices=jax.devices()[:p])

    def received(x):                      # this device's [route, tick] of what arrived (its sender's id + 1)
        ticks = jnp.arange(program.ticks)
        return jnp.stack([jax.lax.map(lambda t, route=route: send(program, route, x, t), ticks)
                          for route in ("down", "up")])[None]
    ids = jax.device_put(jnp.arange(1.0, p + 1), jax.sharding.NamedSharding(mesh, P("pipe")))
    got = jax.jit(jax.shard_map(received, mesh=mesh, in_specs=P("pipe"), out_specs=P("pipe")))(ids)
    for r, route in enumerate(("down", "up")):
        for t in range(program.ticks):
            pairs = program.sends[route][program.table[f"send_{route}"][t, 0]]
            want = np.zeros(p)
            for sender, receiver in pairs:
                want[receiver] = sender + 1
            np.testing.assert_array_equal(np.asarray(got[:, r, t, 0]), want, err_msg=f"{route} tick {t}")


def test_validation_rejects_broken_tables():
    good = build("1f1b", 3, 4)
    grid = [list(row) for row in good.grid]

    def broken(cells):
        return good.__class__(**{**good.__dict__, "grid": tuple(tuple(r) for r in cells)})

    # a forward one tick early: before its input arrives
    early = [row[:] for row in grid]
    t = next(t for t, row in enumerate(early) if row[1] == Action("F", 0))
    early[t - 1][1], early[t][1] = early[t][1], early[t - 1][1]
    with pytest.raises(ScheduleError, match="needs F0"):
        validate(broken(early))
    # a backward dropped
    dropped = [[None if c == Action("B", 2) else c for c in row] for row in grid]
    with pytest.raises(ScheduleError, match="B2 never runs"):
        validate(broken(dropped))
    # GPipe's table sold as bounded by p
    gpipe = build("gpipe", 3, 6)
    with pytest.raises(ScheduleError, match="holds 6"):
        validate(gpipe.__class__(**{**gpipe.__dict__, "in_flight_bound": 3}))
    validate(good)


# ---------------------------------------------------------------------------- equivalence

@pytest.fixture(scope="module")
def oracle(runs):
    losses, norms, state = runs("single device")
    assert losses[-1] < losses[0]
    return losses, norms, state


@pytest.mark.parametrize("name", list(CASES))
def test_matches_single_device(name, built, runs, oracle):
    losses, norms, state = runs(name)
    np.testing.assert_allclose(losses, oracle[0], rtol=1e-4)
    np.testing.assert_allclose(norms, oracle[1], rtol=1e-4)          # gradients: their global norm every step
    canonical = built(name).strategy.to_canonical(state)             # the stage-owned layout, back in the model's
    for got, want in zip(jax.tree.leaves(canonical), jax.tree.leaves(oracle[2])):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-3, atol=1e-5)


def test_evaluation_runs_the_forward_schedule(built, runs, oracle):
    _, _, state = runs("interleaved p=2 v=2 m=4")
    strategy = built("interleaved p=2 v=2 m=4").strategy
    single = built("single device").strategy
    batch = counting_batches(strategy.config, 1, VOCAB, seed=7)[0]

    def evaluate(t, params):
        tokens = jax.device_put(batch, t.batch_sharding)
        with jax.set_mesh(t.mesh):
            return float(t.eval_fn.lower(params, tokens).compile(compiler_options=FAST)(params, tokens))
    got, want = evaluate(strategy, state["params"]), evaluate(single, oracle[2]["params"])
    assert got == pytest.approx(want, rel=1e-5)


# ---------------------------------------------------------------------------- memory and the split backward

def test_1f1b_stash_is_bounded_by_p_gpipe_keeps_all_m(built):
    """Same p=4, m=8, same microbatch: GPipe keeps 8 microbatches' activations, 1F1B 4 (compiled temp)."""
    gpipe, one = (compiled_memory(built(n).step, "cpu").temp for n in ("gpipe p=4 m=8", "1f1b p=4 m=8"))
    slots = {n: built(n).strategy.program.slots["stash"] for n in ("gpipe p=4 m=8", "1f1b p=4 m=8")}
    assert slots == {"gpipe p=4 m=8": 8, "1f1b p=4 m=8": 4}
    assert gpipe > 1.6 * one


def test_split_backward_defers_only_the_weight_matmuls():
    """zb-h1's B (input gradient + taps) and W (weight gradients from the taps) add up to the full backward's
    gradients and FLOPs: W recomputes no part of the input-gradient chain."""
    config = load_config("configs/test.py")
    cfg = ModelConfig.from_config(config.model, VOCAB)
    rng = np.random.default_rng(0)
    normal = lambda shape: jnp.asarray(rng.normal(size=shape).astype(np.float32))
    weights = jax.tree.map(lambda s: 0.1 * normal(s.shape), jax.eval_shape(lambda: init_params(cfg, 0)["blocks"]))
    x, dy = normal((4, 32, cfg.d_model)), normal((4, 32, cfg.d_model))
    run = lambda ops: (lambda w, x, taps=None: run_blocks(w if taps is None else {**w, "taps": taps}, x, cfg, ops)[0])
    from jaxpar.model.ops import Ops
    sites = {}
    split_ops = deferred.deferred_ops(Ops(), sites)
    run(split_ops)(weights, x, deferred.recording_taps(deferred.deferred_names(weights)))
    taps0 = deferred.zero_taps(sites, cfg.layers)

    def full(w, x, dy):
        return jax.vjp(run(Ops()), w, x)[1](dy)

    def b_step(w, x, dy):
        dw, taps, dx = jax.vjp(lambda w, t, x: run(split_ops)(w, x, t), w, taps0, x)[1](dy)
        return {k: g for k, g in dw.items() if k not in taps}, taps, dx

    def w_step(w, taps):
        return deferred.weight_grads(Ops().matmul, sites, w, taps)

    compiled = lambda fn, *args: jax.jit(fn).lower(*args).compile(compiler_options=FAST)
    full_c, b_c = compiled(full, weights, x, dy), compiled(b_step, weights, x, dy)
    want_dw, want_dx = full_c(weights, x, dy)
    norms_dw, taps, dx = b_c(weights, x, dy)
    w_c = compiled(w_step, weights, taps)
    dw = {**norms_dw, **w_c(weights, taps)}
    np.testing.assert_allclose(np.asarray(dx), np.asarray(want_dx), rtol=1e-5, atol=1e-6)
    for name in want_dw:
        np.testing.assert_allclose(np.asarray(dw[name]), np.asarray(want_dw[name]), rtol=1e-4, atol=1e-6,
                                   err_msg=name)
    whole, b, w = (compiled_flops(c)["corrected"] for c in (full_c, b_c, w_c))
    assert b + w == pytest.approx(whole, rel=0.1)
    assert w > 0.25 * whole and b < 0.75 * whole


@pytest.mark.parametrize("name, axes, rel", [
    ("3d data=2 pipe=2 tensor=2", {"pipe", "tensor", "data"}, 0.01),
    ("sp rings: 1f1b data=2 pipe=2 tensor=2", {"pipe", "tensor", "data"}, 0.01),   # the rings send SP's bytes
    ("sp: data=2 pipe=2 tensor=2 sequence", {"pipe", "tensor", "data"}, 0.01),
    ("interleaved p=2 v=2 m=4", {"pipe"}, 0.02),                                # + the chunks' re-deal
    ("dualpipev, manual tp: fsdp=2 pipe=2 tensor=2", {"pipe", "tensor", "fsdp"}, 0.02),   # the V: 2 chunks
    ("circular p=4 m=8", {"pipe"}, 0.02),                       # + the queue's and the head's all-reduces
])
def test_executed_collectives_match_the_dry_run_formulas(built, name, axes, rel):
    """The bytes sent per axis by the stage that sends the most over it (a tick's branches counted on the ticks
    that run them) against the strategy's `predict`: the table's sends (each tick over just the pairs that
    send), Megatron's 4 all-reduces per layer per microbatch (under SP all-gathers and reduce-scatters, the
    column inputs gathered again in the backward, s/t tokens per permute), the gradients' all-reduce; with
    v > 1 the stored layers re-dealt to chunk order and back (DualPipeV's V
    counted as its 2 chunks); circular's rolls, its queue shared and its head's gradients summed over pipe."""
    from collections import defaultdict

    from jaxpar.parallel.registry import predicted_collective_bytes
    c = built(name)
    sent = defaultdict(float)
    for collective in step_collectives(c.strategy, c.step.as_text()):
        sent[collective.axis_label] += collective.bytes_per_step
    sizes = {axis: int(n) for axis, n in c.strategy.mesh.shape.items()}
    predicted = predicted_collective_bytes(c.strategy.config, c.strategy.model_cfg, sizes, "cpu")
    assert set(predicted) == axes
    for axis, want in predicted.items():
        assert sent[axis] == pytest.approx(want, rel=rel), axis


def test_ticks_send_the_compute_dtype():
    """Under bf16 compute every tick's ppermute carries bf16 [b, s, h]: the lowered program's (XLA:CPU then
    moves bf16 as fp32, `theory.wire_bytes`; a deviceless H100 compile keeps bf16 on the wire, lab 04 part f).
    How many a stage sends: the tests above."""
    import re
    strategy = make(["mesh.data=1", "mesh.pipe=2", "parallel.pipe=1f1b", "parallel.pipe_microbatches=2",
                     "train.compute_dtype=bfloat16"], 2)
    with jax.set_mesh(strategy.mesh):
        lowered = strategy.lower_step().as_text()
    wire = re.findall(r"collective_permute.*?-> tensor<([\dx]*)x(\w+)>", lowered)
    cfg = strategy.config
    shape = f"{cfg.train.batch_size // 2}x{cfg.data.seq_len}x{cfg.model.d_model}"
    assert wire and set(wire) == {(shape, "bf16")}, wire


def test_sp_rings_are_swaps_inside_every_layer_of_the_ticks(built):
    """parallel.tensor_overlap in a pipeline: every tensor collective of the stages' layers (inside the tick loop
    and the layer loop) is a ring step, an all-to-all swap; no all-gather or reduce-scatter is left there."""
    c = built("sp rings: 1f1b data=2 pipe=2 tensor=2")
    per_layer = c.strategy.program.ticks * c.strategy.chunk_layers
    layers = [x for x in hlo.collectives(c.step.as_text(), c.strategy.mesh)
              if x.axes == ("tensor",) and x.runs_per_step == per_layer]
    assert layers and {x.op for x in layers} == {"all-to-all"}, {x.op for x in layers}


def test_sp_rings_gradients_match_one_device(built):
    """Every gradient leaf of the first batch under pipe x tensor with the rings against one device's."""
    c, single = built("sp rings: 1f1b data=2 pipe=2 tensor=2"), built("single device").strategy
    s, batch = c.strategy, counting_batches(c.strategy.config, 1, VOCAB)[0]
    fast = lambda fn, *args: jax.jit(fn).lower(*args).compile(compiler_options=FAST)(*args)
    with jax.set_mesh(s.mesh):
        grads = fast(lambda p, t: s.owned.to_canonical(s._unstaged(s._grads(s._staged(p), t)[2])),
                     c.initial["params"], jax.device_put(batch, s.batch_sharding))   # each from its owner's slot
    params = jax.device_put(s.to_canonical(c.initial)["params"], single.param_shardings)
    want = fast(jax.grad(lambda p, x: loss(p, x, single.model_cfg, single.ops)[0]), params, batch)
    for (path, got), w in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(w), rtol=1e-4, atol=1e-7,
                                   err_msg=jax.tree_util.keystr(path))


# ---------------------------------------------------------------------------- one checkpoint layout

def test_checkpoints_cross_from_pipe_to_one_device_and_back(tmp_path, built, runs):
    """A pipeline stores its embedding and head stage-owned (parallel/stage_owned.py) but saves the canonical
    layout: interleaved's state restores on one device and on 1F1B, both continue alike; one device's next state
    restores on 1F1B as the very same arrays, and both continue alike again."""
    _, _, state = runs("interleaved p=2 v=2 m=4")
    interleaved, single, one_f = (built(n) for n in ("interleaved p=2 v=2 m=4", "single device", "1f1b p=4 m=8"))

    def save(strategy, state, name):
        with ocp.StandardCheckpointer() as checkpointer:
            checkpointer.save(tmp_path / name, strategy.to_canonical(state))

    def restore(name, target):
        with ocp.StandardCheckpointer() as checkpointer:
            return target.from_canonical(checkpointer.restore(tmp_path / name, target.canonical_abstract_state))

    save(interleaved.strategy, state, "a")
    saved = jax.device_get(interleaved.strategy.to_canonical(state))
    on_single, on_1f1b = (restore("a", t.strategy) for t in (single, one_f))
    for got in (on_single, one_f.strategy.to_canonical(on_1f1b)):
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(saved)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))   # layer order: the model's
    a, _, next_single = single.run(on_single, steps=1)
    b, _, _ = one_f.run(on_1f1b, steps=1)
    np.testing.assert_allclose(b, a, rtol=1e-5)
    save(single.strategy, next_single, "b")
    back = restore("b", one_f.strategy)                                             # and back onto the pipeline
    for got, want in zip(jax.tree.leaves(one_f.strategy.to_canonical(back)), jax.tree.leaves(next_single)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_allclose(one_f.run(back, steps=1)[0], single.run(next_single, steps=1)[0], rtol=1e-5)


def test_tied_embedding_is_summed_between_first_and_last_stage_only():
    """Tied: the first stage's lookup gradient and the last stage's head gradient meet in one exchange between
    those two stages (compiled bytes = `predict`), and 1F1B over 4 stages equals one device."""
    from collections import defaultdict

    from jaxpar.parallel.registry import predicted_collective_bytes
    tied = ["model.tie_embeddings=true"]
    single = Compiled(make(tied + ["mesh.data=1"], 1), None)
    pipe = Compiled(make(tied + ["mesh.data=1", "mesh.pipe=4", "parallel.pipe=1f1b", "parallel.pipe_microbatches=4"],
                         4), jax.device_get(single.strategy.to_canonical(single.initial)))
    (want, want_norms, _), (got, got_norms, _) = single.run(steps=3), pipe.run(steps=3)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_allclose(got_norms, want_norms, rtol=1e-5)     # the tied copy counted once
    sent = defaultdict(float)
    for collective in step_collectives(pipe.strategy, pipe.step.as_text()):
        sent[collective.axis_label] += collective.bytes_per_step
    sizes = {axis: int(n) for axis, n in pipe.strategy.mesh.shape.items()}
    predicted = predicted_collective_bytes(pipe.strategy.config, pipe.strategy.model_cfg, sizes, "cpu")
    vocab = pipe.strategy.model_cfg.vocab_size * pipe.strategy.model_cfg.d_model * 4
    assert sent["pipe"] == pytest.approx(predicted["pipe"], rel=0.01) and predicted["pipe"] > vocab


# ---------------------------------------------------------------------------- bad input

def _cli(capsys, tmp_path, *sets):
    argv = ["train", "--config", "configs/test.py", "--run-dir", str(tmp_path / "run")]
    for item in sets:
        argv += ["--set", item]
    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code
    return code, capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize("sets, field", [
    (["mesh.pipe=4", "parallel.pipe=1f1b"], "model.layers"),                                  # 2 layers, 4 stages
    (["model.layers=4", "mesh.pipe=4", "parallel.pipe=1f1b", "parallel.pipe_microbatches=2"],
     "parallel.pipe_microbatches"),                                                          # m < p
    (["model.layers=4", "mesh.pipe=2", "parallel.pipe=2f2b"], "parallel.pipe"),               # no such schedule
    (["model.layers=4", "mesh.pipe=2", "parallel.pipe=interleaved", "parallel.pipe_virtual=3"],
     "parallel.pipe_virtual"),                                                               # v does not divide
    (["model.layers=4", "mesh.pipe=2"], "parallel.pipe"),                                     # auto: not a pipeline
    (["model.layers=4", "mesh.pipe=2", "parallel.pipe=gpipe", "train.microbatches=4"],
     "parallel.pipe_microbatches"),                                                          # a·m rows > 16 / data
    (["model.layers=4", "mesh.pipe=2", "parallel.pipe=dualpipev", "parallel.pipe_microbatches=2"],
     "parallel.pipe_microbatches"),                                                          # DualPipeV: m < 2p
    (["model.layers=4", "model.kv_heads=4", "mesh.pipe=2", "mesh.tensor=4", "parallel.pipe=1f1b",
      "parallel.tensor=manual", "parallel.sequence=true", "parallel.tensor_overlap=collective_matmul"],
     "parallel.tensor_overlap"),                                                             # the swap: tensor=2
])
def test_bad_pipeline_input_exits_2_with_one_line(capsys, tmp_path, sets, field):
    code, err = _cli(capsys, tmp_path, *sets)
    assert code == 2
    assert len(err) == 1 and err[0].startswith(f"error: {field}: "), err
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------- two processes

@pytest.mark.slow
def test_1f1b_and_3d_on_two_processes_match_one_device(monkeypatch, runs, oracle):
    """1F1B with pipe=4 x tensor=2 (the pipe axis crosses the processes) and data=2 x pipe=2 x tensor=2."""
    from pipeline_worker import CASES as WORKER_CASES
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [TESTS_DIR, os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("XLA_FLAGS", " ".join(filter(None, [os.environ.get("XLA_FLAGS"),
                                                           "--xla_backend_optimization_level=0"])))
    out = io.StringIO()
    assert launch(2, 4, ["all"], module="pipeline_worker", out=out, timeout=600) == 0, out.getvalue()[-3000:]
    found = {}
    for line in out.getvalue().splitlines():
        if line.startswith("[p0] LOSSES "):
            _, _, name, values = line.split(" ", 3)
            found[name] = np.array(json.loads(values))
    assert set(found) == set(WORKER_CASES)
    for name, losses in found.items():
        np.testing.assert_allclose(losses, oracle[0], rtol=1e-4, err_msg=name)


def test_pipedream_2bw_applies_each_gradient_one_step_late():
    """W(t+1) = W(t) - lr·g(W(t-1)): the first step applies nothing, every later step the gradient before it."""
    import optax

    from jaxpar.parallel.pipedream import delayed_gradient
    optimizer = delayed_gradient(optax.sgd(0.5))
    params = {"w": jnp.ones(3)}
    state = optimizer.init(params)
    grads = [{"w": jnp.full(3, float(i + 1))} for i in range(3)]
    applied = []
    for g in grads:
        updates, state = optimizer.update(g, state, params)
        params = optax.apply_updates(params, updates)
        applied.append(float(updates["w"][0]))
    assert applied == [0.0, -0.5 * 1, -0.5 * 2]     # nothing, then gradient 1, then gradient 2
    assert build("pipedream-2bw", 4, 8).grid == build("1f1b", 4, 8).grid
