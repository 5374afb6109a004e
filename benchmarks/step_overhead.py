"""What does jaxpar's train step cost over the bare `jax.jit` step a JAX user would write?

Both steps train the same model on the same batch and mesh with the same Optax
optimizer. They run interleaved in one process (A, B, A, B, ...) so that the
machine's noise hits both alike; the figure is the ratio of median step times.
The target is <= 1.05: jaxpar's sharding annotations, donation and metrics must
cost (almost) nothing at run time.

    python benchmarks/step_overhead.py --cpu-devices 8 --set mesh.fsdp=2 --steps 30
"""
from __future__ import annotations

import argparse
import statistics
import time

import jax


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/default.py")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--cpu-devices", type=int, default=8)
    parser.add_argument("--steps", type=int, default=30, help="timed steps of each variant")
    parser.add_argument("--vocab", type=int, default=2048)
    args = parser.parse_args()
    jax.config.update("jax_num_cpu_devices", args.cpu_devices)

    import numpy as np
    import optax

    from jaxpar.config import apply_overrides, load_config
    from jaxpar.mesh import describe, make_mesh
    from jaxpar.model.transformer import ModelConfig, forward
    from jaxpar.parallel.registry import make_strategy

    config = load_config(args.config)
    apply_overrides(config, args.overrides)
    mesh = make_mesh(config)
    model_cfg = ModelConfig.from_config(config.model, args.vocab)
    strategy = make_strategy(config, model_cfg, mesh)
    B, S = config.train.batch_size, config.data.seq_len
    tokens = np.random.default_rng(0).integers(0, args.vocab, (B, S + 1), dtype=np.int32)
    batch = jax.device_put(tokens, strategy.batch_sharding)

    # The bare step: plain jit, no shardings declared beyond where the inputs already live.
    optimizer = strategy.optimizer

    def bare_loss(params, tokens):
        logits, _ = forward(params, tokens[:, :-1], model_cfg)
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    @jax.jit
    def bare_step(params, opt_state, tokens):
        loss, grads = jax.value_and_grad(bare_loss)(params, tokens)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    state = strategy.init_state()
    bare_params = jax.tree.map(lambda x: x.copy(), state["params"])
    bare_opt = jax.tree.map(lambda x: x.copy(), state["opt_state"])

    def timed(fn):
        start = time.perf_counter()
        out = fn()
        jax.block_until_ready(out)
        return time.perf_counter() - start, out

    with jax.set_mesh(mesh):
        compile_jaxpar, (state, _) = timed(lambda: strategy.step(state, batch))
        compile_bare, (bare_params, bare_opt, _) = timed(lambda: bare_step(bare_params, bare_opt, batch))
        times = {"jaxpar": [], "bare": []}
        for _ in range(args.steps):
            t, (state, _) = timed(lambda: strategy.step(state, batch))  # noqa: B023 (called in this iteration)
            times["jaxpar"].append(t)
            t, (bare_params, bare_opt, _) = timed(lambda: bare_step(bare_params, bare_opt, batch))  # noqa: B023 (called in this iteration)
            times["bare"].append(t)

    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"mesh {describe(mesh)} on {jax.device_count()} {jax.devices()[0].platform} devices, "
          f"batch {B} x {S}, {args.steps} interleaved steps each")
    print("| step | compile + first run (s) | median step (ms) |")
    print("|---|---:|---:|")
    print(f"| jaxpar Strategy.step | {compile_jaxpar:.2f} | {med['jaxpar'] * 1e3:.1f} |")
    print(f"| bare jax.jit | {compile_bare:.2f} | {med['bare'] * 1e3:.1f} |")
    print(f"median step-time ratio jaxpar / bare: {med['jaxpar'] / med['bare']:.3f} (target <= 1.05)")


if __name__ == "__main__":
    main()
