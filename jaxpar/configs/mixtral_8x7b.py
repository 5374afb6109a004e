"""Mixtral-8x7B's shape (46.7B parameters, 12.9B active) for dry runs: 8 experts, top-2, every layer MoE.

    jaxpar dryrun --config configs/mixtral_8x7b.py --devices 64
"""
from jaxpar.config import base_config


def get_config():
    c = base_config()
    c.name = "mixtral_8x7b"
    c.model.vocab_size = 32000
    c.model.d_model = 4096
    c.model.layers = 32
    c.model.heads = 32
    c.model.kv_heads = 8
    c.model.mlp_dim = 14336
    c.model.max_seq_len = 32768
    c.model.rope_theta = 1e6
    c.model.norm_eps = 1e-5
    c.model.moe.experts = 8
    c.model.moe.top_k = 2
    c.model.moe.router = "softmax"
    c.model.moe.normalize_top_k = True
    c.model.moe.dispatch = "dropless"
    c.model.moe.balance_loss = 0.02    # transformers' router_aux_loss_coef
    c.model.moe.z_loss = 0.0
    c.data.seq_len = 4096
    c.data.vocab_size = 32000
    c.train.batch_size = 256
    c.train.lr = 3e-4
    c.train.warmup_steps = 2000
    c.train.steps = 100_000
    c.train.compute_dtype = "bfloat16"
    c.train.remat = "full"
    c.mesh.data = 1
    c.mesh.expert = 8
    c.mesh.fsdp = -1
    c.parallel.expert = "manual"
    return c
