"""`parallel.expert=manual`: expert parallelism with explicit all_to_alls, as DeepSpeed-MoE, Megatron-Core
and torchtitan write it with torch.distributed.

Each of the N devices on `expert` holds E/N experts and 1/N of the batch. The router runs where the tokens
are (the single device's view); then per MoE layer a `shard_map` over the whole mesh permutes, dispatches
(all_to_all), runs the local experts as one `ragged_dot` (hidden split over `tensor` when tensor > 1),
returns (all_to_all) and combines. The dropless exchange's buffers are sized by `parallel.expert_exchange`
(parallel/expert_exchange.py: ragged on GPU, capacity plus an overflow round elsewhere). Routing and the
experts' math are the single device's, so the losses match it to fp32 rounding. The steps, the buffers' cost
and XLA:CPU's constraints: experiments/07_moe/README.md, "How manual expert parallelism is written".
"""
from __future__ import annotations

from functools import partial

import jax
from jax.sharding import PartitionSpec as P

from jaxpar.config import ConfigError
from jaxpar.model.moe import MoEConfig, capacity_experts, with_routed_experts
from jaxpar.parallel.auto import AutoStrategy
from jaxpar.parallel.expert_exchange import AXIS, dropless_exchange
from jaxpar.parallel.expert_sizes import resolve
from jaxpar.parallel.rules import AxisRules

# ============================================================================ capacity

def _to_experts(slots):
    """[E, G, C, D] (my groups, every expert) -> [E/N, N·G, C, D] (my experts, every device's groups)."""
    return jax.lax.all_to_all(slots, AXIS, 0, 1, tiled=True)


def _from_experts(slots):
    return jax.lax.all_to_all(slots, AXIS, 1, 0, tiled=True)


def capacity_exchange(x, ids, gates, w, cfg: MoEConfig, ops, *, n: int, tensor_sum):
    """The capacity dispatch with the slot buffers moved by all_to_all (inside shard_map over `expert`)."""
    return capacity_experts(x, ids, gates, w, cfg, ops, to_experts=_to_experts,
                            from_experts=lambda slots: _from_experts(tensor_sum(slots)))


# ============================================================================ the shard_map

def _unsummed(out):
    return out


def mesh_platform() -> str:
    """The platform of the devices the program being traced is for (a deviceless GPU mesh's too), at trace time."""
    device = jax.sharding.get_abstract_mesh().abstract_device
    return device.platform if device is not None else jax.default_backend()


def traced_dropless_exchange(*args, exchange: str, **kwargs):
    """`dropless_exchange` with `exchange` (parallel.expert_exchange) resolved for the traced program's backend."""
    return dropless_exchange(*args, exchange=resolve(exchange, mesh_platform()), **kwargs)


def exchange_for(cfg: MoEConfig, n: int, tensor_sum=_unsummed, exchange: str = "auto"):
    """The routed experts of a per-device program over `expert` (n devices), `routed_experts`' signature: the
    dropless exchange sized by `exchange` (parallel.expert_exchange), or the capacity dispatch's. `tensor_sum`
    adds the experts' partial outputs over `tensor` where the program does not (identity: Megatron's g after
    the layer adds them, parallel/tensor_moe.py)."""
    if cfg.dispatch == "dropless":
        return partial(traced_dropless_exchange, n=n, tensor_sum=tensor_sum, exchange=exchange)
    return partial(capacity_exchange, n=n, tensor_sum=tensor_sum)


def manual_routed_experts(x, ids, gates, w, cfg: MoEConfig, ops, *, mesh, batch_axes: tuple[str, ...],
                          exchange: str = "auto"):
    """`routed_experts` (model/moe.py) over the mesh: a shard_map around the exchange, manual over every
    mesh axis. Tokens are split as the batch is (`expert` among its axes), experts over `expert`, each
    expert's hidden dimension over `tensor`."""
    n, tp = int(mesh.shape[AXIS]), "tensor" if mesh.shape["tensor"] > 1 else None
    tensor_sum = (lambda out: jax.lax.psum(out, tp)) if tp else _unsummed
    local = partial(exchange_for(cfg, n, tensor_sum, exchange), cfg=cfg, ops=ops)
    tokens = P(batch_axes)
    experts = {name: P(AXIS, None, tp) if name != "expert_down" else P(AXIS, tp, None) for name in w}
    return jax.shard_map(local, mesh=mesh, in_specs=(tokens, tokens, tokens, experts), out_specs=(tokens, tokens),
                         axis_names=set(mesh.axis_names))(x, ids, gates, w)


class ExpertStrategy(AutoStrategy):
    """The automatic strategy with the MoE layers' token exchange written by hand (`parallel.expert=manual`)."""

    RUNS = {"expert": ("manual",)}
    PLANNED: dict = {}   # the planner ranks expert=auto: the prediction (AutoStrategy's) is the same

    @classmethod
    def check(cls, config, sizes):
        if not config.model.moe.experts:
            raise ConfigError("parallel.expert", "manual expert parallelism needs an MoE model: set "
                              "model.moe.experts > 0, or parallel.expert=auto")
        batch = AxisRules.from_config(config).spec(("batch",))[0]
        if AXIS not in (batch if isinstance(batch, tuple) else (batch,)):
            raise ConfigError("parallel.rules", f"manual expert parallelism splits the batch over `{AXIS}`, but "
                              f"the rules map batch to {batch}; keep {AXIS} in the batch rule")

    def with_ops(self, ops):
        batch = self.rules.spec(("batch",))[0]
        batch_axes = batch if isinstance(batch, tuple) else (batch,)
        return with_routed_experts(ops, partial(manual_routed_experts, mesh=self.mesh, batch_axes=batch_axes,
                                                exchange=self.config.parallel.expert_exchange))
