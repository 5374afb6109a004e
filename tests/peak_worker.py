"""A child for tests/test_run_output.py: `python -m peak_worker --cpu-devices M` in a `jaxpar launch` job.

Each process prints its own host probe, the run's peak (`run_peak`) and the step times
a `StepClock` hands out for four small steps: what each process's MFU is computed from.
"""
from __future__ import annotations

import sys
import time


def main(argv: list[str]) -> int:
    from jaxpar import mesh as jmesh
    jmesh.set_cpu_devices(int(argv[argv.index("--cpu-devices") + 1]))
    jmesh.init_distributed()

    import jax
    import jax.numpy as jnp

    from jaxpar.measure.hardware import probe_host, run_peak
    from jaxpar.train.progress import StepClock

    peak = run_peak("float32")
    clock = StepClock()
    step = jax.jit(lambda x: jnp.tanh(x @ x))
    x = jnp.ones((256, 256)) / 256
    for s in range(1, 5):
        dispatched = time.perf_counter()
        x = step(x)
        clock.dispatched(s, x, dispatched)
    times = clock.take()
    print(f"process={jax.process_index()} probe={probe_host().fp32_flops!r} peak={peak.per_device!r} "
          f"times={[times[s] for s in sorted(times)]!r}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
