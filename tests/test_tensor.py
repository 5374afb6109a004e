"""Manual Megatron TP and TP+SP (parallel/tensor.py) on data=2 x tensor=4, TP x FSDP (torchtitan's 2D) on
data=2 x fsdp=2 x tensor=2: the single device's losses and gradients, the compiled collectives against the formula,
SP's saved activations, checkpoints, bad input."""
import json
from collections import defaultdict

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from synthetic import counting_batches

from jaxpar.cli import main
from jaxpar.config import apply_overrides, load_config
from jaxpar.labs.tensor.lab import layer_activations
from jaxpar.measure.hlo import collectives
from jaxpar.mesh import make_mesh
from jaxpar.model.transformer import ModelConfig, loss
from jaxpar.parallel.registry import make_strategy, predicted_collective_bytes, select
from jaxpar.parallel.tensor import TensorStrategy, layer_units
from jaxpar.parallel.zero import ZeroStrategy
from jaxpar.train.checkpoint import Checkpoints

STEPS = 5
VOCAB = 512
T, D = 4, 2
# kv_heads=4: tensor=4 splits every head count; grad_clip below every gradient norm: clipping by the global norm
BASE = ["model.kv_heads=4", "train.warmup_steps=1", "train.grad_clip=0.05"]
VARIANTS = {"tp": ["parallel.tensor=manual"], "sp": ["parallel.tensor=manual", "parallel.sequence=true"],
            # gradient accumulation and full remat change the program, not the numbers
            "sp-accumulate": ["parallel.tensor=manual", "parallel.sequence=true", "train.microbatches=2",
                              "train.remat=full"],
            "tp-fsdp": ["parallel.tensor=manual"]}
LAYOUTS = {"tp-fsdp": ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]}   # default: data=D x tensor=T


def configure(overrides):
    config = load_config("configs/test.py")
    apply_overrides(config, BASE + overrides)
    return config


def manual(variant, **options):
    config = configure([*LAYOUTS.get(variant, [f"mesh.data={D}", f"mesh.tensor={T}"]), *VARIANTS[variant]])
    mesh = make_mesh(config, jax.devices())
    assert select(config, dict(mesh.shape)) is TensorStrategy
    return TensorStrategy(config, ModelConfig.from_config(config.model, VOCAB), mesh, **options)


def single_device():
    config = configure(["mesh.data=1"])
    return make_strategy(config, ModelConfig.from_config(config.model, VOCAB), make_mesh(config, jax.devices()[:1]))


class Compiled:
    """A strategy with its step compiled once: run, and read (HLO)."""

    def __init__(self, strategy):
        self.strategy = strategy
        with jax.set_mesh(strategy.mesh):
            self.step = strategy.lower_step().compile()

    def run(self, state=None, steps=STEPS):
        t = self.strategy
        state = t.init_state() if state is None else state
        losses, norms = [], []
        with jax.set_mesh(t.mesh):
            for batch in counting_batches(t.config, steps, VOCAB):
                state, metrics = self.step(state, jax.device_put(batch, t.batch_sharding))
                losses.append(float(metrics["loss"]))
                norms.append(float(metrics["grad_norm"]))
        return np.array(losses), np.array(norms), state

    def collectives(self):
        return collectives(self.step.as_text(), self.strategy.mesh)


def first_batch(strategy):
    return counting_batches(strategy.config, 1, VOCAB)[0]


@pytest.fixture(scope="module")
def oracle():
    compiled = Compiled(single_device())
    losses, norms, state = compiled.run()
    assert losses[-1] < losses[0] and (norms > 0.05).all()
    t = compiled.strategy
    params = t.init_state()["params"]
    grads = jax.jit(jax.grad(lambda p, x: loss(p, x, t.model_cfg, t.ops)[0]))(params, first_batch(t))
    return {"compiled": compiled, "losses": losses, "norms": norms, "state": state, "grads": grads}


@pytest.fixture(scope="module")
def built():
    cache = {}

    def get(variant):
        if variant not in cache:
            compiled = Compiled(manual(variant))
            cache[variant] = (compiled, compiled.run())
        return cache[variant]
    return get


# ---------------------------------------------------------------------------- equivalence

@pytest.mark.parametrize("variant", ["tp", "sp", "sp-accumulate", "tp-fsdp"])
def test_matches_single_device(variant, built, oracle):
    """Five steps' losses and gradient norms, the params after them, and every gradient of one batch."""
    compiled, (losses, norms, state) = built(variant)
    np.testing.assert_allclose(losses, oracle["losses"], rtol=1e-4)
    np.testing.assert_allclose(norms, oracle["norms"], rtol=1e-4)
    assert int(state["step"]) == STEPS
    for got, want in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(oracle["state"]["params"])):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-3, atol=1e-5)
    t = compiled.strategy
    if variant != "sp-accumulate":   # (its gradient is sp's summed over two microbatches: one compile saved)
        params = t.init_state()["params"]
        with jax.set_mesh(t.mesh):
            _, grads = t.grad_fn(params, jax.device_put(first_batch(t), t.batch_sharding))
        flat = jax.tree_util.tree_leaves_with_path(grads)
        for (path, got), want in zip(flat, jax.tree.leaves(oracle["grads"])):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-7,
                                       err_msg=jax.tree_util.keystr(path))
    # the stored layout: Megatron's splits over tensor (and d_model over fsdp), replicated over data
    wq, tp, fsdp = state["params"]["blocks"]["wq"], t.mesh.shape["tensor"], t.mesh.shape["fsdp"]
    assert wq.sharding.shard_shape(wq.shape) == (wq.shape[0], wq.shape[1] // fsdp, wq.shape[2] // tp, wq.shape[3])
    norm = state["params"]["blocks"]["attn_norm"]
    assert norm.sharding.shard_shape(norm.shape) == norm.shape


# ---------------------------------------------------------------------------- compiled program

def by_op(found, loop_runs=None):
    out = defaultdict(float)
    for c in found:
        if loop_runs is None or c.runs_per_step == loop_runs:
            out[(c.op, c.axis_label)] += c.bytes_per_step
    return dict(out)


def test_automatic_tp_sends_the_manual_bytes(built):
    """Automatic TP (parallel/auto.py's `Copies`) sends manual Megatron's bytes over `tensor` on the same layout:
    in the layer loops the same 4 all-reduces' bytes (without the copies XLA:CPU reduces the q/k/v and gate/up
    input gradients one by one: 7), the whole step within the loss's small reductions, both as predicted."""
    manual_step = built("tp")[0]
    config = configure([f"mesh.data={D}", f"mesh.tensor={T}"])
    auto_step = Compiled(make_strategy(config, ModelConfig.from_config(config.model, VOCAB),
                                       make_mesh(config, jax.devices())))
    L = config.model.layers
    auto_found, manual_found = auto_step.collectives(), manual_step.collectives()
    in_layers = [{op: sent for op, sent in by_op(found, loop_runs=L).items() if op[1] == "tensor"}
                 for found in (auto_found, manual_found)]
    assert in_layers[0] == in_layers[1] and in_layers[0]
    auto_tensor, manual_tensor = (by_op(found)[("all-reduce", "tensor")] for found in (auto_found, manual_found))
    assert auto_tensor == pytest.approx(manual_tensor, rel=1e-3)
    t = auto_step.strategy
    assert auto_tensor == pytest.approx(
        predicted_collective_bytes(t.config, t.model_cfg, dict(t.mesh.shape), "cpu")["tensor"], rel=1e-2)


@pytest.mark.parametrize("variant", ["tp", "sp"])
def test_collective_bytes_match_the_formula(variant, built):
    compiled, _ = built(variant)
    t = compiled.strategy
    found = compiled.collectives()
    assert all(c.trip_count_known and c.axes in (("tensor",), ("data",)) for c in found)
    total = defaultdict(float)
    for c in found:
        total[c.axis_label] += c.bytes_per_step
    predicted = predicted_collective_bytes(t.config, t.model_cfg, dict(t.mesh.shape), "cpu")
    assert total == pytest.approx(predicted, rel=1e-9)

    L, b, s, h = t.model_cfg.layers, t.config.train.batch_size // D, t.config.data.seq_len, t.model_cfg.d_model
    u = (T - 1) / T * 4 * b * s * h
    layers = by_op(found, loop_runs=L)           # the collectives inside the layer loops
    full = (b, s, h)
    if variant == "tp":
        # 4 all-reduces of b·s·h per layer: 2 in the forward loop, 2 in the backward loop
        assert layers == {("all-reduce", "tensor"): pytest.approx(L * 8 * u)}
        in_loops = [c for c in found if c.runs_per_step == L]
        assert len(in_loops) == 4 and all(c.shapes == (("f32", full),) for c in in_loops)
    else:
        # no all-reduce of activations left: all-gathers of [b, s, h], reduce-scatters down to [b, s/t, h]
        assert set(layers) == {("all-gather", "tensor"), ("reduce-scatter", "tensor")}
        assert layers[("reduce-scatter", "tensor")] == pytest.approx(L * 4 * u)        # TP's 4 halves
        assert layers[("all-gather", "tensor")] == pytest.approx(L * (4 + 2) * u)      # + the 2 re-gathers
        assert layer_units("none", True, regather=True) == 10
        assert all(c.shapes == (("f32", (b, s // T, h)),) for c in found if c.op == "reduce-scatter")
        assert not [c for c in found if c.op == "all-reduce" and c.axes == ("tensor",)
                    and any(len(dims) == 3 for _, dims in c.shapes)]
    # one DDP all-reduce of the local fp32 gradient over data, once per step
    data = [c for c in found if c.axes == ("data",) and c.result_bytes > 64]
    assert len(data) == 1 and data[0].runs_per_step == 1


def test_fsdp_gathers_each_layer_where_it_runs_and_sends_the_predicted_bytes(built):
    """TP x FSDP: the weights' all-gathers over fsdp run inside the layer loops (forward and the backward's
    re-gather), their gradients reduce-scatter there; bytes per axis as `manual_tensor_bytes` predicts."""
    compiled, _ = built("tp-fsdp")
    t = compiled.strategy
    found = compiled.collectives()
    L = t.model_cfg.layers
    in_loops = {c.op for c in found if c.axes == ("fsdp",) and c.runs_per_step == L}
    assert {"all-gather", "reduce-scatter"} <= in_loops
    total = defaultdict(float)
    for c in found:
        total[c.axis_label] += c.bytes_per_step
    predicted = predicted_collective_bytes(t.config, t.model_cfg, dict(t.mesh.shape), "cpu")
    assert set(predicted) == {"tensor", "fsdp", "data"}
    for axis, value in predicted.items():    # the loss and norm scalars reduce over two axes at once: 4-8 bytes
        assert total[axis] == pytest.approx(value, rel=1e-4), axis


def test_sp_keeps_a_t_th_of_the_sequence_region():
    """The activations SP splits (norm inputs and outputs, residual stream) are 1/t of TP's per layer;
    the attention and MLP ones are the same. Keeping the gathered matmul inputs loses part of it."""
    tp, sp, kept = (layer_activations(t) for t in (manual("tp"), manual("sp"), manual("sp", regather=False)))
    assert tp["sequence_region"] > 0 and tp["tensor_region"] > 0
    assert sp["sequence_region"] * T == tp["sequence_region"]
    assert sp["tensor_region"] == kept["tensor_region"] == tp["tensor_region"]
    assert kept["sequence_region"] > 1.9 * sp["sequence_region"]


# ---------------------------------------------------------------------------- checkpoints

def test_checkpoint_restores_with_the_auto_strategy_on_one_device(tmp_path, built, oracle):
    compiled, (losses, _, state) = built("tp")
    checkpoints = Checkpoints(tmp_path / "checkpoints", 1)
    checkpoints.manager.save(STEPS, args=ocp.args.Composite(state=ocp.args.StandardSave(state)))  # no data iterator
    checkpoints.close()
    single = oracle["compiled"]
    step, restored = Checkpoints(tmp_path / "checkpoints", 1).restore(single.strategy.abstract_state)
    assert step == STEPS
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
        assert got.sharding.num_devices == 1
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # the next step from the restored state, on one device, continues the manual run
    next_single, _, _ = single.run(restored, steps=1)
    next_manual, _, _ = compiled.run(state, steps=1)
    np.testing.assert_allclose(next_single, next_manual, rtol=1e-5)


# ---------------------------------------------------------------------------- bad input

def test_registry_choices():
    sizes = {"data": 2, "fsdp": 1, "pipe": 1, "expert": 1, "tensor": 4}
    assert select(configure(["parallel.tensor=manual", "parallel.data=ddp"]), sizes) is TensorStrategy
    assert select(configure(["parallel.data=ddp"]), {**sizes, "tensor": 1}) is ZeroStrategy


@pytest.mark.parametrize("extra, field", [
    (["parallel.sequence=true", "mesh.tensor=4"], "parallel.sequence"),                      # SP without manual TP
    (["parallel.sequence=true", "parallel.tensor=manual"], "parallel.sequence"),             # SP with tensor=1
    (["parallel.sequence=true", "parallel.tensor=manual", "mesh.tensor=4", "data.seq_len=30"], "data.seq_len"),
    (["parallel.tensor=manual", "mesh.tensor=8", "mesh.data=1"], "model.heads"),
    (["parallel.tensor=manual", "mesh.tensor=4", "model.kv_heads=2"], "model.kv_heads"),
    (["parallel.tensor=manual", "mesh.tensor=4", "model.mlp_dim=130"], "model.mlp_dim"),
    (["parallel.tensor=manual", "mesh.tensor=4", "model.vocab_size=1030"], "model.vocab_size"),
    (["parallel.tensor=manual", "mesh.tensor=2", "mesh.expert=2", "model.moe.experts=4"],
     "parallel.expert"),                                                   # the experts' exchange left to XLA
    (["parallel.expert=manual", "parallel.data=ddp", "model.moe.experts=4"],
     "parallel.tensor"),                                                   # manual expert + DDP only under manual TP
    (["parallel.tensor=manual", "mesh.tensor=4", "parallel.data=zero1"], "parallel.data"),
    (["parallel.tensor=manual", "mesh.tensor=4", "parallel.rules=length=tensor"], "parallel.rules"),
    (["parallel.tensor=megatron"], "parallel.tensor"),
])
def test_bad_input_exits_2_with_one_line(capsys, tmp_path, extra, field):
    argv = ["train", "--config", "configs/test.py", "--run-dir", str(tmp_path / "run"), "--set", "model.kv_heads=4"]
    for item in extra:
        argv += ["--set", item]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {field}: "), err
    assert not (tmp_path / "run").exists()


def test_jaxpar_train_with_sequence_parallelism_then_sample_on_one_device(tmp_path, capsys):
    """The training loop runs the manual strategy (steps, evaluation, checkpoint); `jaxpar sample` restores
    the checkpoint with the automatic strategy on one device."""
    run_dir = tmp_path / "sp"
    sets = ["model.kv_heads=4", f"mesh.tensor={T}", "parallel.tensor=manual", "parallel.sequence=true",
            "train.steps=2", "train.eval_every=2", "train.checkpoint_every=2", "train.sample_tokens=0"]
    assert main(["train", "--config", "configs/test.py", "--run-dir", str(run_dir),
                 *[arg for item in sets for arg in ("--set", item)]]) == 0
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2]
    assert any("val_loss" in r for r in records)
    capsys.readouterr()
    assert main(["sample", "--run-dir", str(run_dir), "--max-tokens", "2"]) == 0
    assert capsys.readouterr().out.startswith("[step 2] ")


def test_lab_bad_input_exits_2_before_anything_is_written(capsys, tmp_path):
    for flags, field in ((["--steps", "0"], "--steps"), (["--tensor", "3"], "--tensor"),
                         (["--set", "data.seq_len=30"], "data.seq_len")):
        argv = ["lab", "tensor", "--config", "configs/test.py", "--set", "model.kv_heads=4",
                "--out", str(tmp_path / "lab"), *flags]
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: {field}: "), err
        assert not (tmp_path / "lab").exists()
