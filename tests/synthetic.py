"""Learnable synthetic batches for strategy tests: fast to make, and a model can fit them."""
import numpy as np


def counting_batches(config, steps: int, vocab: int, seed: int = 0) -> list[np.ndarray]:
    """[batch, seq_len + 1] int32 batches; each row counts up by a row-specific stride from a random start."""
    rng = np.random.default_rng(seed)
    rows, length = config.train.batch_size, config.data.seq_len + 1
    out = []
    for _ in range(steps):
        start = rng.integers(0, vocab, (rows, 1))
        stride = rng.integers(1, 4, (rows, 1))
        out.append(((start + stride * np.arange(length)) % vocab).astype(np.int32))
    return out
