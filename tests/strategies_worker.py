"""Child of tests/test_multiprocess_strategies.py: `python -m strategies_worker --cpu-devices M`.

Joins the job `jaxpar launch` sets up and trains every strategy for a few steps on
one global mesh spanning all processes; process 0 prints `LOSSES <name> <json>`.
"""
from __future__ import annotations

import json
import sys

# A representative case: the hand-written ZeRO-3, whose all-gathers, per-layer reduce-scatters and all-reduce are the
# ops every manual stage sends across processes (DDP and ZeRO-1/2 send a subset; each stage matches one device in
# tests/test_zero.py). XLA's strategies on 2 processes: FSDP in test_elastic (a resume on 2 processes x 4 devices),
# the 3-axis mesh in test_train_e2e, data=8 in test_slurm and the journeys' `jaxpar launch`. Lab 02 runs the matrix.
STRATEGIES = {"zero3": ["mesh.data=8", "parallel.data=zero3"]}
STEPS, VOCAB = 5, 512


def train_and_print(argv: list[str], cases: dict[str, list[str]], common: tuple[str, ...] = ()) -> int:
    """Join the job, train each case (configs/test.py + `common` + its overrides) for STEPS steps on the
    synthetic counting batches, and print its losses from process 0."""
    from jaxpar import mesh as jmesh
    jmesh.set_cpu_devices(int(argv[argv.index("--cpu-devices") + 1]))
    jmesh.init_distributed()

    import jax
    from synthetic import counting_batches

    from jaxpar.config import apply_overrides, load_config
    from jaxpar.model.transformer import ModelConfig
    from jaxpar.parallel.registry import make_strategy

    for name, overrides in cases.items():
        config = load_config("configs/test.py")
        apply_overrides(config, ["train.warmup_steps=1", *common, *overrides])
        strategy = make_strategy(config, ModelConfig.from_config(config.model, VOCAB), jmesh.make_mesh(config))
        state, losses = strategy.init_state(), []
        for batch in counting_batches(config, STEPS, VOCAB):
            global_batch = jax.make_array_from_callback(batch.shape, strategy.batch_sharding, lambda idx: batch[idx])  # noqa: B023 (called in this iteration)
            state, metrics = strategy.step(state, global_batch)
            losses.append(float(metrics["loss"]))
        if jax.process_index() == 0:
            print(f"LOSSES {name} {json.dumps(losses)}", flush=True)
    return 0


def main(argv: list[str]) -> int:
    return train_and_print(argv, STRATEGIES)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
