"""Fused RMSNorm forward and backward as Pallas kernels, beside the reference (`model.ops.rms_norm`).

Unfused, RMSNorm is several passes over [tokens, D]: square, mean, rsqrt, two multiplies,
each reading and writing memory (XLA fuses most of them; eager PyTorch does not, which is
why Apex and Liger ship fused versions). Fused:

forward   one program per block of rows: read x once, write y = x · rstd · scale and the
          per-row rstd = 1/sqrt(mean(x²) + eps) (fp32, [tokens]: the only residual).
backward  with g = dy · scale and x̂ = x · rstd:  dx = rstd · (g - x̂ · mean(g · x̂)).
          d(scale) = Σ_rows dy · x̂ sums over every token: each of `programs` programs walks
          its own contiguous rows, keeps a partial sum in registers and writes one row of
          partials [programs, D]; XLA adds those (Liger's and Apex's scheme, no atomics).

The math is fp32 whatever the activation dtype, as in the reference. Triton block shapes
are powers of two: D is padded with zero columns up to one (zeros add nothing to Σx²; the
mean divides by the real D) and the rows up to a whole number of blocks.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxpar.kernels import varying
from jaxpar.model.ops import rms_norm as rms_norm_reference  # noqa: F401 - the reference the tests compare to


@dataclasses.dataclass(frozen=True)
class Layout:
    """Static settings: padded row/column counts, rows per block, backward programs, eps, backend."""

    rows: int
    width: int               # the real D
    padded_width: int
    block_rows: int
    programs: int            # backward programs; each walks `blocks_per_program` row blocks
    blocks_per_program: int
    eps: float
    interpret: bool

    @property
    def padded_rows(self) -> int:
        return self.programs * self.blocks_per_program * self.block_rows


def plan(rows: int, width: int, eps: float, interpret: bool, block_rows: int | None = None,
         programs: int = 128) -> Layout:
    padded_width = pl.next_power_of_2(width)
    if block_rows is None:                     # ~8K elements per block: registers, not local memory
        block_rows = max(1, min(64, 8192 // padded_width))
    if block_rows & (block_rows - 1):
        raise ValueError(f"block_rows={block_rows} must be a power of two")
    blocks = pl.cdiv(rows, block_rows)
    programs = max(1, min(programs, blocks))
    return Layout(rows, width, padded_width, block_rows, programs, pl.cdiv(blocks, programs), float(eps), interpret)


def _forward_kernel(x_ref, scale_ref, y_ref, rstd_ref, *, c: Layout):
    x = x_ref[...].astype(jnp.float32)                                 # [block_rows, Dp]
    rstd = jax.lax.rsqrt(jnp.sum(x * x, axis=1) / c.width + c.eps)
    y_ref[...] = (x * rstd[:, None] * scale_ref[...].astype(jnp.float32)[None, :]).astype(y_ref.dtype)
    rstd_ref[...] = rstd


def _backward_kernel(x_ref, scale_ref, dy_ref, rstd_ref, dx_ref, dscale_ref, *, c: Layout):
    p = pl.program_id(0)
    scale = scale_ref[...].astype(jnp.float32)

    def block(n, dscale):
        rows = pl.ds((p * c.blocks_per_program + n) * c.block_rows, c.block_rows)
        x, dy = x_ref[rows, :].astype(jnp.float32), dy_ref[rows, :].astype(jnp.float32)
        rstd = rstd_ref[rows]
        x_hat = x * rstd[:, None]
        g = dy * scale[None, :]
        dx = rstd[:, None] * (g - x_hat * (jnp.sum(g * x_hat, axis=1) / c.width)[:, None])
        dx_ref[rows, :] = dx.astype(dx_ref.dtype)
        return dscale + jnp.sum(dy * x_hat, axis=0)

    dscale_ref[...] = jax.lax.fori_loop(0, c.blocks_per_program, block, jnp.zeros((c.padded_width,), jnp.float32))


def _compiler_params(interpret: bool):
    if interpret:
        return None
    from jax.experimental.pallas import triton as plgpu
    return plgpu.CompilerParams(num_warps=4, num_stages=1)


def _forward(x2, scale, c: Layout):
    row_block = pl.BlockSpec((c.block_rows, c.padded_width), lambda i: (i, 0))
    whole_scale = pl.BlockSpec((c.padded_width,), lambda i: (0,))
    nbytes = 2 * x2.size * x2.dtype.itemsize
    (x2, scale), axes = varying.match(x2, scale)
    return pl.pallas_call(
        functools.partial(_forward_kernel, c=c), grid=(c.padded_rows // c.block_rows,),
        in_specs=[row_block, whole_scale],
        out_specs=[row_block, pl.BlockSpec((c.block_rows,), lambda i: (i,))],
        out_shape=[varying.struct(x2.shape, x2.dtype, axes), varying.struct((c.padded_rows,), jnp.float32, axes)],
        compiler_params=_compiler_params(c.interpret),
        cost_estimate=pl.CostEstimate(flops=4 * x2.size, transcendentals=c.padded_rows, bytes_accessed=nbytes),
        interpret=c.interpret, name="jaxpar_rms_norm_forward",
    )(x2, scale)


def _backward(x2, scale, rstd, dy2, c: Layout):
    whole = lambda shape: pl.BlockSpec(shape, lambda p: (0,) * len(shape))
    matrix = whole((c.padded_rows, c.padded_width))
    nbytes = 3 * x2.size * x2.dtype.itemsize
    (x2, scale, dy2, rstd), axes = varying.match(x2, scale, dy2, rstd)
    dx, partial = pl.pallas_call(
        functools.partial(_backward_kernel, c=c), grid=(c.programs,),
        in_specs=[matrix, whole((c.padded_width,)), matrix, whole((c.padded_rows,))],
        out_specs=[matrix, pl.BlockSpec((None, c.padded_width), lambda p: (p, 0))],
        out_shape=[varying.struct(x2.shape, x2.dtype, axes),
                   varying.struct((c.programs, c.padded_width), jnp.float32, axes)],
        compiler_params=_compiler_params(c.interpret),
        cost_estimate=pl.CostEstimate(flops=9 * x2.size, transcendentals=0, bytes_accessed=nbytes),
        interpret=c.interpret, name="jaxpar_rms_norm_backward",
    )(x2, scale, dy2, rstd)
    return dx, jnp.sum(partial, axis=0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _norm(x2, scale, c: Layout):
    return _forward(x2, scale, c)[0]


def _norm_fwd(x2, scale, c: Layout):
    y, rstd = _forward(x2, scale, c)
    return y, (x2, scale, rstd)


def _norm_bwd(c: Layout, residuals, dy2):
    x2, scale, rstd = residuals
    dx, dscale = _backward(x2, scale, rstd, dy2, c)
    return dx, dscale.astype(scale.dtype)


_norm.defvjp(_norm_fwd, _norm_bwd)


def rms_norm(x, scale, eps, *, interpret: bool | None = None, block_rows: int | None = None):
    """RMSNorm over the last axis of x [..., D] with `scale` [D]: the same result as the reference."""
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    *lead, width = x.shape
    rows = 1
    for n in lead:
        rows *= n
    c = plan(rows, width, eps, interpret, block_rows)
    x2 = x.reshape(rows, width)
    if (c.padded_rows, c.padded_width) != (rows, width):
        x2 = jnp.pad(x2, ((0, c.padded_rows - rows), (0, c.padded_width - width)))
        scale = jnp.pad(scale, (0, c.padded_width - width))
    (x2, scale), _ = varying.match(x2, scale)      # as jnp would: an invariant scale meets varying rows
    y = _norm(x2, scale, c)
    return y[:rows, :width].reshape(x.shape)
