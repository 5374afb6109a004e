"""The capstone's 7B Arabic LM: the Llama-2-7B shape (32 layers, d_model 4096, 32 heads, SwiGLU 11008).

The vocabulary is larger than Llama-2's 32000: an Arabic-heavy BPE needs more
merges to keep tokens per word low (fertility drives FLOPs per word). 64000 is a
multiple of 128, so it shards evenly over any tensor size up to 128.
"""
from jaxpar.config import base_config


def get_config():
    c = base_config()
    c.name = "arabic_7b"
    c.model.vocab_size = 64000
    c.model.d_model = 4096
    c.model.layers = 32
    c.model.heads = 32
    c.model.kv_heads = 32
    c.model.mlp_dim = 11008
    c.model.max_seq_len = 4096
    c.data.seq_len = 4096
    c.data.vocab_size = 64000
    c.train.batch_size = 256           # 1M tokens per step at seq_len 4096
    c.train.lr = 3e-4
    c.train.warmup_steps = 2000
    c.train.steps = 250_000
    c.train.compute_dtype = "bfloat16"
    c.train.remat = "full"
    c.train.checkpoint_every = 1000
    c.train.eval_every = 1000
    c.train.log_every = 10
    c.mesh.data = 1
    c.mesh.fsdp = -1
    return c
