"""FLOPs of the fused kernels in a traced step: what XLA's cost analysis cannot see.

On GPU a Pallas kernel is one custom call (`__gpu$xla.gpu.triton`) and cuDNN's attention
another (`__cudnn$fmha...`); HloCostAnalysis counts a custom call as zero FLOPs, so a
step with flash attention would report too few FLOPs and too low an MFU. The kernels'
work is read from the step's jaxpr instead:

- `pallas_call`: the `CostEstimate` each jaxpar kernel attaches (block matmuls it executes:
  forward 2 per visited block pair, dq 3, dk/dv 4; RMSNorm's elementwise work);
- cuDNN attention (`dot_product_attention_fwd/bwd`): 4·B·N·T·S·H forward, 2.5x that
  backward (FlashAttention's convention; halved for a causal mask);

each times the trip counts of the `scan`s around it (the layer scan, gradient accumulation).
Shapes inside a shard_map are a device's, so the count is per device. On CPU the kernels run
interpreted, as ordinary XLA loops that the HLO count already sees: `hlo_has_kernels` tells
`measure.flops.compiled_flops` when to add these FLOPs.
"""
from __future__ import annotations

import dataclasses

import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr

CUDNN_ATTENTION = {"dot_product_attention_fwd": 1.0, "dot_product_attention_fwd_wrapper": 1.0,
                   "dot_product_attention_bwd": 2.5, "dot_product_attention_bwd_wrapper": 2.5}
KERNEL_CALL_TARGETS = ("__gpu$xla.gpu.triton", "mosaic_gpu", "__cudnn$fmha")


@dataclasses.dataclass(frozen=True)
class KernelFlops:
    total: float
    by_kernel: dict          # kernel name -> FLOPs per step
    loops_unknown: bool      # a while loop (unknown trip count) encloses a kernel: counted once


def _subjaxprs(params):
    for value in params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, ClosedJaxpr):
                yield item.jaxpr
            elif isinstance(item, Jaxpr):
                yield item


def _cudnn_flops(eqn) -> float:
    q, k = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape      # [B, T, N, H], [B, S, K, H]
    forward = 4.0 * q[0] * q[2] * q[1] * k[1] * q[3]
    causal = "causal" in str(eqn.params.get("mask_type", "")).lower()
    return forward * CUDNN_ATTENTION[eqn.primitive.name] * (0.5 if causal else 1.0)


def kernel_flops(jaxpr) -> KernelFlops:
    """FLOPs per step of every Pallas and cuDNN kernel in `jaxpr` (a ClosedJaxpr or Jaxpr, e.g. a traced step)."""
    by_kernel: dict[str, float] = {}
    unknown = False

    def walk(jx: Jaxpr, times: float, in_while: bool):
        nonlocal unknown
        for eqn in jx.eqns:
            name = eqn.primitive.name
            if name == "pallas_call":
                cost = eqn.params.get("cost_estimate")
                kernel = eqn.params.get("name") or "pallas_call"
                by_kernel[kernel] = by_kernel.get(kernel, 0.0) + (cost.flops if cost else 0) * times
                unknown = unknown or in_while
                continue                              # its jaxpr is the kernel body, not more calls
            if name in CUDNN_ATTENTION:
                by_kernel[name] = by_kernel.get(name, 0.0) + _cudnn_flops(eqn) * times
                unknown = unknown or in_while
                continue
            inner = times * eqn.params["length"] if name == "scan" else times
            for sub in _subjaxprs(eqn.params):
                walk(sub, inner, in_while or name == "while")

    walk(jaxpr.jaxpr if isinstance(jaxpr, ClosedJaxpr) else jaxpr, 1.0, False)
    return KernelFlops(float(np.sum(list(by_kernel.values()))) if by_kernel else 0.0, by_kernel, unknown)


def hlo_has_kernels(hlo_text: str) -> bool:
    """Whether the compiled program runs kernels as custom calls (GPU), which HloCostAnalysis counts as zero."""
    return any(target in hlo_text for target in KERNEL_CALL_TARGETS)
