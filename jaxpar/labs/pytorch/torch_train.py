"""The PyTorch side's training loop, shared by every strategy: jaxpar's optimizer (train/step.py) in torch,
and what one profiled step measures (bytes per collective, allocator peak).

jaxpar's optimizer is optax.chain(clip_by_global_norm, adamw(warm-up + cosine, mask)). Here:
the learning rate of every step is jaxpar's own schedule, evaluated by the lab and passed in;
the gradient is clipped with optax's formula (g·max/‖g‖ when ‖g‖ ≥ max; torch's
clip_grad_norm_ adds 1e-6 to the norm); AdamW decays exactly the parameters jaxpar's mask
decays (the lab maps the mask to Hugging Face names). torch.optim.AdamW and optax.adamw are
the same update: decoupled decay of the pre-update weight, bias-corrected moments, eps added
to the root.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import tempfile
import time
from collections import defaultdict
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from jaxpar.measure.hlo import ring_factor


@dataclasses.dataclass
class Hyper:
    """jaxpar's optimizer settings, as numbers (train.* and the evaluated schedule)."""

    lrs: list[float]
    b1: float
    b2: float
    eps: float
    weight_decay: float
    grad_clip: float
    decayed: list[str]           # Hugging Face parameter names jaxpar's mask decays


def make_optimizer(module, hp: Hyper) -> torch.optim.AdamW:
    named = dict(module.named_parameters())
    unknown = set(named) - set(hp.decayed) - {n for n in named if n.endswith("norm.weight")}
    if unknown:
        raise ValueError(f"parameters outside jaxpar's tree: {sorted(unknown)[:3]}")
    groups = [{"params": [p for n, p in named.items() if n in hp.decayed], "weight_decay": hp.weight_decay},
              {"params": [p for n, p in named.items() if n not in hp.decayed], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=hp.lrs[0], betas=(hp.b1, hp.b2), eps=hp.eps)


def clip_by_global_norm(module, max_norm: float, group=None) -> float:
    """optax.clip_by_global_norm on the gradients of `module`; `group`: ranks holding disjoint parameters
    (pipeline stages) whose squares are summed. DTensor gradients (FSDP2, TP) are reduced to their
    placement first; a sharded one's squares are summed over its mesh."""
    local, sharded, any_sharded = torch.zeros(()), torch.zeros(()), False
    for p in module.parameters():
        g = p.grad
        if isinstance(g, DTensor):
            if g.placements != p.placements:  # SP norms: Partial (all-reduce); the embedding: Replicate (slice)
                g = p.grad = g.redistribute(placements=p.placements)
            is_shard = any(x.is_shard() for x in g.placements)
            any_sharded |= is_shard
            (sharded if is_shard else local).add_(g.to_local().pow(2).sum())
        else:
            local += g.pow(2).sum()
    if group is not None:                     # stages: every square is this rank's alone
        local += sharded
        dist.all_reduce(local, group=group)
    elif any_sharded:
        dist.all_reduce(sharded)
        local += sharded
    norm = float(local.sqrt())
    if norm >= max_norm:
        for p in module.parameters():
            p.grad.mul_(max_norm / norm)
    return norm


def local_bytes(tensors) -> int:
    return sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in tensors)


def state_bytes(module, optimizer) -> dict:
    """This rank's stored parameters, gradients and Adam moments (local shards), in bytes."""
    params = list(module.parameters())
    moments = [v for s in optimizer.state.values() for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")]
    return {"params": local_bytes(params), "grads": local_bytes(p.grad for p in params if p.grad is not None),
            "adam": local_bytes(moments)}


def step_trace(events: list[dict], n: int) -> dict:
    """Bytes this rank sent per collective kind, from a profiled step's chrome-trace events.

    `gloo:*` events are what gloo ran, with the buffer's element count (fp32: every tensor the
    lab sends); the bytes are hlo.ring_factor's ring model, as for jaxpar's compiled program.
    `c10d::*` events are what the torch.distributed API was asked for (gloo has no reduce-scatter
    of its own: it runs an all-reduce and keeps a slice). "[memory]" events give the peak."""
    kinds = {"all_reduce": "all-reduce", "all_gather": "all-gather", "reduce_scatter": "reduce-scatter",
             "send": "send", "broadcast": "broadcast", "alltoall": "all-to-all"}
    sent: defaultdict[str, float] = defaultdict(float)
    calls: defaultdict[str, int] = defaultdict(int)
    asked: defaultdict[str, int] = defaultdict(int)
    allocated = [e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]"]
    for e in events:
        name = e.get("name", "")
        if name.startswith("c10d::") and e.get("ph") == "X":
            asked[name[len("c10d::"):].strip("_")] += 1
        if not name.startswith("gloo:") or e.get("ph") != "X":
            continue
        kind = kinds.get(name[len("gloo:"):], name[len("gloo:"):])
        dims = (e.get("args", {}).get("Input Dims") or [[]])[0]
        elements = 1
        for d in dims:
            elements *= d
        buffer = 4 * elements * (n if kind == "all-gather" else 1)   # ring_factor takes the result buffer
        factor = {"send": 1.0, "broadcast": 1.0, "recv": 0.0}.get(kind, None)
        factor = ring_factor(kind, n) if factor is None else factor
        sent[kind] += factor * buffer
        calls[kind] += 1
    return {"sent": dict(sent), "calls": dict(calls), "asked": dict(asked),
            "peak_allocated": max(allocated, default=0), "start_allocated": allocated[0] if allocated else 0}


def profiled(fn, n: int, dtensor: bool = False) -> dict:
    """Run fn() under torch.profiler (CPU, shapes, memory) and read its trace (`step_trace`); also under
    DTensor's CommDebugMode when `dtensor` (tensor parallelism: its module hooks fail under DDP in torch
    2.13), whose counts of DTensor's collectives are kept beside the trace's."""
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.profiler import ProfilerActivity, profile
    with (profile(activities=[ProfilerActivity.CPU], record_shapes=True, profile_memory=True) as prof,
          CommDebugMode() if dtensor else contextlib.nullcontext() as comm):
        fn()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.loads(Path(f.name).read_text())["traceEvents"]
    counted = ({str(op).split(".")[-1]: count for op, count in comm.get_comm_counts().items()}
               if dtensor and comm is not None else None)
    return {**step_trace(events, n), "comm_debug_mode": counted}


def train(parallel, batches, hp: Hyper, world: int, profile_step: int = 2, dtensor: bool = False) -> dict:
    """Train `parallel` over `batches` (global [B, s+1] int64): per-step losses and times; step
    `profile_step` runs under the profiler (bytes, allocator peak) and is left out of the times."""
    module = parallel.module
    optimizer = make_optimizer(module, hp)
    losses, norms, times, trace = [], [], [], None

    def one_step(i, batch):
        for group in optimizer.param_groups:
            group["lr"] = hp.lrs[i]
        optimizer.zero_grad(set_to_none=True)
        loss = parallel.loss_and_backward(batch)
        norms.append(clip_by_global_norm(module, hp.grad_clip, parallel.norm_group))
        optimizer.step()
        losses.append(float(loss))

    for i, batch in enumerate(batches):
        if i == profile_step:
            trace = profiled(partial(one_step, i, batch), world, dtensor)
            continue
        start = time.perf_counter()
        one_step(i, batch)
        times.append(time.perf_counter() - start)
    return {"losses": losses, "grad_norms": norms, "step_s": times, "trace": trace,
            "state": state_bytes(module, optimizer)}
