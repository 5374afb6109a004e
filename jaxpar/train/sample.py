"""Autoregressive decoding from a trained model: greedy, or temperature with top-k.

Decoding runs the full forward pass over a fixed-length buffer each token (no KV
cache): one compiled program for any prompt, and the causal mask makes the
padding after the cursor irrelevant. Fine for the small models trained here.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.model.transformer import ModelConfig, forward


def generate(params, model_cfg: ModelConfig, prompt_ids: list[int], max_new_tokens: int, *,
             buffer_len: int, temperature: float = 0.0, top_k: int = 0, seed: int = 0,
             stop_id: int | None = None) -> list[int]:
    """Continue `prompt_ids`; returns only the new token ids."""
    if not prompt_ids:
        raise ValueError("the prompt encodes to no tokens")
    total = min(buffer_len, len(prompt_ids) + max_new_tokens)
    if len(prompt_ids) >= total:
        raise ValueError(f"the prompt has {len(prompt_ids)} tokens; the buffer holds {buffer_len}")
    buffer = np.zeros((1, total), np.int32)
    buffer[0, :len(prompt_ids)] = prompt_ids

    @jax.jit
    def next_token(params, tokens, position, key):
        logits = forward(params, tokens, model_cfg)[0, position - 1]
        if temperature <= 0:
            return jnp.argmax(logits).astype(jnp.int32)
        logits = logits / temperature
        if top_k > 0:
            kth = jax.lax.top_k(logits, top_k)[0][-1]
            logits = jnp.where(logits < kth, -jnp.inf, logits)
        return jax.random.categorical(key, logits).astype(jnp.int32)

    key = jax.random.key(seed)
    new = []
    for position in range(len(prompt_ids), total):
        key, sub = jax.random.split(key)
        token = int(next_token(params, buffer, position, sub))
        buffer[0, position] = token
        new.append(token)
        if stop_id is not None and token == stop_id:
            break
    return new
