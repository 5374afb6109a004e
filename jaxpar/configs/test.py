"""A tiny model for tests: compiles in seconds, 8 devices divide every sharded axis."""
from jaxpar.config import base_config


def get_config():
    c = base_config()
    c.name = "test"
    c.model.d_model = 64
    c.model.layers = 2
    c.model.heads = 4
    c.model.kv_heads = 2
    c.model.mlp_dim = 128
    c.model.max_seq_len = 64
    c.data.vocab_size = 512
    c.data.seq_len = 32
    c.train.steps = 8
    c.train.batch_size = 16
    c.train.warmup_steps = 2
    c.train.lr = 1e-2
    c.train.log_every = 1
    c.train.eval_every = 4
    c.train.eval_batches = 1
    c.train.checkpoint_every = 4
    c.train.sample_tokens = 8
    return c
