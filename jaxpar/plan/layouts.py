"""Which model-state layout a candidate's memory assumes: jaxpar's own, or a distributed optimizer's.

  jaxpar                  what jaxpar's strategies store (parallel/memory.py): fp32 parameters sharded as
                          the strategy shards them (whole on every device of `data`), fp32 gradients,
                          a second fp32 buffer when microbatches accumulate, AdamW μ, ν in fp32.
                          16-20 bytes per stored parameter. jaxpar builds this layout.
  distributed-optimizer   Megatron-LM's / NeMo's (--use-distributed-optimizer, bf16 training): bf16
                          parameters (2 bytes) and fp32 main gradients (4 bytes, accumulated in place)
                          on every device of `data`; the fp32 master parameters and AdamW μ, ν
                          (12 bytes) split over `data`: 6 + 12/D bytes per stored parameter. With context
                          parallelism `data` is data x context (Megatron's data-parallel group with context
                          parallelism: each context device holds whole parameters and the gradients of its
                          own rows). jaxpar does not build it: a candidate that needs it is marked formula-only.
  distributed-optimizer-  the same with the gradients reduced and kept in bf16 (2 bytes): NeMo's published
    bf16-grads            performance runs set `optim.grad_sync_dtype=bf16` (NeMo-Framework-Launcher's H100 Llama
                          examples), where Megatron's default accumulates and reduces them in fp32. 4 + 12/D
                          bytes per stored parameter; the reduce-scatter moves half the bytes. Formula-only too.

Activations and working buffers are the same in both (the compute is bf16 either way).
"""
from __future__ import annotations

import dataclasses
import math

LAYOUTS = {
    "jaxpar": "jaxpar's: fp32 params on every data device + fp32 gradients (+ an fp32 accumulator) + AdamW",
    "distributed-optimizer": "distributed optimizer (Megatron/NeMo): bf16 params + fp32 grads on every data "
                             "device, fp32 master params + AdamW split over data",
    "distributed-optimizer-bf16-grads": "distributed optimizer with bf16 gradients (NeMo's grad_sync_dtype=bf16): "
                                        "bf16 params + bf16 grads on every data device, fp32 master params + "
                                        "AdamW split over data",
}
BUILDABLE = ("jaxpar",)


def gradient_bytes(layout: str) -> int:
    """Bytes per gradient element a layout keeps and reduces."""
    return 2 if layout == "distributed-optimizer-bf16-grads" else 4


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
    split = cand.data * cand.context if cand.data_impl == "auto" else 1   # ZeRO stages split what they split
    grads = grads * gradient_bytes(layout) / 4
    out = dataclasses.replace(mem, params=2 * params, optimizer=12 / 8 * mem.optimizer / split, gradients=grads,
                              layout=layout)
    return dataclasses.replace(out, fits=out.total <= out.limit)


def layout_flows(prediction, shape, cand, layout: str) -> list:
    """The collectives of `layout` (a `Prediction`'s flows in, the layout's out). A distributed optimizer
    reduce-scatters the gradients (fp32, or bf16) of what a device stores over `data` once per step (not per microbatch)
    and all-gathers the updated bf16 parameters, both overlapped with the backward and the next forward
    (Megatron's overlap_grad_reduce / overlap_param_gather: hideable). It takes over the gradients' all-reduce
    over `data`; one over a group of `data` and other axes (a pipeline's "data+pipe") keeps its other axes.
    With context parallelism the group is data x context ("data+context"): the context axis' per-microbatch
    gradient all-reduce (parallel/context_predict.py) is taken over too; its ring or all-to-all stays."""
    flow_list = prediction.flows
    group = [a for a in ("data", "context") if getattr(cand, a) > 1]
    if layout == "jaxpar" or not group or cand.data_impl != "auto":
        return flow_list
    from jaxpar.parallel.theory import Flow
    kept = []
    for f in flow_list:
        axes = f.axis.split("+")
        if not set(group) & set(axes) or f.op != "all-reduce":
            kept.append(f)
            continue
        rest = [a for a in axes if a not in group]
        if rest:    # the part over the other axes stays an all-reduce of the same buffer, over a smaller group
            n, n_rest = math.prod(getattr(cand, a) for a in axes), math.prod(getattr(cand, a) for a in rest)
            buffer = f.bytes / (2 * (n - 1) / n)
            kept.append(Flow("+".join(rest), "all-reduce", 2 * (n_rest - 1) / n_rest * buffer, f.count, f.hideable))
    size, axis = math.prod(getattr(cand, a) for a in group), "+".join(group)
    ring = (size - 1) / size
    shard = prediction.stored["params"]             # parameters this device stores (over pipe, fsdp, tensor, expert)
    return kept + [Flow(axis, "reduce-scatter", ring * gradient_bytes(layout) * shard, 1, True),
                   Flow(axis, "all-gather", ring * 2 * shard, 1, True)]
