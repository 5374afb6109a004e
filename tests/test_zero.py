"""Manual DDP and ZeRO-1/2/3 (parallel/zero.py): one-device losses, the right collectives, the right shards."""
import json
from collections import defaultdict

import jax
import numpy as np
import pytest
from synthetic import counting_batches

from jaxpar.cli import main
from jaxpar.config import ConfigError, apply_overrides, load_config
from jaxpar.measure.hlo import collectives
from jaxpar.mesh import make_mesh
from jaxpar.model.transformer import ModelConfig
from jaxpar.parallel.auto import AutoStrategy
from jaxpar.parallel.zero import ZeroStrategy

STEPS = 5
VOCAB = 512
N = 8
BASE = ["train.weight_decay=0.1", "train.warmup_steps=1"]
STAGES = ("ddp", "zero1", "zero2", "zero3")


def make(overrides, devices=None, manual=True):
    config = load_config("configs/test.py")
    apply_overrides(config, BASE + overrides)
    devices = jax.devices() if devices is None else devices
    mesh = make_mesh(config, devices)
    cls = ZeroStrategy if manual else AutoStrategy
    if manual:
        cls.check(config, dict(mesh.shape))
    return cls(config, ModelConfig.from_config(config.model, VOCAB), mesh)


def zero(stage, *overrides):
    return make([f"mesh.data={N}", f"parallel.data={stage}", *overrides])


def single_device(*overrides):
    return make(["mesh.data=1", *overrides], jax.devices()[:1], manual=False)


def batches(config):
    return counting_batches(config, STEPS, VOCAB)


def run(strategy):
    state = strategy.init_state()
    losses, norms = [], []
    for batch in batches(strategy.config):
        state, metrics = strategy.step(state, jax.device_put(batch, strategy.batch_sharding))
        losses.append(float(metrics["loss"]))
        norms.append(float(metrics["grad_norm"]))
    return np.array(losses), np.array(norms), state


def compiled_step(strategy):
    with jax.set_mesh(strategy.mesh):
        return strategy.lower_step().compile()


def shard_fraction(array):
    return array.addressable_shards[0].data.size / array.size


def nbytes(tree):
    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree))


@pytest.fixture(scope="module")
def oracle():
    losses, norms, state = run(single_device())
    assert losses[-1] < losses[0]
    return losses, norms, state


@pytest.fixture(scope="module")
def strategies():
    return {stage: zero(stage) for stage in STAGES}


@pytest.fixture(scope="module")
def runs(strategies):
    """Each stage's 5-step run, made once (by whichever test asks first)."""
    cache = {}

    def get(stage):
        if stage not in cache:
            cache[stage] = run(strategies[stage])
        return cache[stage]
    return get


# ---------------------------------------------------------------------------- equivalence

@pytest.mark.parametrize("stage", STAGES)
def test_stage_matches_single_device(stage, runs, oracle):
    losses, norms, state = runs(stage)
    np.testing.assert_allclose(losses, oracle[0], rtol=1e-4)
    np.testing.assert_allclose(norms, oracle[1], rtol=1e-4)
    assert int(state["step"]) == STEPS
    for got, want in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(oracle[2]["params"])):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_clipping_microbatches_and_remat_match_single_device(stage):
    """Clipping by the *global* norm of reduce-scattered grads (it fires: grad_clip below every norm),
    gradient accumulation over microbatches (reduce-scattered in each one), and a remat policy, at once."""
    extra = ["train.grad_clip=0.05", "train.microbatches=2", "train.remat=full"]
    want, want_norms, _ = run(single_device(*extra))
    got, got_norms, _ = run(zero(stage, *extra))
    assert (want_norms > 0.05).all()
    np.testing.assert_allclose(got, want, rtol=1e-4)
    np.testing.assert_allclose(got_norms, want_norms, rtol=1e-4)


# ---------------------------------------------------------------------------- layout

def test_zero3_slices_params_and_adam_state_zero1_only_adam_state(strategies, runs):
    """The state after 5 steps (so the step keeps the layout, not only init_state)."""
    for stage, params_fraction in (("zero1", 1.0), ("zero3", 1 / N)):
        state = runs(stage)[2]
        adam = state["opt_state"][1][0]
        for leaf in jax.tree.leaves(state["params"]):
            assert shard_fraction(leaf) == params_fraction, stage
        for leaf in jax.tree.leaves((adam.mu, adam.nu)):
            assert shard_fraction(leaf) == 1 / N, stage
    state = runs("ddp")[2]
    assert all(shard_fraction(leaf) == 1.0 for leaf in jax.tree.leaves(state))
    # the split rule: the first divisible dimension, never the stacked layers axis
    dims = strategies["zero3"].dims
    assert dims["embed"] == 0 and dims["lm_head"] == 0                  # vocab (512); d_model (64)
    assert dims["blocks"]["wq"] == 1 and dims["blocks"]["w_down"] == 1  # d_model; mlp (128)
    assert dims["blocks"]["wo"] == 2                                    # heads (4) do not divide by 8: head_dim
    assert dims["blocks"]["attn_norm"] == 1


def test_checkpoints_interchange_with_the_auto_strategy(strategies):
    auto = make(["mesh.data=1", "mesh.fsdp=8"], manual=False).abstract_state
    for strategy in strategies.values():
        ours = strategy.abstract_state
        assert jax.tree.structure(ours) == jax.tree.structure(auto)
        assert jax.tree.map(lambda a: (a.shape, a.dtype), ours) == jax.tree.map(lambda a: (a.shape, a.dtype), auto)


def test_bad_manual_configs_raise_config_error():
    with pytest.raises(ConfigError) as err:
        make(["mesh.data=1", "mesh.fsdp=8", "parallel.data=zero1"])
    assert err.value.field == "parallel.data" and "parallel.data=auto" in str(err.value)
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError) as err:
        make(["mesh.data=2", "mesh.tensor=4", "model.kv_heads=4", "parallel.data=ddp"])
    assert err.value.field == "parallel.data" and "mesh.tensor=4" in str(err.value)
    # d_model=64 is not divisible by 3: the strategy refuses before anything is built
    with pytest.raises(ConfigError) as err:
        make(["mesh.data=3", "parallel.data=zero2", "train.batch_size=12"], jax.devices()[:3])
    assert err.value.field == "mesh.data" and "model.d_model=64" in str(err.value)
    make(["mesh.data=3", "parallel.data=ddp", "train.batch_size=12"], jax.devices()[:3])  # DDP splits nothing


# ---------------------------------------------------------------------------- compiled program

@pytest.fixture(scope="module")
def compiled(strategies):
    return {stage: compiled_step(t) for stage, t in strategies.items()}


def test_collectives_per_stage_match_the_theory(strategies, compiled):
    params = strategies["ddp"].abstract_state["params"]
    psi = nbytes(params)                                    # fp32 parameter bytes
    ring = (N - 1) / N
    blocks = nbytes(params["blocks"])
    L = strategies["ddp"].model_cfg.layers
    found = {s: collectives(c.as_text(), strategies[s].mesh) for s, c in compiled.items()}
    for cs in found.values():
        assert all(c.axes == ("data",) and c.trip_count_known for c in cs)

    def by_op(cs):
        out = defaultdict(float)
        for c in cs:
            out[c.op] += c.bytes_per_step
        return out

    small = 64  # bytes: the loss and grad-norm scalars
    ddp, z1, z2, z3 = (by_op(found[s]) for s in STAGES)
    assert set(ddp) == {"all-reduce"}
    assert ddp["all-reduce"] == pytest.approx(2 * ring * psi, abs=small)
    for stage, ops in (("zero1", z1), ("zero2", z2)):      # both the paper's 2Ψ: reduce-scatter + all-gather
        assert set(ops) == {"reduce-scatter", "all-gather", "all-reduce"} and ops["all-reduce"] < small, stage
        assert ops["reduce-scatter"] == pytest.approx(ring * psi) and ops["all-gather"] == pytest.approx(ring * psi)
        kept = sum(c.result_bytes * c.runs_per_step for c in found[stage] if c.op == "reduce-scatter")
        assert kept == psi / N                              # each device keeps 1/N of the gradient
    # ZeRO-1 reduce-scatters once after the backward pass; ZeRO-2 inside the backward layer loop
    assert all(c.runs_per_step == 1 for c in found["zero1"] if c.op == "reduce-scatter")
    in_loop = sum(c.result_bytes * c.runs_per_step for c in found["zero2"] if c.op == "reduce-scatter"
                  and c.runs_per_step == L)
    assert in_loop == blocks / N

    # ZeRO-3: inside the layer loops every layer's weights are gathered twice (forward, and again
    # in the backward pass) and their gradients reduce-scattered, L times each
    loops = defaultdict(lambda: defaultdict(int))
    for c in found["zero3"]:
        if c.runs_per_step == L:
            loops[c.computation][c.op] += c.result_bytes
    gathering = [ops for ops in loops.values() if ops["all-gather"]]
    assert len(gathering) == 2, dict(loops)                 # the forward loop and the backward loop
    assert all(ops["all-gather"] == blocks / L for ops in gathering)
    assert sum(ops["reduce-scatter"] for ops in loops.values()) == blocks / L / N
    outside = psi - blocks                                  # embed, final_norm, lm_head: gathered once
    assert z3["all-gather"] == pytest.approx(ring * (2 * blocks + outside))
    assert z3["reduce-scatter"] == pytest.approx(ring * psi)
    assert z3["all-reduce"] < small


def test_memory_per_device_follows_the_zero_formulas(strategies, compiled):
    """Per-device arguments: fp32 params 4Ψ, Adam m+v 8Ψ: DDP 12Ψ; ZeRO-1/2 4Ψ + 8Ψ/N; ZeRO-3 12Ψ/N."""
    psi = sum(leaf.size for leaf in jax.tree.leaves(strategies["ddp"].abstract_state["params"]))
    c = strategies["ddp"].config
    extras = c.train.batch_size // N * (c.data.seq_len + 1) * 4 + 3 * 4   # tokens, step, two Adam counts
    args = {s: compiled[s].memory_analysis().argument_size_in_bytes for s in STAGES}
    assert args["ddp"] == 12 * psi + extras
    assert args["zero1"] == args["zero2"] == 4 * psi + 8 * psi // N + extras
    assert args["zero3"] == 12 * psi // N + extras


# ---------------------------------------------------------------------------- the training loop

def test_jaxpar_train_with_zero3_checkpoints_and_samples(tmp_path, capsys):
    run_dir = tmp_path / "zero3"
    assert main(["train", "--config", "configs/test.py", "--run-dir", str(run_dir),
                 "--set", "parallel.data=zero3"]) == 0
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = {r["step"]: r["loss"] for r in records if "loss" in r}
    assert sorted(losses) == list(range(1, 9)) and losses[8] < 0.9 * losses[1]
    assert sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()) == [4, 8]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["sample"] and summary["final_val_loss"] < losses[1]
    # `jaxpar sample` restores the ZeRO-3 checkpoint with the automatic strategy on one device
    capsys.readouterr()
    assert main(["sample", "--run-dir", str(run_dir), "--max-tokens", "4"]) == 0
    assert capsys.readouterr().out.startswith("[step 8] ")


def test_dryrun_prediction_matches_each_compiled_stage(strategies, compiled):
    """ZeroStrategy.predict knows the manual stages: compiled / predicted = 1 (+ scalars)."""
    from jaxpar.parallel.registry import predicted_collective_bytes
    for stage, strategy in strategies.items():
        found = collectives(compiled[stage].as_text(), strategy.mesh)
        sizes = dict(strategy.mesh.shape)
        predicted = predicted_collective_bytes(strategy.config, strategy.model_cfg, sizes, "cpu")["data"]
        assert sum(c.bytes_per_step for c in found) == pytest.approx(predicted, abs=64), stage
