"""Tokenizer fertility: tokens per Arabic word of a byte-level BPE trained on the corpus.

A plan's budget may be given in Arabic words; the model trains on tokens. The factor is the
fertility of the tokenizer the config uses, measured, not assumed: the BPE is trained
(jaxpar.data.tokenizer, the strategy and cache every run uses) on nine tenths of the corpus's
documents and measured on the held-out tenth (every tenth document), so words the tokenizer
never saw count too. Words are whitespace-separated strings, as `corpus_stats` counts them.
"""
from __future__ import annotations

HELD_OUT_EVERY = 10


def split_documents(docs: list[str]) -> tuple[list[str], list[str]]:
    """(train, held out): every HELD_OUT_EVERY-th document is held out."""
    held = [d for i, d in enumerate(docs) if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1]
    train = [d for i, d in enumerate(docs) if i % HELD_OUT_EVERY != HELD_OUT_EVERY - 1]
    return train, held


def fertility(corpus: str, vocab_size: int, normalize: bool) -> dict:
    """Tokens per word on held-out documents of `corpus` for a BPE of `vocab_size` (diacritics stripped if
    `normalize`); also the vocabulary the strategy reached (a small corpus runs out of merges)."""
    from jaxpar.data.corpus import load_documents
    from jaxpar.data.tokenizer import get_tokenizer
    docs = load_documents(corpus, normalize=normalize)
    train, held = split_documents(docs)
    tok = get_tokenizer(train, "bpe", vocab_size)
    words = sum(len(d.split()) for d in held)
    tokens = sum(len(enc.ids) for enc in tok.encode_batch(held))
    train_words = sum(len(d.split()) for d in train)
    train_tokens = sum(len(enc.ids) for enc in tok.encode_batch(train))
    return {"corpus": corpus, "vocab_requested": vocab_size, "vocab_reached": tok.get_vocab_size(),
            "normalize": normalize, "held_out_words": words, "held_out_tokens": tokens,
            "tokens_per_word": tokens / words, "train_tokens_per_word": train_tokens / train_words,
            "characters_per_word": sum(len(d) for d in held) / words}
