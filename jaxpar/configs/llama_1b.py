"""A ~1.2B-parameter Llama-style preset (TinyLlama/Llama-3.2-1B class) for dry runs and GPU runs."""
from jaxpar.config import base_config


def get_config():
    c = base_config()
    c.name = "llama_1b"
    c.model.vocab_size = 32000
    c.model.d_model = 2048
    c.model.layers = 22
    c.model.heads = 32
    c.model.kv_heads = 4
    c.model.mlp_dim = 5632
    c.model.max_seq_len = 2048
    c.data.seq_len = 2048
    c.data.vocab_size = 32000
    c.train.batch_size = 256
    c.train.lr = 3e-4
    c.train.warmup_steps = 2000
    c.train.steps = 100_000
    c.train.compute_dtype = "bfloat16"
    c.train.remat = "dots"
    c.train.checkpoint_every = 1000
    c.train.eval_every = 1000
    c.train.log_every = 10
    c.mesh.data = 1
    c.mesh.fsdp = -1
    return c
