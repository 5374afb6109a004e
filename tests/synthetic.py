"""Learnable synthetic batches for strategy tests: fast to make, and a model can fit them."""
import numpy as np


def counting_batches(config, steps: int, vocab: int, seed: int = 0) -> list[np.ndarray]:
    """[batch, seq_len + 1] int32 batches; each row counts up by a row-specific stride from a random start."""
    rng = np.random.default_rng(seed)
    rows, length = config.train.batch_size, config.data.seq_len + 1
    out = []
    for _ in range(steps):
        start = rng.integers(0, vocab, (rows, 1))
        stride = rng.integers(1, 4, (rows, 1))
        out.append(((start + stride * np.arange(length)) % vocab).astype(np.int32))
    return out


def build_strategy_for(base: list[str], overrides: list[str], devices: int, vocab: int):
    """configs/test.py with `base + overrides`, built on the first `devices` devices."""
    import jax

    from jaxpar.config import apply_overrides, load_config
    from jaxpar.mesh import make_mesh
    from jaxpar.model.transformer import ModelConfig
    from jaxpar.parallel.registry import make_strategy

    config = load_config("configs/test.py")
    apply_overrides(config, base + overrides)
    model = ModelConfig.from_config(config.model, vocab)
    return make_strategy(config, model, make_mesh(config, jax.devices()[:devices]))


def run_counting_steps(strategy, vocab: int, steps: int = 2, start=None):
    """Losses, gradient norms, final state and compiled step of `steps` counting batches; `start`: a host copy
    of the initial state (the same numbers every strategy's init_state makes; one init saves a compile)."""
    import jax

    state = strategy.init_state() if start is None else strategy.from_canonical(start)
    losses, norms = [], []
    with jax.set_mesh(strategy.mesh):
        step = strategy.lower_step().compile()
        for batch in counting_batches(strategy.config, steps, vocab):
            state, metrics = step(state, jax.device_put(batch, strategy.batch_sharding))
            losses.append(float(metrics["loss"]))
            norms.append(float(metrics["grad_norm"]))
    return np.array(losses), np.array(norms), state, step
