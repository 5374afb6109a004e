"""Token pipeline: tokenize, pack into fixed-length sequences, split, and serve batches with Grain.

Every process builds the same global batch order (same seed) and materialises
only the rows its own devices hold, so a run on 2 processes x 4 devices sees
bit-for-bit the batches a run on 1 process x 8 devices sees. The data position
is global: batch k of the run is batch k of one seeded, infinite sequence of
global batches, whatever the process count. A checkpoint records the step (and
sample index); a resumed run starts the sequence there, so it continues the
data order exactly, on the same or on a different number of processes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import grain
import jax
import numpy as np
from jax.experimental import multihost_utils
from tokenizers import Tokenizer

from jaxpar.config import ConfigError
from jaxpar.data.corpus import corpus_stats, load_documents
from jaxpar.data.tokenizer import EOS, get_tokenizer

_SPLIT_SEED = 1234  # fixed, so the validation set never depends on the training seed


@dataclass
class TokenData:
    tokenizer: Tokenizer
    train: np.ndarray   # [n_train, seq_len + 1] int32: inputs are [:, :-1], targets [:, 1:]
    val: np.ndarray     # [n_val, seq_len + 1]
    stats: dict


def pack(docs_ids: list[list[int]], eos: int, seq_len: int) -> np.ndarray:
    """Concatenate documents (each followed by EOS) and cut windows of seq_len + 1 tokens.

    Windows overlap by one token so that every token is a prediction target once.
    """
    stream = np.fromiter((t for ids in docs_ids for t in (*ids, eos)), dtype=np.int32)
    count = (len(stream) - 1) // seq_len
    if count < 2:
        raise ConfigError("data.seq_len", f"the corpus has {len(stream)} tokens, too few for two "
                          f"sequences of {seq_len}; use a larger corpus or a shorter data.seq_len")
    starts = np.arange(count) * seq_len
    return stream[starts[:, None] + np.arange(seq_len + 1)[None, :]]


def build_token_data(data_cfg) -> TokenData:
    docs = load_documents(data_cfg.corpus, data_cfg.normalize)
    if data_cfg.tokenizer == "bpe" and jax.process_count() > 1:
        # One process trains, the others read its cached file: all share one vocabulary.
        if jax.process_index() == 0:
            get_tokenizer(docs, data_cfg.tokenizer, data_cfg.vocab_size)
        multihost_utils.sync_global_devices("jaxpar-tokenizer")
    tokenizer = get_tokenizer(docs, data_cfg.tokenizer, data_cfg.vocab_size)
    ids = [enc.ids for enc in tokenizer.encode_batch(docs)]
    eos = tokenizer.token_to_id(EOS)
    assert eos is not None, f"the tokenizer has no {EOS}"   # get_tokenizer always adds it
    sequences = pack(ids, eos, data_cfg.seq_len)
    order = np.random.default_rng(_SPLIT_SEED).permutation(len(sequences))
    n_val = max(1, int(round(len(sequences) * data_cfg.val_fraction)))
    stats: dict[str, Any] = corpus_stats(docs)
    stats["tokens"] = sum(len(i) for i in ids)
    stats["tokens_per_word"] = stats["tokens"] / max(1, stats["words"])
    stats["vocab_size"] = tokenizer.get_vocab_size()
    stats["train_sequences"] = len(sequences) - n_val
    stats["val_sequences"] = n_val
    return TokenData(tokenizer, sequences[np.sort(order[n_val:])], sequences[np.sort(order[:n_val])], stats)


def local_rows(sharding, global_batch: int, seq_len: int) -> np.ndarray:
    """The indices of the batch rows this process's devices hold under `sharding`, ascending.

    They need not be one block: an MoE batch is split expert-outermost (parallel/rules.py's `batch`) while
    the processes split the mesh's leading axes, so on data=2 x expert=4 each of 2 processes holds every
    other eighth. `to_global` accepts exactly this: it maps the local blocks, in order, to the devices' rows.
    """
    index_map = sharding.addressable_devices_indices_map((global_batch, seq_len))
    blocks = sorted({idx[0].indices(global_batch)[:2] for idx in index_map.values()})
    return np.concatenate([np.arange(start, stop) for start, stop in blocks])


def train_dataset(sequences: np.ndarray, global_batch: int, seed: int, rows: slice | np.ndarray,
                  start: int = 0) -> grain.IterDataset:
    """Infinite, seeded, reshuffled-each-epoch batches from global batch `start` on; this process keeps `rows`."""
    ds = (grain.MapDataset.source(sequences).shuffle(seed=seed).repeat(None)
          .batch(global_batch, drop_remainder=True))
    ds = ds[start:].map(lambda batch: np.asarray(batch[rows], dtype=np.int32))
    return ds.to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=4))


def to_global(local: np.ndarray, sharding, global_batch: int) -> jax.Array:
    """Assemble each process's `local_rows` into one global array laid out as `sharding` says.

    JAX packs a process's device blocks in ascending order into its local data, whether or not they touch."""
    return jax.make_array_from_process_local_data(sharding, local, (global_batch, local.shape[1]))


def val_batches(sequences: np.ndarray, global_batch: int, count: int, rows: slice | np.ndarray) -> list[np.ndarray]:
    """A fixed list of validation batches (the same every evaluation, so the curves compare)."""
    usable = min(count, len(sequences) // global_batch)
    if usable == 0:  # fewer validation sequences than one batch: repeat them to fill one
        reps = -(-global_batch // len(sequences))
        sequences, usable = np.concatenate([sequences] * reps), 1
    return [sequences[i * global_batch:(i + 1) * global_batch][rows] for i in range(usable)]
