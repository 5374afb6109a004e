"""Child of tests/test_pipeline.py: `python -m pipeline_worker all --cpu-devices M`.

Joins the job `jaxpar launch` sets up and trains each pipeline case for a few steps on
one global mesh spanning all processes; process 0 prints `LOSSES <name> <json>`.
"""
from __future__ import annotations

import json
import sys

CASES = {
    "1f1b-pipe4-tensor2": ["mesh.data=1", "mesh.pipe=4", "mesh.tensor=2", "parallel.pipe=1f1b",
                           "parallel.pipe_microbatches=8"],
    "3d-data2-pipe2-tensor2": ["mesh.data=2", "mesh.pipe=2", "mesh.tensor=2", "parallel.pipe=1f1b",
                               "parallel.pipe_microbatches=4"],
}
STEPS, VOCAB = 5, 512


def main(argv: list[str]) -> int:
    from jaxpar import mesh as jmesh
    jmesh.set_cpu_devices(int(argv[argv.index("--cpu-devices") + 1]))
    jmesh.init_distributed()

    import jax
    from synthetic import counting_batches

    from jaxpar.config import apply_overrides, load_config
    from jaxpar.model.transformer import ModelConfig
    from jaxpar.parallel.registry import make_trainer

    for name, overrides in CASES.items():
        config = load_config("configs/test.py")
        apply_overrides(config, ["train.warmup_steps=1", "model.layers=4", *overrides])
        trainer = make_trainer(config, ModelConfig.from_config(config.model, VOCAB), jmesh.make_mesh(config))
        state, losses = trainer.init_state(), []
        for batch in counting_batches(config, STEPS, VOCAB):
            global_batch = jax.make_array_from_callback(batch.shape, trainer.batch_sharding, lambda idx: batch[idx])
            state, metrics = trainer.step(state, global_batch)
            losses.append(float(metrics["loss"]))
        if jax.process_index() == 0:
            print(f"LOSSES {name} {json.dumps(losses)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
