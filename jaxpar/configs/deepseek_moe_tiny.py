"""A tiny DeepSeek-MoE-style model for CPU: a dense first layer, then fine-grained experts + shared experts.

32 routed experts of a quarter of Mixtral-tiny's width, 6 chosen per token (raw softmax gates,
as DeepSeek-MoE), plus 2 always-on shared experts; the first layer keeps a dense MLP:

    jaxpar train --config configs/deepseek_moe_tiny.py --cpu-devices 8

DeepSeek-V3's auxiliary-loss-free balancing instead: --set model.moe.router=sigmoid
--set model.moe.balance_loss=0 (the bias moves by model.moe.bias_rate per step).
"""
from jaxpar.config import base_config


def get_config():
    c = base_config()
    c.name = "deepseek_moe_tiny"
    c.model.d_model = 128
    c.model.layers = 4
    c.model.heads = 4
    c.model.kv_heads = 4
    c.model.mlp_dim = 512             # the dense first layer's MLP
    c.model.moe.experts = 32
    c.model.moe.top_k = 6
    c.model.moe.expert_mlp_dim = 64   # fine-grained: 1/8 of the dense MLP
    c.model.moe.shared_experts = 2
    c.model.moe.dense_layers = 1
    c.model.moe.router = "softmax"
    c.model.moe.normalize_top_k = False
    c.model.moe.dispatch = "dropless"
    c.model.moe.balance_loss = 0.01
    c.model.moe.z_loss = 0.001
    c.mesh.data = 1
    c.mesh.expert = -1
    c.parallel.expert = "manual"
    c.train.steps = 300
    c.train.log_every = 25
    return c
