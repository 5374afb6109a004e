"""DDP / ZeRO-2 gradient buckets (parallel/buckets.py): one device's losses, gradient norms and parameters on
8 devices, one flat collective per bucket inside the backward layer loop, and the predicted bytes."""
import jax
import numpy as np
import pytest
from synthetic import build_strategy_for, run_counting_steps

from jaxpar.config import ConfigError, apply_overrides, load_config, validate
from jaxpar.measure.hlo import collectives
from jaxpar.parallel.registry import predicted_collective_bytes

VOCAB = 512
N, BUCKETS = 8, 3
BASE = ["train.warmup_steps=1", "train.grad_clip=0.05", "model.layers=6"]
REDUCE = {"ddp": "all-reduce", "zero2": "reduce-scatter"}


def _strategy(overrides, devices):
    return build_strategy_for(BASE, overrides, devices, VOCAB)


def _run(strategy, start=None, steps=2):
    return run_counting_steps(strategy, VOCAB, steps, start)


@pytest.fixture(scope="module")
def oracle():
    one = _strategy(["mesh.data=1"], 1)
    start = jax.device_get(one.init_state())
    return (*_run(one, start), start)


@pytest.mark.parametrize("stage, micro", [("ddp", 2), ("zero2", 1)])
def test_buckets_match_one_device_and_reduce_inside_the_backward(stage, micro, oracle):
    strategy = _strategy([f"mesh.data={N}", f"parallel.data={stage}", f"parallel.grad_buckets={BUCKETS}",
                          f"train.microbatches={micro}"], N)
    losses, norms, state, step = _run(strategy, oracle[4])
    np.testing.assert_allclose(losses, oracle[0], rtol=1e-4)
    np.testing.assert_allclose(norms, oracle[1], rtol=1e-4)              # the global gradient norm
    for got, want in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(oracle[2]["params"])):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-3, atol=1e-5)

    found = collectives(step.as_text(), strategy.mesh)
    # the layers' gradient: ONE flat collective per bucket, carrying a bucket's share of it; buckets 2..B inside
    # the backward loop over the buckets (B-1 trips per microbatch). Bucket 1's, last, follows the loop (XLA
    # may merge it with the embedding's and head's: not counted here)
    blocks = sum(leaf.size * 4 for leaf in jax.tree.leaves(state["params"]["blocks"]))
    kept = blocks / BUCKETS / (N if stage == "zero2" else 1)             # what a device keeps of one bucket
    in_loop = [c.result_bytes for c in found if c.op == REDUCE[stage] and c.runs_per_step == (BUCKETS - 1) * micro]
    assert in_loop == [kept], [(c.op, c.runs_per_step, c.result_bytes) for c in found]
    # compiled = predicted (+ the loss and norm scalars): ZeRO-2's bytes without buckets, DDP's once per microbatch
    predicted = predicted_collective_bytes(strategy.config, strategy.model_cfg, dict(strategy.mesh.shape), "cpu")
    assert sum(c.bytes_per_step for c in found) == pytest.approx(predicted["data"], abs=64)


@pytest.mark.parametrize("overrides, words", [
    (["parallel.data=ddp", "parallel.grad_buckets=3"], "divides model.layers=2"),
    (["parallel.data=ddp", "parallel.grad_buckets=-1"], "valid: 0"),
    (["parallel.data=zero3", "parallel.grad_buckets=2"], "parallel.data=zero3"),
    (["parallel.data=ddp", "parallel.grad_buckets=2", "model.moe.experts=4"], "model.moe.experts=4"),
])
def test_bad_grad_buckets_is_one_line(overrides, words):
    config = load_config("configs/test.py")
    apply_overrides(config, ["mesh.data=-1", *overrides])
    with pytest.raises(ConfigError, match="parallel.grad_buckets") as err:
        validate(config, 8)
    assert words in str(err.value) and "\n" not in str(err.value)
