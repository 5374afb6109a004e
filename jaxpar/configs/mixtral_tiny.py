"""A tiny Mixtral-style MoE (8 experts, top-2, softmax router, dropless, no shared expert) for CPU.

Every layer is MoE; trains on the default corpus in a few minutes on 8 virtual CPU devices,
the experts split over them by hand (`parallel.expert=manual`):

    jaxpar train --config configs/mixtral_tiny.py --cpu-devices 8

`--set parallel.expert=auto` lets XLA place the experts instead; `--set mesh.expert=4
--set mesh.data=2` combines expert and data parallelism.
"""
from jaxpar.config import base_config


def get_config():
    c = base_config()
    c.name = "mixtral_tiny"
    c.model.d_model = 128
    c.model.layers = 4
    c.model.heads = 4
    c.model.kv_heads = 2
    c.model.mlp_dim = 256             # each expert's SwiGLU hidden size (model.moe.expert_mlp_dim = 0: this)
    c.model.rope_theta = 1e6          # Mixtral's
    c.model.moe.experts = 8
    c.model.moe.top_k = 2
    c.model.moe.router = "softmax"
    c.model.moe.normalize_top_k = True
    c.model.moe.dispatch = "dropless"
    c.model.moe.balance_loss = 0.01
    c.model.moe.z_loss = 0.001
    c.mesh.data = 1
    c.mesh.expert = -1                # every device holds 8 / N experts
    c.parallel.expert = "manual"
    c.train.steps = 300
    c.train.log_every = 25
    return c
