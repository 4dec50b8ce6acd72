"""LAMB's update passes: the per-param trust ratio needs each param's whole update before any element moves.

After the shared norm and finalize passes (``Kind.LAMB`` writes the ``AdamScalars`` slots of ``slots.py``, with
``STEP_SIZE`` = 1/bias_correction1: lr is applied after the trust ratio):

1. ``_lamb_stage_kernel`` (per block): new moments ``m``, ``v`` (stored), the update
   ``u = (m / bc1) / (sqrt(v) / sqrt(bc2) + eps) + wd * p`` and per-block partial sums of ``p*p`` and ``u*u``;
2. ``_lamb_trust_kernel`` (one program per param): sums its blocks' partials in a fixed order and stores the trust
   ratio ``||p|| / ||u||`` (1 when either norm is 0) in the param's ``TRUST`` slot;
3. ``_lamb_apply_kernel`` (per block): recomputes ``u`` from the stored moments and writes
   ``p - lr * trust * u`` to the master and the 16-bit param.

Split masters (``PARAM`` 3, ``update.py``): both the stage and the apply pass join the master from the param and
its low half; only the apply pass writes them.

42 B/param in all (2 norm + 22 stage + 18 apply) against Adam's 30.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import launch
from .settings import NO_FMA, settings
from .slots import ADAM_PSCAL
from .update import _adam_moments, _grad_and_master, _load_master, _pscal_row, _row, _store, param_arg

__all__ = ["lamb_update", "trust_table"]


@triton.jit
def _lamb_u(m, v, p, inv_bc1_ptr, bc2_sqrt_ptr, eps_ptr, wd_ptr):
    # the scalars are pointers into the param's pscal row
    denom = tl.sqrt(v) / tl.load(bc2_sqrt_ptr) + tl.load(eps_ptr)
    return (m * tl.load(inv_bc1_ptr)) / denom + tl.load(wd_ptr) * p


@triton.jit
def _lamb_stage_kernel(
    param_ptr, grad_ptr, master_ptr, m_ptr, v_ptr, table_ptr, pscal_ptr, scalars_ptr, part_ptr,
    S: tl.constexpr, PARAM: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    start, end, ps = _row(table_ptr, pscal_ptr, pid, True)
    if tl.load(ps + S.ACTIVE) != 0.0:
        # every load before the first store (see update._update_kernel)
        omb1 = tl.load(ps + S.OMB1)
        b2 = tl.load(ps + S.BETA2)
        omb2 = tl.load(ps + S.OMB2)
        offs, mask, g, p = _grad_and_master(
            grad_ptr, param_ptr, master_ptr, scalars_ptr, start, end, PARAM, BLOCK
        )
        m = tl.load(m_ptr + offs, mask=mask, other=0.0)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0)
        m, v = _adam_moments(m, v, g, omb1, b2, omb2)
        u = _lamb_u(m, v, p, ps + S.STEP_SIZE, ps + S.BC2_SQRT, ps + S.EPS, ps + S.WD_RAW)
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)
        tl.store(part_ptr + pid * 2, tl.sum(p * p, axis=0))
        tl.store(part_ptr + pid * 2 + 1, tl.sum(u * u, axis=0))


@triton.jit
def _lamb_trust_kernel(part_ptr, rows_ptr, pscal_ptr, S: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    first = tl.load(rows_ptr + pid * 3)
    last = tl.load(rows_ptr + pid * 3 + 1)
    ps = _pscal_row(pscal_ptr, tl.load(rows_ptr + pid * 3 + 2))
    if tl.load(ps + S.ACTIVE) != 0.0:
        offs = tl.arange(0, BLOCK)
        pp = tl.zeros([BLOCK], dtype=tl.float32)
        uu = tl.zeros([BLOCK], dtype=tl.float32)
        for base in range(first, last, BLOCK):
            o = base + offs
            mk = o < last
            pp += tl.load(part_ptr + o * 2, mask=mk, other=0.0)
            uu += tl.load(part_ptr + o * 2 + 1, mask=mk, other=0.0)
        w_norm = tl.sqrt(tl.sum(pp, axis=0))
        u_norm = tl.sqrt(tl.sum(uu, axis=0))
        trust = tl.where((w_norm > 0.0) & (u_norm > 0.0), w_norm / u_norm, 1.0)
        tl.store(ps + S.TRUST, trust)


@triton.jit
def _lamb_apply_kernel(
    param_ptr, master_ptr, m_ptr, v_ptr, table_ptr, pscal_ptr,
    S: tl.constexpr, PARAM: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    start, end, ps = _row(table_ptr, pscal_ptr, tl.program_id(0), True)
    if tl.load(ps + S.ACTIVE) != 0.0:
        offs = start + tl.arange(0, BLOCK)
        mask = offs < end
        p = _load_master(param_ptr, master_ptr, offs, mask, PARAM)
        m = tl.load(m_ptr + offs, mask=mask, other=0.0)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0)
        u = _lamb_u(m, v, p, ps + S.STEP_SIZE, ps + S.BC2_SQRT, ps + S.EPS, ps + S.WD_RAW)
        p = p - (tl.load(ps + S.LR) * tl.load(ps + S.TRUST)) * u
        _store(master_ptr, param_ptr, offs, p, mask, PARAM)


def trust_table(update_table: torch.Tensor) -> torch.Tensor:
    """int64 [params in chunk, 3]: (first row, end row, global param index) of each param's update blocks."""
    index, counts = torch.unique_consecutive(update_table[:, 2].cpu(), return_counts=True)
    ends = counts.cumsum(0)
    return torch.stack([ends - counts, ends, index], dim=1).to(update_table.device)


def lamb_update(
    param, grad, master, exp_avg, exp_avg_sq, table, trust_rows, partials, pscal, scalars
) -> None:
    """The three LAMB passes over one flat chunk (``partials``: fp32 [table rows, 2] scratch)."""
    n = table.shape[0]
    if n == 0:
        return
    cfg = settings()
    p, code = param_arg(param, master)
    launch(
        _lamb_stage_kernel, (n,), p, grad, master, exp_avg, exp_avg_sq, table, pscal, scalars, partials,
        S=ADAM_PSCAL, PARAM=code, BLOCK=cfg.update_block, num_warps=cfg.update_warps, **NO_FMA,
    )  # fmt: skip
    launch(
        _lamb_trust_kernel, (trust_rows.shape[0],), partials, trust_rows, pscal,
        S=ADAM_PSCAL, BLOCK=cfg.final_block, num_warps=cfg.final_warps,
    )  # fmt: skip
    launch(
        _lamb_apply_kernel, (n,), p, master, exp_avg, exp_avg_sq, table, pscal,
        S=ADAM_PSCAL, PARAM=code, BLOCK=cfg.update_block, num_warps=cfg.update_warps, **NO_FMA,
    )  # fmt: skip
