"""FP8 matmuls for mixed-precision training with per-tensor *current* scaling.

Forward operands in e4m3 (precision), gradients in e5m2 (range), each tensor divided
by amax / fmax before the cast, products accumulated in fp32 and rescaled; the
backward pass is written out (custom_vjp). Current scaling keeps the state stateless:
checkpoints and every strategy's layout stay those of fp32. Only activation x weight
matmuls use FP8; norms, softmax, RoPE and the loss stay fp32, activations bfloat16.
Lab 02's sheet (experiments/02_zero) explains the formats and the choices.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2


def quantize(x, dtype, scale=None):
    """x -> (x / scale as `dtype`, scale); by default scale = amax(|x|) / dtype's max (per tensor, current)."""
    fmax = float(jnp.finfo(dtype).max)                    # 448 for e4m3fn, 57344 for e5m2
    x32 = x.astype(jnp.float32)
    if scale is None:
        amax = jnp.max(jnp.abs(x32))
        scale = jnp.where(amax > 0, amax / fmax, 1.0)     # an all-zero tensor: any scale, avoid 0/0
    # Clip first: the convert to e4m3fn turns anything above 448 into NaN (no infinity in e4m3fn),
    # and x / scale can round a hair above fmax.
    return jnp.clip(x32 / scale, -fmax, fmax).astype(dtype), scale


def _dot(spec, a8, b8, scale, dtype):
    """fp8 x fp8 einsum, accumulated in fp32, multiplied back by the operands' scales, cast to `dtype`."""
    return (jnp.einsum(spec, a8, b8, preferred_element_type=jnp.float32) * scale).astype(dtype)


def _grad_specs(spec: str) -> tuple[str, str]:
    """'x,w->y' -> the einsums of dx = g . w and dw = x . g ('y,w->x', 'x,y->w')."""
    inputs, out = spec.replace(" ", "").split("->")
    x, w = inputs.split(",")
    for name, term, others in (("x", x, w + out), ("w", w, x + out)):
        if len(set(term)) != len(term) or not set(term) <= set(others):
            raise ValueError(f"fp8_einsum '{spec}': every index of {name} must appear once, and also in the "
                             "other operand or the output")
    return f"{out},{w}->{x}", f"{x},{out}->{w}"


@partial(jax.custom_vjp, nondiff_argnums=(0, 3))
def fp8_einsum(spec, x, w, preferred_element_type=None):
    """`jnp.einsum(spec, x, w)` with both operands in e4m3 and, in the backward pass, the gradient in e5m2.

    The backward pass is written out (custom_vjp): autodiff through the casts would round the
    gradient of each fp8 operand to fp8 with no scale (tests/test_fp8.py: 99.9% of a weight
    gradient underflows to 0). Here the incoming gradient is scaled into e5m2 and dx, dw are
    fp8 dots, rescaled. x and w share one dtype (bfloat16 in FP8 training), which the gradients get too; the output
    has `preferred_element_type`, or that dtype.
    """
    out, _ = _fp8_fwd(spec, x, w, preferred_element_type)
    return out


def _fp8_fwd(spec, x, w, preferred_element_type):
    _grad_specs(spec)                                     # check the spec at trace time
    if x.dtype != w.dtype:
        raise TypeError(f"fp8_einsum: x is {x.dtype} but w is {w.dtype}; cast both to one dtype")
    x8, sx = quantize(x, E4M3)
    w8, sw = quantize(w, E4M3)
    out = _dot(spec, x8, w8, sx * sw, preferred_element_type or x.dtype)
    # Residuals: the activation in fp8 (half the bytes of bf16), the weight unquantized. The weight is
    # re-quantized in the backward pass (elementwise, same scale, same result): under ZeRO-3 it is a
    # gathered weight, which must be re-gathered in the backward pass, not kept as a residual.
    # x8 is saved as its uint8 bits: jax.checkpoint passes saved float residuals through
    # reduce_precision(exponent_bits=4, mantissa_bits=3), whose IEEE semantics read e4m3fn's top
    # binade (256..448, where the amax lands) as infinity and return NaN (jax 0.10; JAX PR 22244).
    return out, (jax.lax.bitcast_convert_type(x8, jnp.uint8), sx, w, sw)


def _fp8_bwd(spec, _, residuals, g):
    x8_bits, sx, w, sw = residuals
    x8 = jax.lax.bitcast_convert_type(x8_bits, E4M3)
    w8, _ = quantize(w, E4M3, sw)                         # the forward's w8, recomputed
    g8, sg = quantize(g, E5M2)                            # gradients: e5m2, for range
    dx_spec, dw_spec = _grad_specs(spec)
    dx = _dot(dx_spec, g8, w8, sg * sw, w.dtype)          # x and w share w's dtype
    dw = _dot(dw_spec, x8, g8, sx * sg, w.dtype)
    return dx, dw


fp8_einsum.defvjp(_fp8_fwd, _fp8_bwd)
