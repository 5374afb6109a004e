"""The SwiGLU's gating, silu(gate)·up, with a written-out backward: one copy for the dense MLP
(model/transformer.py, and so the shared experts) and the routed experts (model/moe.py).

Autodiff through `jax.nn.silu(gate) * up` keeps six [rows, F] states for the backward (gate, up and
silu's intermediates); `gated_silu` keeps gate and up and recomputes silu from them, so with the
product (down's input) a SwiGLU keeps three (parallel/expert_memory.py, SWIGLU_SAVED).
"""
from __future__ import annotations

import jax


@jax.custom_vjp
def gated_silu(gate, up):
    """silu(gate)·up, whose backward recomputes silu from gate and up rather than keeping its intermediates:
    autodiff would keep three more [rows, F] states per row, the largest part of what a SwiGLU holds for its
    backward (experiments/07_moe/README.md, "What an MoE layer keeps")."""
    return jax.nn.silu(gate) * up


def _gating_forward(gate, up):
    return gated_silu(gate, up), (gate, up)


def _gating_backward(kept, dy):
    gate, up = kept
    sigmoid = jax.nn.sigmoid(gate)
    silu = gate * sigmoid
    return dy * up * (sigmoid + silu * (1 - sigmoid)), dy * silu


gated_silu.defvjp(_gating_forward, _gating_backward)
