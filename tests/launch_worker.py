"""A tiny child for tests/test_launch.py: `python -m launch_worker [crash|sleep] --cpu-devices M`.

It joins the job `jaxpar.launch.launch` sets up, builds one mesh over every
device of every process, and sums a sharded array with a cross-process
collective. With `raise`, process 1 raises an uncaught exception instead.
With `crash`, process 1 exits with code 3 right after joining,
while process 0 goes on into the collective and would wait there for its peer
(until gloo gives up after 30 s). With `sleep`, each process only prints its pid
and sleeps, for the timeout and Ctrl-C tests.
"""
from __future__ import annotations

import os
import sys
import time


def main(argv: list[str]) -> int:
    cpu_devices = int(argv[argv.index("--cpu-devices") + 1]) if "--cpu-devices" in argv else None
    crash = "crash" in argv
    raises = "raise" in argv
    if "sleep" in argv:   # for the timeout and Ctrl-C tests: never touches JAX
        print(f"sleeping pid={os.getpid()}", flush=True)
        time.sleep(120)
        return 0

    from jaxpar import mesh as jmesh
    jmesh.set_cpu_devices(cpu_devices)
    jmesh.init_distributed()

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    print(f"process={jax.process_index()}/{jax.process_count()} "
          f"devices={jax.device_count()} local={jax.local_device_count()}", flush=True)
    if crash and jax.process_index() == 1:
        print("crashing", flush=True)
        # os._exit, not sys.exit: sys.exit runs JAX's atexit hook, whose
        # jax.distributed.shutdown() is a barrier that waits for every peer (up to
        # shutdown_timeout_seconds=300) -- the "crashed" process would hang instead.
        os._exit(3)
    if raises and jax.process_index() == 1:
        print("raising", flush=True)
        # An uncaught exception: jaxpar's excepthook (mesh.init_distributed) exits at once;
        # without it this process would wait in JAX's shutdown barrier while process 0 hangs.
        raise RuntimeError("a bug in process 1")

    mesh = Mesh(np.asarray(jax.devices()), ("x",))
    n = jax.device_count()
    values = np.arange(1, 2 * n + 1, dtype=np.float32)          # two elements per device
    x = jax.make_array_from_callback(values.shape, NamedSharding(mesh, P("x")), lambda idx: values[idx])
    total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))(x)
    print(f"sum={float(total):g}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
