"""What a PyTorch user writes to parallelise the lab's Llama: DDP, FSDP2, tensor parallelism (with and
without sequence parallelism) and a pipeline, each on the gloo process group of N local CPU processes.

Each strategy is one function that takes the unwrapped model (`torch_llama.Llama`, every rank
holding the same initial weights) and returns a `Parallel`: the module whose parameters the
optimizer updates and `loss_and_backward(tokens)`, which takes the *global* batch [B, s+1]
(every rank reads the same one) and returns the global mean loss, gradients in place. The
code between `# parallel: NAME` and `# end parallel` is what the user writes for that strategy beyond
the one-process program (the lab counts it); the optimizer and the loop (`torch_train.py`) are the same.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from jaxpar.labs.pytorch.torch_llama import loss_fn


@dataclasses.dataclass
class Parallel:
    module: nn.Module                                   # holds the parameters the optimizer sees
    loss_and_backward: Callable[[torch.Tensor], torch.Tensor]
    norm_group: dist.ProcessGroup | None = None         # ranks whose gradients are disjoint parts (pipeline)


def forward_backward(model, tokens):
    """What every strategy's step does on the rows it gets: the mean loss, gradients in place."""
    loss = loss_fn(model(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    return loss.detach()


def single(model) -> Parallel:
    return Parallel(model, lambda tokens: forward_backward(model, tokens))


def ddp(model) -> Parallel:
    # parallel: ddp
    from torch.nn.parallel import DistributedDataParallel
    model = DistributedDataParallel(model)     # all-reduces (averages) the gradient buckets in backward
    # end parallel

    def step(tokens):
        # parallel: ddp
        tokens = tokens.chunk(dist.get_world_size())[dist.get_rank()]   # this rank's rows
        # end parallel
        loss = forward_backward(model, tokens)
        # parallel: ddp
        dist.all_reduce(loss)                  # the global mean, for the log
        return loss / dist.get_world_size()
        # end parallel
    return Parallel(model.module, step)


def fsdp2(model) -> Parallel:
    # parallel: fsdp2
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.model.layers.values():
        fully_shard(block, mesh=mesh)          # one all-gather / reduce-scatter group per block
    fully_shard(model, mesh=mesh)              # the rest: embedding, final norm, head
    # end parallel

    def step(tokens):
        # parallel: fsdp2
        tokens = tokens.chunk(dist.get_world_size())[dist.get_rank()]
        # end parallel
        loss = forward_backward(model, tokens)
        # parallel: fsdp2
        dist.all_reduce(loss)
        return loss / dist.get_world_size()
        # end parallel
    return Parallel(model, step)


def tensor(model, sequence: bool = False) -> Parallel:
    # parallel: tp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        ParallelStyle,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        loss_parallel,
        parallelize_module,
    )
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    stream = Shard(1) if sequence else Replicate()        # the residual stream: split by tokens with SP
    parallelize_module(model, mesh, {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=stream),
        "lm_head": ColwiseParallel(input_layouts=stream, output_layouts=Shard(-1), use_local_output=False),
        **({"model.norm": SequenceParallel()} if sequence else {})})
    for block in model.model.layers.values():
        plan: dict[str, ParallelStyle] = {
            name: ColwiseParallel()
            for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")}
        plan.update({name: RowwiseParallel(output_layouts=stream) for name in ("self_attn.o_proj", "mlp.down_proj")})
        # one input DTensor per attention / MLP (Megatron's f: one all-reduce of its gradient, not one per
        # projection); with SP the norms run on s/t tokens and this is the all-gather before q/k/v, gate/up
        plan.update({"self_attn": PrepareModuleInput(input_layouts=(stream, None, None),
                                                     desired_input_layouts=(Replicate(), None, None)),
                     "mlp": PrepareModuleInput(input_layouts=(stream,), desired_input_layouts=(Replicate(),))})
        if sequence:
            plan.update({"input_layernorm": SequenceParallel(), "post_attention_layernorm": SequenceParallel()})
        parallelize_module(block, mesh, plan)

    # end parallel

    def step(tokens):                          # every rank reads the whole batch
        # parallel: tp
        with loss_parallel():                  # cross-entropy over vocabulary-sharded logits
            return forward_backward(model, tokens).full_tensor()
        # end parallel
    return Parallel(model, step)


def pipeline(model, schedule: str, microbatches: int) -> Parallel:
    # parallel: pipeline
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    rank, stages = dist.get_rank(), dist.get_world_size()
    model.keep_stage(rank, stages)             # this rank's layers (+ embedding first, + head last)
    stage = PipelineStage(model, rank, stages, torch.device("cpu"))
    runner = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule](stage, microbatches, loss_fn=loss_fn)

    def step(tokens):
        losses = []
        if rank == 0:
            runner.step(tokens[:, :-1])
        elif rank == stages - 1:
            runner.step(target=tokens[:, 1:], losses=losses)
        else:
            runner.step()
        loss = torch.stack(losses).mean() if losses else torch.zeros(())
        dist.broadcast(loss, stages - 1)       # the last stage knows the loss
        return loss
    # end parallel
    return Parallel(model, step, norm_group=dist.group.WORLD)


STRATEGIES = {
    "single": single,
    "ddp": ddp,
    "fsdp2": fsdp2,
    "tp": tensor,
    "tp-sp": lambda model: tensor(model, sequence=True),
}
