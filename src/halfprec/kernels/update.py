"""Pass 2 of the fused step: one update kernel per algorithm over a flat chunk of params.

Each program covers part of one param (``table`` row: start, end, param index) and first reads that param's
``ACTIVE`` scalar written by the finalize pass: 0 when the step is skipped or the param got no grad, and then
the program touches no memory. Otherwise it reads the 16-bit grad, multiplies it by the device coefficient
(inverse loss scale times clip coefficient: a power of two times the clip factor, so the result equals the
generic path's unscale-then-clip), updates the fp32 master and state in fp32, and writes the 16-bit param
rounded to nearest even (fp16 by the hardware conversion; bf16 by integer rounding of the fp32 bits, which
gives the same bits in the interpreter and on the GPU). ``PARAM`` = 0 for fp32 params that are their own
masters, 1 for fp16, 2 for bf16 (passed as an int16 view). ``ALIGNED``: every row starts and ends at a
multiple of ``ALIGN`` elements (the fused optimizers' padded layout), which lets Triton vectorise; the sharded
optimizer's pieces cut params anywhere, so their unaligned head and tail rows run with ``ALIGNED=False``.
``S``: the algorithm's table of ``pscal`` slots (``slots.py``).

The ``@triton.jit`` helpers here are shared with ``lamb.py`` and ``norm.py``; Triton inlines them, so they cost
nothing at run time.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .settings import settings
from .slots import ADAGRAD_PSCAL, ADAM_PSCAL, ALIGN, PSCAL_WIDTH, SGD_PSCAL

__all__ = ["adam_update", "sgd_update", "adagrad_update", "PARAM_CODES"]

PARAM_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}

# Kernels may read only constexpr globals; Triton folds them and keys its cache on their values.
_ALIGN = tl.constexpr(ALIGN)
_PSCAL_WIDTH = tl.constexpr(PSCAL_WIDTH)


@triton.jit
def _store_param(param_ptr, offs, x, mask, PARAM: tl.constexpr):
    if PARAM == 1:
        tl.store(param_ptr + offs, x.to(tl.float16), mask=mask)
    elif PARAM == 2:
        b = x.to(tl.uint32, bitcast=True)
        r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        r = tl.where(x != x, (b >> 16) | 0x40, r)
        tl.store(param_ptr + offs, r.to(tl.int16), mask=mask)


@triton.jit
def _pscal_row(pscal_ptr, index):
    return pscal_ptr + index * _PSCAL_WIDTH


@triton.jit
def _row(table_ptr, pscal_ptr, pid, ALIGNED: tl.constexpr):
    start = tl.load(table_ptr + pid * 3)
    end = tl.load(table_ptr + pid * 3 + 1)
    if ALIGNED:  # lets Triton vectorise the loads and stores
        start = tl.multiple_of(start, _ALIGN)
        end = tl.multiple_of(end, _ALIGN)
    return start, end, _pscal_row(pscal_ptr, tl.load(table_ptr + pid * 3 + 2))


@triton.jit
def _grad_and_master(grad_ptr, master_ptr, scalars_ptr, start, end, BLOCK: tl.constexpr):
    coef = tl.load(scalars_ptr + 2)
    offs = start + tl.arange(0, BLOCK)
    mask = offs < end
    g = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32) * coef
    p = tl.load(master_ptr + offs, mask=mask, other=0.0)
    return offs, mask, g, p


@triton.jit
def _lerp(a, b, w):
    # torch's lerp: two formulas around w = 0.5, for accuracy at both ends.
    return tl.where(w < 0.5, a + w * (b - a), b - (b - a) * (1.0 - w))


@triton.jit
def _adam_moments(m, v, g, omb1, b2, omb2):
    m = _lerp(m, g, omb1)
    v = v * b2
    v = v + (omb2 * g) * g
    return m, v


@triton.jit
def _adam_kernel(
    param_ptr, grad_ptr, master_ptr, m_ptr, v_ptr, table_ptr, pscal_ptr, scalars_ptr,
    S: tl.constexpr, PARAM: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    start, end, ps = _row(table_ptr, pscal_ptr, tl.program_id(0), ALIGNED)
    active = tl.load(ps + S.ACTIVE)
    if active != 0.0:
        step_size = tl.load(ps + S.STEP_SIZE)
        bc2_sqrt = tl.load(ps + S.BC2_SQRT)
        decay = tl.load(ps + S.DECAY)
        wd = tl.load(ps + S.WD)
        omb1 = tl.load(ps + S.OMB1)
        b2 = tl.load(ps + S.BETA2)
        omb2 = tl.load(ps + S.OMB2)
        eps = tl.load(ps + S.EPS)
        offs, mask, g, p = _grad_and_master(grad_ptr, master_ptr, scalars_ptr, start, end, BLOCK)
        m = tl.load(m_ptr + offs, mask=mask, other=0.0)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0)
        p = p * decay  # decoupled decay (AdamW): 1 - lr * wd, else 1
        g = g + p * wd  # L2 decay (Adam): wd, else 0
        m, v = _adam_moments(m, v, g, omb1, b2, omb2)
        denom = tl.sqrt(v) / bc2_sqrt + eps
        p = p - step_size * (m / denom)
        tl.store(master_ptr + offs, p, mask=mask)
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)
        _store_param(param_ptr, offs, p, mask, PARAM)


@triton.jit
def _sgd_kernel(
    param_ptr, grad_ptr, master_ptr, buf_ptr, table_ptr, pscal_ptr, scalars_ptr,
    S: tl.constexpr, PARAM: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    start, end, ps = _row(table_ptr, pscal_ptr, tl.program_id(0), ALIGNED)
    active = tl.load(ps + S.ACTIVE)
    if active != 0.0:
        lr = tl.load(ps + S.LR)
        mom = tl.load(ps + S.MOMENTUM)
        omd = tl.load(ps + S.OMD)
        wd = tl.load(ps + S.WD)
        first = tl.load(ps + S.FIRST)
        nesterov = tl.load(ps + S.NESTEROV)
        has_mom = tl.load(ps + S.HAS_MOMENTUM)
        offs, mask, g, p = _grad_and_master(grad_ptr, master_ptr, scalars_ptr, start, end, BLOCK)
        g = g + p * wd
        if has_mom != 0.0:
            buf = tl.load(buf_ptr + offs, mask=mask, other=0.0)
            buf = tl.where(first != 0.0, g, buf * mom + omd * g)
            tl.store(buf_ptr + offs, buf, mask=mask)
            g = tl.where(nesterov != 0.0, g + mom * buf, buf)
        p = p - lr * g
        tl.store(master_ptr + offs, p, mask=mask)
        _store_param(param_ptr, offs, p, mask, PARAM)


@triton.jit
def _adagrad_kernel(
    param_ptr, grad_ptr, master_ptr, sum_ptr, table_ptr, pscal_ptr, scalars_ptr,
    S: tl.constexpr, PARAM: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    start, end, ps = _row(table_ptr, pscal_ptr, tl.program_id(0), ALIGNED)
    active = tl.load(ps + S.ACTIVE)
    if active != 0.0:
        clr = tl.load(ps + S.CLR)
        wd = tl.load(ps + S.WD)
        eps = tl.load(ps + S.EPS)
        offs, mask, g, p = _grad_and_master(grad_ptr, master_ptr, scalars_ptr, start, end, BLOCK)
        s = tl.load(sum_ptr + offs, mask=mask, other=0.0)
        g = g + p * wd
        s = s + g * g
        std = tl.sqrt(s) + eps
        p = p - clr * (g / std)
        tl.store(master_ptr + offs, p, mask=mask)
        tl.store(sum_ptr + offs, s, mask=mask)
        _store_param(param_ptr, offs, p, mask, PARAM)


def _param_arg(param: torch.Tensor, master: torch.Tensor) -> tuple[torch.Tensor, int]:
    code = PARAM_CODES[param.dtype]
    if code == 0:
        return master, 0
    if code == 2:
        return param.view(torch.int16), 2
    return param, 1


def _launch(kernel, slots, param, grad, master, state, table, pscal, scalars, aligned: bool) -> None:
    n = table.shape[0]
    if n == 0:
        return
    cfg = settings()
    p, code = _param_arg(param, master)
    kernel[(n,)](
        p, grad, master, *state, table, pscal, scalars,
        S=slots, PARAM=code, ALIGNED=aligned, BLOCK=cfg.update_block, num_warps=cfg.update_warps,
    )  # fmt: skip


def adam_update(
    param, grad, master, exp_avg, exp_avg_sq, table, pscal, scalars, *, aligned: bool = True
) -> None:
    """Adam/AdamW update of one flat chunk (decay kind per param in ``pscal``)."""
    _launch(
        _adam_kernel, ADAM_PSCAL, param, grad, master, (exp_avg, exp_avg_sq), table, pscal, scalars, aligned
    )


def sgd_update(param, grad, master, momentum_buffer, table, pscal, scalars, *, aligned: bool = True) -> None:
    """SGD update (momentum, dampening, nesterov per param in ``pscal``); ``momentum_buffer`` may be None."""
    buf = master if momentum_buffer is None else momentum_buffer
    _launch(_sgd_kernel, SGD_PSCAL, param, grad, master, (buf,), table, pscal, scalars, aligned)


def adagrad_update(param, grad, master, state_sum, table, pscal, scalars, *, aligned: bool = True) -> None:
    """Adagrad update of one flat chunk."""
    _launch(_adagrad_kernel, ADAGRAD_PSCAL, param, grad, master, (state_sum,), table, pscal, scalars, aligned)
