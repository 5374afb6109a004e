"""How big the dropless expert exchange's buffers are (parallel/expert_exchange.py), per device and MoE layer.

Plain Python (no JAX): the exchange builds its buffers with these sizes, `theory.moe_all_to_all_bytes` predicts
the bytes they send and `memory` the bytes they hold. T tokens on the device, k experts per token, E experts on
X devices; a token's k experts are distinct, so at most min(k, E/X) of its copies go to one device.
"""
from __future__ import annotations

import math

SLACK = 1.25             # capacity and ragged buffers: this times the balanced share of the routed rows


def resolve(exchange: str, platform: str) -> str:
    """parallel.expert_exchange `auto` -> ragged on GPU/TPU (XLA:CPU has no ragged-all-to-all), capacity elsewhere."""
    if exchange != "auto":
        return exchange
    return "ragged" if platform in ("gpu", "cuda", "rocm", "tpu") else "capacity"


def padded_chunk_rows(tokens: int, top_k: int, local_experts: int) -> int:
    """Rows of one destination's padded chunk: the most assignments a device can send to one other device."""
    return tokens * min(top_k, local_experts)


def capacity_chunk_rows(tokens: int, top_k: int, experts: int, devices: int) -> int:
    """Rows of one destination's capacity chunk: SLACK x the balanced share T·k/X, at most the padded chunk."""
    return min(padded_chunk_rows(tokens, top_k, experts // devices), math.ceil(SLACK * tokens * top_k / devices))


def ragged_buffer_rows(tokens: int, top_k: int, experts: int, devices: int) -> int:
    """Rows a device receives into under the ragged exchange: SLACK x T·k, at most what X padded chunks hold."""
    return min(devices * padded_chunk_rows(tokens, top_k, experts // devices), math.ceil(SLACK * tokens * top_k))


def received_rows(exchange: str, tokens: int, top_k: int, experts: int, devices: int) -> int:
    """Rows a device's buffers hold per exchange when the routing does not overflow (`exchange` resolved)."""
    if exchange == "ragged":
        return ragged_buffer_rows(tokens, top_k, experts, devices)
    if exchange == "capacity":
        return devices * capacity_chunk_rows(tokens, top_k, experts, devices)
    return devices * padded_chunk_rows(tokens, top_k, experts // devices)
