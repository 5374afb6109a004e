"""The MoE layer on one device: dispatch against a per-token reference, capacity and dropping, the
routers (the aux loss reaches the router, the aux-free bias steers selection only, noisy gating is
training-only), parameter counts, bad input, and telemetry in metrics.jsonl."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from synthetic import counting_batches

from jaxpar.cli import main
from jaxpar.config import apply_overrides, load_config, validate
from jaxpar.mesh import make_mesh
from jaxpar.model import moe
from jaxpar.model.counting import param_count
from jaxpar.model.ops import Ops
from jaxpar.model.transformer import ModelConfig, cross_entropy_and_aux, forward, init_params, loss
from jaxpar.parallel.registry import make_strategy
from jaxpar.train.sample import generate

VOCAB = 512
MOE = ["model.moe.experts=8", "model.moe.top_k=2"]


def model(*overrides):
    config = load_config("configs/test.py")
    apply_overrides(config, [*MOE, "mesh.data=1", *overrides])
    cfg = ModelConfig.from_config(config.model, VOCAB)
    return config, cfg, init_params(cfg, 0), jnp.asarray(counting_batches(config, 1, VOCAB)[0])


def layer(params, index=0):
    return jax.tree.map(lambda a: a[index], params["moe_blocks"])


def per_token_reference(x, ids, gates, w):
    """Σ_j gate_j · SwiGLU_{ids_j}(x), token by token in numpy float64: the definition dispatch must reproduce."""
    w = {k: np.asarray(v, np.float64) for k, v in w.items()}
    out = np.zeros(x.shape, np.float64)
    for t in range(x.shape[0]):
        for e, g in zip(ids[t], gates[t]):
            gate, up = x[t] @ w["expert_gate"][e], x[t] @ w["expert_up"][e]
            out[t] += g * ((gate / (1 + np.exp(-gate)) * up) @ w["expert_down"][e])
    return out


def routed_inputs(cfg, params, tokens_shape=(4, 16), seed=0):
    w = layer(params)
    x = jax.random.normal(jax.random.key(seed), (*tokens_shape, cfg.d_model))
    _, _, ids, gates = jax.jit(moe.route, static_argnums=2)(x, w, cfg.moe)
    return x, ids, gates, moe.expert_weights(w)


def dispatch(x, ids, gates, w, moe_cfg):
    return jax.jit(moe.routed_experts, static_argnums=(4, 5))(x, ids, gates, w, moe_cfg, Ops())


def test_dropless_dispatch_matches_the_per_token_definition():
    _, cfg, params, _ = model()
    x, ids, gates, w = routed_inputs(cfg, params)
    y, kept = dispatch(x, ids, gates, w, cfg.moe)
    want = per_token_reference(np.asarray(x, np.float64).reshape(-1, cfg.d_model), np.asarray(ids).reshape(-1, 2),
                               np.asarray(gates, np.float64).reshape(-1, 2), w)
    np.testing.assert_allclose(np.asarray(y).reshape(want.shape), want, rtol=1e-4, atol=1e-6)
    assert bool(kept.all())


def test_capacity_dispatch_drops_past_capacity_and_passes_dropped_tokens_through():
    _, cfg, params, _ = model("model.moe.dispatch=capacity", "model.moe.capacity_factor=0.5")
    x, ids, gates, w = routed_inputs(cfg, params)
    y, kept = dispatch(x, ids, gates, w, cfg.moe)
    ids_np, kept_np = np.asarray(ids), np.asarray(kept)
    C = cfg.moe.capacity(16)                                    # one group = one sequence of 16 tokens
    assert C == 2 and 0 < kept_np.mean() < 1
    for g in range(4):                                          # first choices before second, earlier first
        for e in range(8):
            order = [(j, s) for j in range(2) for s in range(16) if ids_np[g, s, j] == e]
            assert [kept_np[g, s, j] for j, s in order] == [i < C for i in range(len(order))]
    want = per_token_reference(np.asarray(x, np.float64).reshape(-1, cfg.d_model), ids_np.reshape(-1, 2),
                               (np.asarray(gates, np.float64) * kept_np).reshape(-1, 2), w)
    np.testing.assert_allclose(np.asarray(y).reshape(want.shape), want, rtol=1e-4, atol=1e-6)
    fully_dropped = ~kept_np.any(-1)
    assert fully_dropped.any() and np.all(np.asarray(y)[fully_dropped] == 0)   # the residual carries them

    _, big, _, _ = model("model.moe.dispatch=capacity", "model.moe.capacity_factor=8.0")   # nothing dropped
    y_big, kept_big = dispatch(x, ids, gates, w, big.moe)
    y_dropless, _ = dispatch(x, ids, gates, w, model()[1].moe)
    assert bool(kept_big.all())
    np.testing.assert_allclose(np.asarray(y_big), np.asarray(y_dropless), rtol=1e-5, atol=1e-6)


def test_capacity_groups_are_whole_sequences():
    """group_sequences=2 counts capacity over pairs of sequences: more slots per group, fewer drops."""
    _, one, params, _ = model("model.moe.dispatch=capacity", "model.moe.capacity_factor=0.5")
    _, two, _, _ = model("model.moe.dispatch=capacity", "model.moe.capacity_factor=0.5", "model.moe.group_sequences=2")
    x, ids, gates, w = routed_inputs(one, params)
    _, kept_one = dispatch(x, ids, gates, w, one.moe)
    _, kept_two = dispatch(x, ids, gates, w, two.moe)
    assert two.moe.capacity(32) == 2 * one.moe.capacity(16)
    # a group of two sequences is not the same as each sequence alone
    assert not np.array_equal(np.asarray(kept_one), np.asarray(kept_two))
    _, kept_pair = dispatch(x[:2], ids[:2], gates[:2], w, two.moe)
    np.testing.assert_array_equal(np.asarray(kept_two)[:2], np.asarray(kept_pair))


@pytest.fixture(scope="module")
def grouped_capacity():
    """Capacity dispatch counted over pairs of sequences, tight enough that tokens compete for slots."""
    return model("model.moe.dispatch=capacity", "model.moe.capacity_factor=0.5", "model.moe.group_sequences=2")


def test_decoding_a_single_sequence_with_grouped_capacity(grouped_capacity):
    """group_sequences=2 trains on pairs of sequences; a decode buffer holds one (it crashed: 0 groups)."""
    _, cfg, params, tokens = grouped_capacity
    new = generate(params, cfg, [int(t) for t in tokens[0, :5]], 4, buffer_len=16, temperature=0.8, top_k=20)
    assert len(new) == 4 and all(0 <= t < VOCAB for t in new)


def test_padding_after_the_cursor_takes_no_expert_slot(grouped_capacity):
    """Under capacity dispatch the logits at the cursor are those of the real tokens alone, whatever the
    buffer's length (the padding after the cursor took expert slots from them)."""
    _, cfg, params, tokens = grouped_capacity
    cursor = 12
    at_cursor = jax.jit(lambda buf: forward(params, buf, cfg, moe.decode_ops(cursor))[0][0, cursor - 1])
    alone = np.asarray(at_cursor(tokens[:1, :cursor]))                      # no padding at all
    padded = np.asarray(at_cursor(jnp.zeros((1, 32), jnp.int32).at[0, :cursor].set(tokens[0, :cursor])))
    np.testing.assert_allclose(padded, alone, rtol=0, atol=1e-5)


def aux_gradients(moe_cfg, w, x):
    """d(moe_balance_loss, moe_z_loss of one MoE layer)/d(router weights): [2, D, E]."""
    def losses(router):
        _, aux = moe.moe_feed_forward(x, {**w, "router": router}, moe_cfg, Ops())
        return jnp.stack([aux["moe_balance_loss"], aux["moe_z_loss"]])
    return np.asarray(jax.jit(jax.jacrev(losses))(w["router"]))


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_aux_loss_gradient_reaches_the_router(router):
    _, cfg, params, _ = model(f"model.moe.router={router}", "model.moe.balance_loss=0.1", "model.moe.z_loss=0.01")
    w = layer(params)
    x = jax.random.normal(jax.random.key(0), (4, 16, cfg.d_model))
    balance, z = aux_gradients(cfg.moe, w, x)
    assert np.abs(balance).max() > 1e-6 and np.abs(z).max() > 1e-6
    _, off, _, _ = model(f"model.moe.router={router}", "model.moe.balance_loss=0", "model.moe.z_loss=0")
    assert np.abs(aux_gradients(off.moe, w, x)).max() == 0


def test_aux_free_bias_changes_selection_not_gradients():
    _, cfg, params, _ = model("model.moe.router=sigmoid")
    w = layer(params)
    x = jax.random.normal(jax.random.key(1), (4, 16, cfg.d_model))
    cotangent = jax.random.normal(jax.random.key(2), x.shape)

    @jax.jit
    def value_and_grads(w):           # a loss through the layer's output, as the model's would be
        y, aux = moe.moe_feed_forward(x, w, cfg.moe, Ops())
        return jnp.sum(y * cotangent) + aux["moe_z_loss"]
    objective = jax.value_and_grad(value_and_grads)

    value, grads = objective(w)
    assert np.all(np.asarray(grads["router_bias"]) == 0)                        # no gradient reaches the bias
    shifted_value, shifted_grads = objective({**w, "router_bias": w["router_bias"] + 3.0})   # same ranking
    assert float(shifted_value) == float(value)
    jax.tree.map(np.testing.assert_array_equal, shifted_grads, grads)           # the bias never enters a gate

    favour = np.zeros(cfg.moe.experts, np.float32)
    favour[5] = 10.0                                                            # expert 5 wins every token
    route = jax.jit(moe.route, static_argnums=2)
    _, _, ids, gates = route(x, {**w, "router_bias": favour}, cfg.moe)
    _, _, plain_ids, _ = route(x, w, cfg.moe)
    assert np.all(np.asarray(ids)[..., 0] == 5) and not np.all(np.asarray(plain_ids)[..., 0] == 5)
    scores = jax.nn.sigmoid(jnp.einsum("bsd,de->bse", x, w["router"]))
    chosen = jnp.take_along_axis(scores, ids, axis=-1)
    np.testing.assert_allclose(np.asarray(gates), np.asarray(chosen / chosen.sum(-1, keepdims=True)), rtol=1e-6)
    different_value, _ = objective({**w, "router_bias": jnp.asarray(favour)})
    assert float(different_value) != float(value)                               # a new selection changes the output


def test_aux_free_bias_moves_against_the_observed_load_after_each_step():
    config, cfg, _, _ = model("model.moe.router=sigmoid", "model.moe.bias_rate=0.01", "train.weight_decay=0.5",
                              "train.warmup_steps=1", "model.layers=1")
    strategy = make_strategy(config, cfg, make_mesh(config, jax.devices()[:1]))
    state = strategy.init_state()
    for batch in counting_batches(config, 2, VOCAB):
        before = np.asarray(state["params"]["moe_blocks"]["router_bias"])
        state, metrics = strategy.step(state, jax.device_put(batch, strategy.batch_sharding))
        routed = np.asarray(metrics["moe_routed"])
        gap = routed.mean(-1, keepdims=True) - routed
        want = before + 0.01 * np.where(np.abs(gap) <= moe.TIE, 0.0, np.sign(gap))
        np.testing.assert_allclose(np.asarray(state["params"]["moe_blocks"]["router_bias"]), want, atol=1e-7)
    assert np.abs(want).max() > 0                                               # it did move


def test_aux_free_bias_stays_at_a_tie_whatever_the_rounding():
    """Two layouts sum one expert's count in different orders: at a tie the loads differ by an ulp, not a sign."""
    quarter = np.float32(0.25)
    up, down = np.nextafter(quarter, np.float32(1)), np.nextafter(quarter, np.float32(0))
    tied = jnp.asarray([[quarter, up, down, quarter], [down, down, up, up]], jnp.float32)
    np.testing.assert_array_equal(np.asarray(moe.bias_update(tied, 0.01)), 0.0)
    one_assignment = np.float32(1 / 4096)                        # a real difference: one of 4096 assignments
    moved = jnp.asarray([[quarter + one_assignment, quarter - one_assignment, quarter, quarter]], jnp.float32)
    np.testing.assert_allclose(np.asarray(moe.bias_update(moved, 0.01)), [[-0.01, 0.01, 0.0, 0.0]])


def test_noisy_gating_is_off_in_evaluation():
    _, cfg, params, tokens = model("model.moe.router=noisy", "model.layers=1")
    loud = {**params, "moe_blocks": {**params["moe_blocks"],
                                     "router_noise": params["moe_blocks"]["router_noise"] + 5.0}}
    _, softmax_cfg, _, _ = model("model.moe.router=softmax", "model.layers=1")
    plain = {**params, "moe_blocks": {k: v for k, v in params["moe_blocks"].items() if k != "router_noise"}}
    evaluate = jax.jit(lambda p, c: cross_entropy_and_aux(p, tokens, c)[0], static_argnums=1)
    train_ce = jax.jit(lambda p, c: loss(p, tokens, c)[1]["ce_loss"], static_argnums=1)
    # evaluation: the noise weights do not matter, and it is the plain softmax router
    assert float(evaluate(loud, cfg)) == float(evaluate(params, cfg)) == float(evaluate(plain, softmax_cfg))
    # training: noise is drawn, it depends on the noise weights, and it is the same for the same batch
    assert float(train_ce(loud, cfg)) != float(train_ce(params, cfg))
    assert float(train_ce(params, cfg)) != float(evaluate(params, cfg))
    assert float(train_ce(loud, cfg)) == float(train_ce(loud, cfg))


def test_noise_follows_the_sequence_not_its_place_in_the_batch():
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, (4, 32)), jnp.int32)
    seeds = moe.noise_seeds(tokens)
    assert len(set(np.asarray(seeds).tolist())) == 4
    np.testing.assert_array_equal(np.asarray(moe.noise_seeds(tokens[::-1])), np.asarray(seeds)[::-1])


def allocated(params) -> int:
    return sum(int(np.prod(a.shape)) for a in jax.tree.leaves(params))


@pytest.mark.parametrize("overrides", [
    [],
    ["model.moe.router=noisy"],
    ["model.moe.router=sigmoid", "model.moe.dense_layers=1", "model.moe.shared_experts=2",
     "model.moe.expert_mlp_dim=32"],
])
def test_param_count_is_what_is_allocated(overrides):
    _, cfg, params, _ = model(*overrides)
    counts = param_count(cfg)
    assert counts["total"] == allocated(params)
    experts = sum(int(np.prod(params["moe_blocks"][k].shape)) for k in ("expert_gate", "expert_up", "expert_down"))
    assert counts["experts"] == experts
    assert counts["active"] == counts["total"] - experts * 6 // 8          # k=2 of 8 experts used per token


def test_preset_shapes_have_the_published_sizes():
    mixtral = ModelConfig.from_config(load_config("configs/mixtral_8x7b.py").model)
    counts = param_count(mixtral)
    assert counts["total"] == 46_702_792_704                                # transformers' Mixtral-8x7B-v0.1
    assert round(counts["active"] / 1e9, 1) == 12.9
    deepseek = param_count(ModelConfig.from_config(load_config("configs/deepseek_moe_16b.py").model))
    assert round(deepseek["total"] / 1e9, 1) == 16.4 and round(deepseek["active"] / 1e9, 1) == 2.8


@pytest.mark.parametrize("path", ["configs/mixtral_tiny.py", "configs/deepseek_moe_tiny.py",
                                  "configs/mixtral_8x7b.py", "configs/deepseek_moe_16b.py"])
def test_moe_presets_validate(path):
    validate(load_config(path), 64 if path.endswith(("7b.py", "16b.py")) else 8)


@pytest.mark.parametrize("extra, field", [
    (["--set", "model.moe.experts=6", "--set", "mesh.expert=4", "--set", "mesh.data=2"], "model.moe.experts"),
    (["--set", "model.moe.top_k=9"], "model.moe.top_k"),
    (["--set", "model.moe.capacity_factor=0"], "model.moe.capacity_factor"),
    (["--set", "model.moe.shared_experts=1"], "model.moe.shared_experts"),
    (["--set", "model.moe.router=hash"], "model.moe.router"),
    (["--set", "model.moe.dispatch=sinkhorn"], "model.moe.dispatch"),
    (["--set", "model.moe.dense_layers=2"], "model.moe.dense_layers"),
    (["--set", "model.moe.dispatch=capacity", "--set", "model.moe.group_sequences=3"], "model.moe.group_sequences"),
    (["--set", "model.moe.experts=0", "--set", "mesh.expert=8", "--set", "mesh.data=1"], "mesh.expert"),
    (["--set", "model.moe.experts=0", "--set", "parallel.expert=manual"], "parallel.expert"),
    (["--set", "mesh.tensor=2", "--set", "mesh.expert=2", "--set", "mesh.data=2", "--set", "parallel.tensor=manual"],
     "parallel.expert"),                                           # manual TP exchanges over expert by hand only
    (["--set", "parallel.expert_exchange=sparse"], "parallel.expert_exchange"),
    (["--set", "mesh.expert=8", "--set", "mesh.data=1", "--set", "parallel.expert=manual",
      "--set", "parallel.expert_exchange=ragged"], "parallel.expert_exchange"),     # XLA:CPU has no ragged all-to-all
])
def test_bad_moe_input_is_one_line_exit_2(capsys, tmp_path, extra, field):
    argv = ["train", "--config", "configs/test.py", "--run-dir", str(tmp_path / "run"), *(f for o in MOE for f in
            ("--set", o)), *extra]
    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith(f"error: {field}: "), err
    assert not (tmp_path / "run").exists()


def test_telemetry_per_layer_and_expert_in_metrics_jsonl(tmp_path):
    run_dir = tmp_path / "run"
    assert main(["train", "--config", "configs/test.py", "--run-dir", str(run_dir), "--set", "train.steps=3",
                 "--set", "train.sample_tokens=0", "--set", "model.moe.experts=8",
                 "--set", "model.moe.dispatch=capacity", "--set", "model.moe.capacity_factor=1.0",
                 "--set", "model.moe.dense_layers=1", "--set", "model.layers=3"]) == 0
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]                              # log_every=1: every step
    for r in steps:
        assert np.asarray(r["moe_routed"]).shape == (2, 8)                      # 2 MoE layers x 8 experts
        assert np.allclose(np.sum(r["moe_routed"], axis=1), 1.0)
        assert np.asarray(r["moe_dropped"]).shape == (2, 8) and 0 < np.sum(r["moe_dropped"]) < 2
        assert len(r["moe_entropy"]) == 2 and all(0 < h <= np.log(8) + 1e-5 for h in r["moe_entropy"])
        assert r["moe_balance_loss"] > 0 and r["moe_z_loss"] > 0 and len(r["moe_balance"]) == 2
        assert r["loss"] == pytest.approx(r["ce_loss"] + r["moe_balance_loss"] + r["moe_z_loss"], rel=1e-5)
