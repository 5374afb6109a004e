"""DeepSeek-MoE-16B's shape (16.4B parameters, 2.8B active) for dry runs.

28 layers, the first dense (MLP 10944), then 64 fine-grained routed experts (1408 wide, 6 per
token, raw softmax gates) and 2 shared experts per layer; multi-head attention (16 heads of 128).

    jaxpar dryrun --config configs/deepseek_moe_16b.py --devices 64
"""
from jaxpar.config import base_config


def get_config():
    c = base_config()
    c.name = "deepseek_moe_16b"
    c.model.vocab_size = 102400
    c.model.d_model = 2048
    c.model.layers = 28
    c.model.heads = 16
    c.model.kv_heads = 16
    c.model.head_dim = 128
    c.model.mlp_dim = 10944
    c.model.max_seq_len = 4096
    c.model.norm_eps = 1e-6
    c.model.moe.experts = 64
    c.model.moe.top_k = 6
    c.model.moe.expert_mlp_dim = 1408
    c.model.moe.shared_experts = 2
    c.model.moe.dense_layers = 1
    c.model.moe.router = "softmax"
    c.model.moe.normalize_top_k = False
    c.model.moe.dispatch = "dropless"
    c.model.moe.balance_loss = 0.001   # DeepSeek-MoE's expert-level balance factor
    c.model.moe.z_loss = 0.0
    c.data.seq_len = 4096
    c.data.vocab_size = 102400
    c.train.batch_size = 256
    c.train.lr = 4.2e-4
    c.train.warmup_steps = 2000
    c.train.steps = 100_000
    c.train.compute_dtype = "bfloat16"
    c.train.remat = "full"
    c.mesh.data = 1
    c.mesh.expert = 8
    c.mesh.fsdp = -1
    c.parallel.expert = "manual"
    return c
