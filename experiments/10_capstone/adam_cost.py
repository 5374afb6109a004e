"""What one AdamW update costs on CPU (steptime.ADAM_BYTES_PER_PARAM["cpu"]): jaxpar's optimizer on the default
model's parameters, replicated on 8 virtual CPU devices (as data=8 keeps them) and sharded over the 8 (as fsdp and
ZeRO do), in process CPU seconds per core; the replicated update in bytes per parameter at the host's copy rate
over its cores. As in lab 10's part d, glibc keeps freed memory (measure/host_allocator.py)."""
import statistics
import time

from jaxpar.measure.host_allocator import keep_freed_memory
from jaxpar.mesh import set_cpu_devices


def main(rounds: int = 30) -> None:
    print(keep_freed_memory())
    set_cpu_devices(8)
    import jax
    import optax
    from jax.sharding import NamedSharding, PartitionSpec

    from jaxpar.config import apply_overrides, load_config
    from jaxpar.measure.hardware import probe_host
    from jaxpar.model import transformer as T
    from jaxpar.parallel.step import make_optimizer
    from jaxpar.plan.cpu_links import host_cores
    from jaxpar.plan.steptime import ADAM_BYTES_PER_PARAM

    cfg = load_config(None)
    apply_overrides(cfg, ["model.vocab_size=1024"])
    params = T.init_params(T.ModelConfig.from_config(cfg.model), 0)
    count = sum(x.size for x in jax.tree.leaves(params))
    optimizer, mesh, cores = make_optimizer(cfg.train), jax.make_mesh((8,), ("d",)), host_cores()

    def placed(x, sharded: bool):
        axis = next((i for i, d in enumerate(x.shape) if d % 8 == 0), None) if sharded else None
        spec = PartitionSpec() if axis is None else PartitionSpec(*[None] * axis, "d")
        return jax.device_put(x, NamedSharding(mesh, spec))

    @jax.jit
    def update(p, g, state):
        updates, state = optimizer.update(g, state, p)
        return optax.apply_updates(p, updates), state

    per_core = {}
    with jax.set_mesh(mesh):
        for name, sharded in (("replicated", False), ("sharded", True)):
            p = jax.tree.map(lambda x, sharded=sharded: placed(x, sharded), params)
            g, state = jax.tree.map(lambda x: x * 0.01, p), jax.jit(optimizer.init)(p)
            for _ in range(3):
                p, state = update(p, g, state)
            jax.block_until_ready(p)
            times = []
            for _ in range(rounds):
                start = time.process_time()
                p, state = update(p, g, state)
                jax.block_until_ready((p, state))
                times.append(time.process_time() - start)
            per_core[name] = statistics.median(times) / cores
            print(f"{name:10s} {per_core[name] * 1e3:.1f} ms CPU per core ({count:,} parameters, 8 devices)")
    host = probe_host(2.0)
    print(host.source)
    measured = per_core["replicated"] * cores * host.hbm_bw / (8 * count)
    model = ADAM_BYTES_PER_PARAM["cpu"]
    print(f"replicated: {measured:.1f} bytes per parameter at the copy rate; the model's ADAM_BYTES_PER_PARAM['cpu'] "
          f"= {model} (measured / model {measured / model:.2f})")


if __name__ == "__main__":
    main()
