"""Autoregressive decoding from a trained model: greedy, or temperature with top-k.

Decoding runs the full forward pass over a fixed-length buffer each token (no KV
cache): one compiled program for any prompt, and the causal mask makes the
padding after the cursor irrelevant (capacity-dispatch MoE layers are told where
the padding starts, so that it takes no expert slots). Fine for the small models
trained here.
"""
from __future__ import annotations

import dataclasses
import shlex

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.data.tokenizer import EOS
from jaxpar.model.moe import decode_ops
from jaxpar.model.transformer import ModelConfig, forward


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How each next token is chosen: greedy (temperature 0), or temperature and top-k from a seed."""

    temperature: float = 0.0
    top_k: int = 0
    seed: int = 0

    def describe(self) -> str:
        if self.temperature <= 0:
            return "greedy"
        return f"temperature {self.temperature:g}, top-k {self.top_k or 'all'}, seed {self.seed}"

    def flags(self) -> list[str]:
        """The `jaxpar sample` flags that choose the same way."""
        return ["--temperature", repr(float(self.temperature)), "--top-k", str(self.top_k), "--seed", str(self.seed)]


# The end-of-run sample uses the README's settings: greedy decoding of a small model repeats itself.
END_OF_RUN = Sampling(temperature=0.8, top_k=20, seed=0)


def sample_command(run_dir, prompt: str, max_tokens: int, sampling: Sampling) -> str:
    """The `jaxpar sample` command line (shell-quoted, pasteable) that decodes the same way from `run_dir`.

    `max_tokens` 0 leaves `--max-tokens` at its default.
    """
    tokens = ["--max-tokens", str(max_tokens)] if max_tokens else []
    return shlex.join(["jaxpar", "sample", "--run-dir", str(run_dir), "--prompt", prompt, *tokens, *sampling.flags()])


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
        logits = forward(params, tokens, model_cfg, decode_ops(position))[0][0, position - 1]
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


def complete(params, model_cfg: ModelConfig, tokenizer, prompt: str, max_new_tokens: int, buffer_len: int,
             **sampling) -> str:
    """The text the model writes after `prompt` (stops at end-of-document).

    A byte-level token can end inside a multi-byte UTF-8 character; the dangling
    replacement character that leaves at the end is dropped.
    """
    ids = tokenizer.encode(prompt).ids
    new = generate(params, model_cfg, ids, max_new_tokens, buffer_len=buffer_len,
                   stop_id=tokenizer.token_to_id(EOS), **sampling)
    return tokenizer.decode(new).rstrip("\ufffd")


def sample_run(run_dir, prompt: str, max_tokens: int, *, temperature=0.0, top_k=0, seed=0, notice=print):
    """Restore a run's newest checkpoint onto one device and continue `prompt`; returns (step, text).

    Every argument is checked before anything is restored. `max_tokens` beyond what the
    context holds after the prompt is reduced, with a `notice`.
    """
    from pathlib import Path

    from tokenizers import Tokenizer

    from jaxpar.checks import sample_arguments
    from jaxpar.config import ConfigError, mesh_axes, model_vocab_size
    from jaxpar.parallel.registry import build_strategy
    from jaxpar.train.checkpoint import Checkpoints
    from jaxpar.train.rundir import resume_config

    run_dir = Path(run_dir)
    sample_arguments(run_dir, prompt, max_tokens, temperature, top_k)
    tokenizer = Tokenizer.from_file(str(run_dir / "tokenizer.json"))
    prompt_len = len(tokenizer.encode(prompt).ids)
    if not prompt_len:
        raise ConfigError("--prompt", "encodes to no tokens; give some text")
    config = resume_config(run_dir)
    context = config.data.seq_len
    if prompt_len >= context:
        raise ConfigError("--prompt", f"encodes to {prompt_len} tokens but the model's context is {context} "
                          "(data.seq_len of the run); give a shorter prompt")
    if prompt_len + max_tokens > context:
        notice(f"note: --max-tokens {max_tokens} does not fit the {context}-token context after a {prompt_len}-token "
               f"prompt; generating at most {context - prompt_len}")
    for axis in mesh_axes():
        config.mesh[axis] = 1          # decode on one device, whatever mesh trained the run
        config.parallel[axis] = "auto"  # checkpoints of every strategy share one layout
    config.parallel.sequence = False   # a one-device decode has no sequence to split
    strategy = build_strategy(config, jax.devices()[:1], model_vocab_size(config, tokenizer.get_vocab_size(), 1))
    step, state = Checkpoints(run_dir / "checkpoints", config.train.keep_checkpoints).restore(strategy.abstract_state)
    if step is None:
        raise ConfigError("--run-dir", f"no readable checkpoint in '{run_dir / 'checkpoints'}'")
    text = complete(state["params"], strategy.model_cfg, tokenizer, prompt, max_tokens, context,
                    temperature=temperature, top_k=top_k, seed=seed)
    return step, text
