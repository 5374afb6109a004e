"""Which model-state layout a candidate's memory assumes: jaxpar's own, or a distributed optimizer's.

  jaxpar                  what jaxpar's strategies store (parallel/memory.py): fp32 parameters sharded as
                          the strategy shards them (whole on every device of `data`), fp32 gradients,
                          a second fp32 buffer when microbatches accumulate, AdamW μ, ν in fp32.
                          16-20 bytes per stored parameter. jaxpar builds this layout.
  distributed-optimizer   Megatron-LM's / NeMo's (--use-distributed-optimizer, bf16 training): bf16
                          parameters (2 bytes) and fp32 main gradients (4 bytes, accumulated in place)
                          on every device of `data`; the fp32 master parameters and AdamW μ, ν
                          (12 bytes) split over `data`: 6 + 12/D bytes per stored parameter. jaxpar does
                          not build it: a candidate that needs it is marked formula-only.

Activations and working buffers are the same in both (the compute is bf16 either way).
"""
from __future__ import annotations

import dataclasses

LAYOUTS = {
    "jaxpar": "jaxpar's: fp32 params on every data device + fp32 gradients (+ an fp32 accumulator) + AdamW",
    "distributed-optimizer": "distributed optimizer (Megatron/NeMo): bf16 params + fp32 grads on every data "
                             "device, fp32 master params + AdamW split over data",
}
BUILDABLE = ("jaxpar",)


def check_layout(layout: str, field: str = "--layout") -> str:
    from jaxpar.config import ConfigError
    if layout not in LAYOUTS:
        raise ConfigError(field, f"unknown layout '{layout}'; valid: {', '.join(LAYOUTS)}")
    return layout


def apply_layout(mem, cand, layout: str):
    """`mem` (jaxpar's layout, parallel/memory.py) with its model state replaced by `layout`'s."""
    if layout == "jaxpar":
        return mem
    from jaxpar.parallel.memory import ACCUMULATOR
    params = mem.params / 4                                    # parameters this device stores
    accumulates = cand.microbatches > 1 and cand.pipe == 1
    grads = mem.gradients / (1 + ACCUMULATOR) if accumulates else mem.gradients
    split = cand.data if cand.data_impl == "auto" else 1       # ZeRO stages already split what they split
    out = dataclasses.replace(mem, params=2 * params, optimizer=12 / 8 * mem.optimizer / split, gradients=grads,
                              layout=layout)
    return dataclasses.replace(out, fits=out.total <= out.limit)


def layout_flows(flow_list: list, shape, cand, layout: str) -> list:
    """The collectives of `layout`: a distributed optimizer reduce-scatters the fp32 gradients over `data` once
    per step (not per microbatch) and all-gathers the updated bf16 parameters, both overlapped with the backward
    and the next forward (Megatron's overlap_grad_reduce / overlap_param_gather: hideable). Dense models without
    pipe or expert only; the others keep jaxpar's flows."""
    if layout == "jaxpar" or cand.data == 1 or cand.pipe > 1 or cand.expert > 1 or cand.data_impl != "auto":
        return flow_list
    from jaxpar.parallel.theory import Flow
    ring = (cand.data - 1) / cand.data
    shard = shape.params / (cand.fsdp * cand.tensor)
    kept = [f for f in flow_list if f.axis != "data"]
    return kept + [Flow("data", "reduce-scatter", ring * 4 * shard, 1, True),
                   Flow("data", "all-gather", ring * 2 * shard, 1, True)]
