"""What the activations kept for the backward cost on CPU (steptime.KEPT_PASSES): one device runs the whole batch of
lab 10 part d's data=8 step (16 x 128 tokens of the default config), loss+grad without remat and with remat full, and
the forward alone, in process CPU seconds. Kept bytes cost t_none - t_full + the recomputed share of the forward.
As in part d, glibc keeps freed memory (measure/host_allocator.py; `--default-allocator` leaves it as it is), and each
function's minor page faults per call are printed beside its time."""
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.config import apply_overrides, load_config
from jaxpar.measure.hardware import probe_host
from jaxpar.measure.host_allocator import keep_freed_memory, minor_page_faults
from jaxpar.model import transformer as T
from jaxpar.model.counting import ModelShape
from jaxpar.parallel.memory import kept_per_layer
from jaxpar.parallel.theory import Candidate
from jaxpar.plan.steptime import KEPT_PASSES, executed_flops_per_token


def main(batch: int = 16, rounds: int = 9) -> None:
    cfg = load_config(None)
    apply_overrides(cfg, ["model.vocab_size=1024"])
    m = T.ModelConfig.from_config(cfg.model)
    params = T.init_params(m, 0)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 1024, (batch, 129)), jnp.int32)
    remat = jax.checkpoint_policies.nothing_saveable
    fns = {"forward": jax.jit(lambda p, t: T.loss(p, t, m)[0]),
           "grad none": jax.jit(jax.grad(lambda p, t: T.loss(p, t, m)[0])),
           "grad full": jax.jit(jax.grad(lambda p, t: T.loss(p, t, m, remat_policy=remat)[0]))}
    for f in fns.values():
        jax.block_until_ready(f(params, tokens))
    times = {k: [] for k in fns}
    faults = {k: [] for k in fns}
    for _ in range(rounds):                                   # interleaved, so load hits all alike
        for k, f in fns.items():
            c, before = time.process_time(), minor_page_faults()
            jax.block_until_ready(f(params, tokens))
            times[k].append(time.process_time() - c)
            faults[k].append(minor_page_faults() - before)
    for k, v in times.items():
        q1, q3 = np.quantile(v, [0.25, 0.75])
        print(f"{k:10s} {float(np.median(v)):.4f} CPU s (quartiles {q1:.4f}-{q3:.4f}), "
              f"{float(np.median(faults[k])):,.0f} page faults per call")
    host = probe_host(1.0)
    print(host.source)
    shape, seq = ModelShape.from_config(cfg), tokens.shape[1] - 1
    data = Candidate(data=8, remat="none", precision="float32", attention="dot")
    kept = kept_per_layer(shape, data, batch, seq) * shape.layers * 8                  # every device's: the batch's
    flops = {r: sum(executed_flops_per_token(shape, seq, r, "dot").values()) for r in ("none", "full")}
    share = (flops["full"] - flops["none"]) / (flops["none"] / 3)                      # recomputed / forward FLOPs
    t = {k: float(np.median(v)) for k, v in times.items()}
    passes = (t["grad none"] - t["grad full"] + share * t["forward"]) * host.hbm_bw / kept
    print(f"kept activations: {kept / 1e6:.0f} MB, measured {passes:.1f} passes at the copy rate; the model's "
          f"KEPT_PASSES['cpu'] = {KEPT_PASSES['cpu']} (measured / model {passes / KEPT_PASSES['cpu']:.2f})")


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--default-allocator"]
    print(keep_freed_memory() if len(args) == len(sys.argv) - 1 else "host allocator: glibc's default")
    main(*(int(a) for a in args))
