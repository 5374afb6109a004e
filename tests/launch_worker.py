"""A tiny child for tests/test_launch.py: `python -m launch_worker [crash|sleep] --cpu-devices M`.

It joins the job `jaxpar.launch.launch` sets up, builds one mesh over every
device of every process, and sums a sharded array with a cross-process
collective. With `raise`, process 1 raises an uncaught exception instead.
With `crash`, process 1 exits with code 3 right after joining,
while process 0 goes on into the collective and would wait there for its peer
(until gloo gives up after 30 s). With `sleep`, each process only prints its pid
and sleeps, for the timeout and Ctrl-C tests. With `refuse`, every process exits 2 at once
(bad input). With `listen`, process 0 prints the addresses its coordinator listens on. With `preempted`,
SIGTERM makes process 0 exit 75 at once and process 1 abort 0.5 s later (a preempted job's slower peer). With
`durable`, process 0 records a durable preemption save (as `jaxpar train` does) and both are then killed. With
`agree`, the processes ask jaxpar's preemption agreement three times, process 1 alone noticing at the second call,
then process 1 announces that it leaves while process 0 asks a fourth time.
"""
from __future__ import annotations

import os
import sys
import time


def main(argv: list[str]) -> int:
    cpu_devices = int(argv[argv.index("--cpu-devices") + 1]) if "--cpu-devices" in argv else None
    crash = "crash" in argv
    raises = "raise" in argv
    if "refuse" in argv:   # bad input: refused before any work
        print("error: --set: refused", flush=True)
        return 2
    if "preempted" in argv:   # SIGTERM: process 0 "saves" and exits 75, its peer is aborted (as JAX's service does)
        import signal

        def on_notice(signum, frame):
            if os.environ["JAXPAR_PROCESS_ID"] == "0":
                print("saved; exiting 75", flush=True)
                os._exit(75)
            time.sleep(0.5)
            os.abort()

        signal.signal(signal.SIGTERM, on_notice)
        print("ready", flush=True)
        time.sleep(120)
        return 0
    if "durable" in argv:   # the preemption save is durable, then the processes die on their way out
        import signal
        from pathlib import Path

        from jaxpar.env import ENV_PREEMPTION_RECORD
        if os.environ["JAXPAR_PROCESS_ID"] == "0":
            Path(os.environ[ENV_PREEMPTION_RECORD]).write_text("4\n")
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
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
    if "listen" in argv:
        if jax.process_index() == 0:
            port = int(os.environ["JAXPAR_COORDINATOR"].rsplit(":", 1)[1])
            print(f"coordinator listens on {' '.join(listening(port))}", flush=True)
        return 0
    if "agree" in argv:
        return agree(jax.process_index())
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


def agree(index: int) -> int:
    from jaxpar.train.agreement import JobAgreement, PeerLeft, announce_leaving
    agreement = JobAgreement(2)
    answers = [agreement.any_notice(mine=index == 1 and call == 2) for call in (1, 2, 3)]
    print(f"answers={answers}", flush=True)
    if index == 1:
        announce_leaving(index)
        time.sleep(2)   # process 0 hosts the coordinator: it must still be there when process 1 announces
        return 0
    try:
        agreement.any_notice(mine=False)
    except PeerLeft:
        print("peer left", flush=True)
    return 0


def listening(port: int) -> list[str]:
    """The local addresses of TCP sockets listening on `port` (from /proc/net/tcp and tcp6), e.g. 127.0.0.1."""
    import ipaddress
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for row in f.read().splitlines()[1:]:
                local, state = row.split()[1], row.split()[3]
                address, hex_port = local.split(":")
                if state == "0A" and int(hex_port, 16) == port:   # 0A: LISTEN
                    raw = bytes.fromhex(address)   # little-endian 32-bit words
                    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                    address = ipaddress.ip_address(raw)
                    found.append(str(getattr(address, "ipv4_mapped", None) or address))   # ::ffff:a.b.c.d
    return found


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
