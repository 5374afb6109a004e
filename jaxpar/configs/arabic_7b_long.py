"""The capstone's 7B Arabic LM at 131,072 tokens per sequence: context parallelism over 8 devices.

A whole book of classical Arabic prose in one sequence. At this length the activations, not the
weights, are what outgrow a GPU: one 7B layer's residual stream is 131072 x 4096 bf16 = 1 GiB per
sequence, kept per layer under full remat, and data x fsdp cannot split a single sequence. 64 GPUs:
fsdp=8 (the weights and Adam state) x context=8 (the sequence, a ring of key/value blocks, the
causal chunks load-balanced), with the Pallas flash kernel per ring step. 8 sequences per step
(1M tokens), one per fsdp group.
"""
from jaxpar.configs.arabic_7b import get_config as arabic_7b


def get_config():
    c = arabic_7b()
    c.name = "arabic_7b_long"
    c.model.max_seq_len = 131072
    c.model.attention = "pallas"       # the ring's chunk-pair attention: flash, with its log-sum-exp
    c.model.loss = "full"              # each device's logits are its 16384 rows (chunked slices across the split)
    c.model.rope_theta = 1_000_000.0   # a long-context RoPE base (as Llama 3 and Qwen at 128K)
    c.data.seq_len = 131072
    c.train.batch_size = 8             # 1M tokens per step
    c.train.warmup_steps = 200
    c.train.steps = 2000               # a long-context extension stage, not pretraining from scratch
    c.mesh.data = 1
    c.mesh.fsdp = 8
    c.mesh.context = 8
    c.parallel.context = "ring"
    return c
