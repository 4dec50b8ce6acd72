"""Pass 2 of the fused step: the update kernel of Adam/AdamW, SGD and Adagrad over a flat chunk of params.

Each program covers part of one param (``table`` row: start, end, param index) and first reads that param's
``ACTIVE`` scalar written by the finalize pass: 0 when the step is skipped or the param got no grad, and then
the program touches no memory. Otherwise it reads the 16-bit grad, multiplies it by the device coefficient
(inverse loss scale times clip coefficient: a power of two times the clip factor, so the result equals the
generic path's unscale-then-clip), updates the fp32 master and state in fp32, and writes the 16-bit param
rounded to nearest even (fp16 by the hardware conversion; bf16 by integer rounding of the fp32 bits, which
gives the same bits in the interpreter and on the GPU). ``PARAM`` = 0 for fp32 params that are their own
masters, 1 for fp16, 2 for bf16 (passed as an int16 view), 3 for bf16 with split masters (``optim/split.py``:
the master buffer is the int16 low half; the fp32 master is joined from the param and the low half in registers
and split back into both, never stored). ``ALIGNED``: every row starts and ends at a
multiple of ``ALIGN`` elements (the fused optimizers' padded layout), which lets Triton vectorise; the sharded
optimizer's pieces cut params anywhere, so their unaligned head and tail rows run with ``ALIGNED=False``.
``SHIFTED``: the param lives at another offset than the grad, master and state (the sharded optimizer's rank
shard of the global flat param buffer): row ``i`` adds ``shift[i]`` elements to its param addresses.
``KIND`` picks the algorithm (``slots.Kind``) and ``S`` is its table of ``pscal`` slots (``slots.py``); each
branch compiles only for its own ``KIND``. The ``@triton.jit`` helpers here are shared with ``lamb.py`` and
``norm.py`` (Triton inlines them).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from .launch import launch
from .settings import NO_FMA, settings
from .slots import ALIGN, PSCAL_SLOTS, PSCAL_WIDTH, Kind
from .split import join, split

__all__ = ["param_arg", "update"]

# Kernels may read only constexpr globals; Triton folds them and keys its cache on their values.
_ALIGN = tl.constexpr(ALIGN)
_PSCAL_WIDTH = tl.constexpr(PSCAL_WIDTH)
_ADAM, _SGD = tl.constexpr(int(Kind.ADAM)), tl.constexpr(int(Kind.SGD))


@triton.jit
def _store_master(master_ptr, offs, p, mask, PARAM: tl.constexpr):
    # the new fp32 master, or (PARAM 3) its low half
    if PARAM == 3:
        high, low = split(p)
        tl.store(master_ptr + offs, low.to(tl.int16), mask=mask)
    else:
        tl.store(master_ptr + offs, p, mask=mask)


@triton.jit
def _store_param(param_ptr, offs, p, mask, PARAM: tl.constexpr):
    # the 16-bit param rounded to nearest even, or (PARAM 3) ties away (PARAM 0: the master is the param)
    if PARAM == 1:
        tl.store(param_ptr + offs, p.to(tl.float16), mask=mask)
    elif PARAM == 2:
        b = p.to(tl.uint32, bitcast=True)
        r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        r = tl.where(p != p, (b >> 16) | 0x40, r)
        tl.store(param_ptr + offs, r.to(tl.int16), mask=mask)
    elif PARAM == 3:
        high, low = split(p)
        tl.store(param_ptr + offs, high.to(tl.int16), mask=mask)


@triton.jit
def _store(master_ptr, param_ptr, offs, p, mask, PARAM: tl.constexpr):
    # the new fp32 master, then the 16-bit param
    _store_master(master_ptr, offs, p, mask, PARAM)
    _store_param(param_ptr, offs, p, mask, PARAM)


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
def _grad_and_master(
    grad_ptr, param_ptr, master_ptr, scalars_ptr, start, end, PARAM: tl.constexpr, BLOCK: tl.constexpr
):
    coef = tl.load(scalars_ptr + 2)
    offs = start + tl.arange(0, BLOCK)
    mask = offs < end
    g = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32) * coef
    p = _load_master(param_ptr, master_ptr, offs, mask, PARAM)
    return offs, mask, g, p


@triton.jit
def _load_master(param_ptr, master_ptr, offs, mask, PARAM: tl.constexpr):
    # the fp32 master, or (PARAM 3) joined from the param's and the low half's patterns
    if PARAM == 3:
        p = join(
            tl.load(param_ptr + offs, mask=mask, other=0), tl.load(master_ptr + offs, mask=mask, other=0)
        )
    else:
        p = tl.load(master_ptr + offs, mask=mask, other=0.0)
    return p


@triton.jit
def _lerp(a, b, w):
    # torch's lerp: two formulas around w = 0.5, for accuracy at both ends.
    return tl.where(w < 0.5, a + w * (b - a), b - (b - a) * (1.0 - w))


@triton.jit
def _adam_moments(m, v, g, omb1, b2, omb2):
    # Adam's and LAMB's moments of one block (values in, values out: the kernels load and store them)
    m = _lerp(m, g, omb1)
    v = v * b2
    v = v + (omb2 * g) * g
    return m, v


@triton.jit
def _update_kernel(
    param_ptr, grad_ptr, master_ptr, a_ptr, b_ptr, table_ptr, pscal_ptr, scalars_ptr, shift_ptr,
    S: tl.constexpr, KIND: tl.constexpr, PARAM: tl.constexpr, ALIGNED: tl.constexpr, SHIFTED: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    # a, b: the state (Adam: exp_avg, exp_avg_sq; SGD: momentum_buffer; Adagrad: sum). Each branch loads every
    # scalar and state value before its first store: Triton cannot tell a store from the pscal row it would
    # read next, so a load after a store waits for it (the Adam step ran 2.27 ms instead of 1.98 at 268M so).
    # Adam keeps the order of its measured kernel: scalars, grad and master, moments; then master, moments and
    # the param stored (moments stored before the master: bf16 ran 2.10 ms against 2.00)
    start, end, ps = _row(table_ptr, pscal_ptr, tl.program_id(0), ALIGNED)
    if SHIFTED:  # the param's offset from the other buffers' coordinates (a multiple of ALIGN when aligned)
        shift = tl.load(shift_ptr + tl.program_id(0))
        if ALIGNED:
            shift = tl.multiple_of(shift, _ALIGN)
        param_ptr += shift
    if tl.load(ps + S.ACTIVE) != 0.0:
        if KIND == _ADAM:
            decay = tl.load(ps + S.DECAY)
            wd = tl.load(ps + S.WD)
            omb1 = tl.load(ps + S.OMB1)
            b2 = tl.load(ps + S.BETA2)
            omb2 = tl.load(ps + S.OMB2)
            bc2_sqrt = tl.load(ps + S.BC2_SQRT)
            eps = tl.load(ps + S.EPS)
            step_size = tl.load(ps + S.STEP_SIZE)
            offs, mask, g, p = _grad_and_master(
                grad_ptr, param_ptr, master_ptr, scalars_ptr, start, end, PARAM, BLOCK
            )
            m = tl.load(a_ptr + offs, mask=mask, other=0.0)
            v = tl.load(b_ptr + offs, mask=mask, other=0.0)
            p = p * decay  # decoupled decay (AdamW): 1 - lr * wd, else 1
            g = g + p * wd  # L2 decay (Adam): wd, else 0
            m, v = _adam_moments(m, v, g, omb1, b2, omb2)
            denom = tl.sqrt(v) / bc2_sqrt + eps
            p = p - step_size * (m / denom)
            _store_master(master_ptr, offs, p, mask, PARAM)
            tl.store(a_ptr + offs, m, mask=mask)
            tl.store(b_ptr + offs, v, mask=mask)
            _store_param(param_ptr, offs, p, mask, PARAM)
        elif KIND == _SGD:
            lr = tl.load(ps + S.LR)
            mom = tl.load(ps + S.MOMENTUM)
            omd = tl.load(ps + S.OMD)
            first = tl.load(ps + S.FIRST)
            nesterov = tl.load(ps + S.NESTEROV)
            wd = tl.load(ps + S.WD)
            has_mom = tl.load(ps + S.HAS_MOMENTUM)
            offs, mask, g, p = _grad_and_master(
                grad_ptr, param_ptr, master_ptr, scalars_ptr, start, end, PARAM, BLOCK
            )
            g = g + p * wd
            if has_mom != 0.0:
                buf = tl.load(a_ptr + offs, mask=mask, other=0.0)
                buf = tl.where(first != 0.0, g, buf * mom + omd * g)
                tl.store(a_ptr + offs, buf, mask=mask)
                g = tl.where(nesterov != 0.0, g + mom * buf, buf)
            p = p - lr * g
            _store(master_ptr, param_ptr, offs, p, mask, PARAM)
        else:  # Adagrad
            clr = tl.load(ps + S.CLR)
            eps = tl.load(ps + S.EPS)
            wd = tl.load(ps + S.WD)
            offs, mask, g, p = _grad_and_master(
                grad_ptr, param_ptr, master_ptr, scalars_ptr, start, end, PARAM, BLOCK
            )
            g = g + p * wd
            s = tl.load(a_ptr + offs, mask=mask, other=0.0) + g * g
            tl.store(a_ptr + offs, s, mask=mask)
            p = p - clr * (g / (tl.sqrt(s) + eps))
            _store(master_ptr, param_ptr, offs, p, mask, PARAM)


def param_arg(param: torch.Tensor, master: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The param buffer as the kernels take it, and its ``PARAM`` code (fp32 params: the master itself; an int16
    ``master`` is a split master's low half)."""
    if param.dtype == torch.float32:
        return master, 0
    if master.dtype == torch.int16:
        return param.view(torch.int16), 3
    if param.dtype == torch.bfloat16:
        return param.view(torch.int16), 2
    return param, 1


def update(
    kind: Kind, param, grad, master, state: Sequence[torch.Tensor], table, pscal, scalars, *, aligned=True,
    shift: torch.Tensor | None = None,
) -> None:  # fmt: skip
    """The update pass of Adam/AdamW, SGD or Adagrad over one flat chunk (decay kind, momentum etc. per param in
    ``pscal``). ``state``: the algorithm's fp32 state buffers (exp_avg and exp_avg_sq; momentum_buffer, or none
    when no group has momentum; sum). ``shift``: int64 per table row, elements added to the row's param offsets
    (None: the param shares the other buffers' coordinates)."""
    n = table.shape[0]
    if n == 0:
        return
    cfg = settings()
    p, code = param_arg(param, master)
    a, b = (*state, master, master)[:2]  # pointers the algorithm does not read
    launch(
        _update_kernel, (n,), p, grad, master, a, b, table, pscal, scalars, table if shift is None else shift,
        S=PSCAL_SLOTS[kind], KIND=int(kind), PARAM=code, ALIGNED=aligned, SHIFTED=shift is not None,
        BLOCK=cfg.update_block, num_warps=cfg.update_warps, **NO_FMA,
    )  # fmt: skip
