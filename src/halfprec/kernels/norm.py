"""Pass 1 of the fused step: the global sum of squares and the non-finite flag, then the per-param scalars.

``_sumsq_kernel`` reads each 16-bit grad once (2 B/param), unscaled by the device loss scale, and writes one
partial sum and one non-finite count per program (a fixed order, so the norm is deterministic; no atomics);
params that got no grad this step are masked out, so a stale view never enters the norm. ``_finalize_kernel``
(one program) sums the partials, decides the skip (non-finite grads, or a norm that overflowed fp32, as on the
exact path), computes the clip coefficient as ``torch.nn.utils.clip_grads_with_norm_`` does, advances the step
counters of the params that got a grad, writes the update pass's per-param scalars (bias corrections in fp64,
cast to fp32 as torch does with its Python-double scalars), clears the grad marks (``flags``) and, given a
dynamic loss scaler, runs its update (``scaler.py``) with no launch of its own.

Legend: ``table`` int64 [programs, 3] = (start, end, param index) into a flat buffer; ``hp`` fp64 [groups,
HP_WIDTH] and ``pscal`` fp32 [params, PSCAL_WIDTH], whose slots ``slots.py`` names (``H`` and ``S``: the tables of
``KIND``); ``scalars`` fp32 [8] = (found_inf, grad_norm, grad coefficient = inv_scale * clip, skipped_steps, loss
scale used, loss scale after).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..scaler import DynamicLossScaler
from .launch import launch
from .scaler import _dynamic_step, scaler_args
from .settings import settings
from .slots import HP_SLOTS, HP_WIDTH, PSCAL_SLOTS, Kind
from .update import _ALIGN, _pscal_row

__all__ = ["sumsq", "finalize"]

# Kernels may read only constexpr globals; Triton folds them and keys its cache on their values.
_HP_WIDTH = tl.constexpr(HP_WIDTH)
_ADAM, _SGD, _LAMB = tl.constexpr(int(Kind.ADAM)), tl.constexpr(int(Kind.SGD)), tl.constexpr(int(Kind.LAMB))


@triton.jit
def _sumsq_kernel(grad_ptr, table_ptr, flags_ptr, scale_ptr, sq_ptr, bad_ptr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    start = tl.multiple_of(tl.load(table_ptr + pid * 3), _ALIGN)
    end = tl.load(table_ptr + pid * 3 + 1)
    pidx = tl.load(table_ptr + pid * 3 + 2)
    got = tl.load(flags_ptr + pidx)
    inv = 1.0 / tl.load(scale_ptr)
    end = tl.multiple_of(tl.where(got != 0, end, start), _ALIGN)  # no grad this step: read nothing
    offs = start + tl.arange(0, BLOCK)
    mask = offs < end
    g = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32) * inv
    sq = tl.sum(g * g, axis=0)
    bad = tl.sum(tl.where((g - g) == 0.0, 0.0, 1.0), axis=0)
    tl.store(sq_ptr + pid, sq)
    tl.store(bad_ptr + pid, bad)


@triton.jit
def _finalize_kernel(
    sq_ptr, bad_ptr, n_partials, scale_ptr, scalars_ptr, max_norm,
    flags_ptr, steps_ptr, pgroup_ptr, hp_ptr, pscal_ptr, n_params,
    tracker_ptr, left_ptr, growth_factor, backoff_factor, growth_interval, hysteresis, min_scale,
    CHECK: tl.constexpr, CLIP: tl.constexpr, KIND: tl.constexpr, H: tl.constexpr, S: tl.constexpr,
    SCALER: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    nbad = tl.zeros([BLOCK], dtype=tl.float32)
    for base in range(0, n_partials, BLOCK):
        o = base + offs
        m = o < n_partials
        acc += tl.load(sq_ptr + o, mask=m, other=0.0)
        nbad += tl.load(bad_ptr + o, mask=m, other=0.0)
    sumsq = tl.sum(acc, axis=0)
    bad = tl.sum(nbad, axis=0)
    norm = tl.sqrt(sumsq)
    scale = tl.load(scale_ptr)
    if SCALER:
        tracker = tl.load(tracker_ptr)
        left = tl.load(left_ptr)
    coef = 1.0 / scale
    found = 0.0
    if CHECK:
        found = tl.where((bad > 0.0) | ((sumsq - sumsq) != 0.0), 1.0, 0.0)
    if CLIP:
        clip = max_norm / (norm + 1e-6)
        clip = tl.minimum(clip, 1.0)
        coef = coef * clip
    skipped = tl.load(scalars_ptr + 3)
    tl.store(scalars_ptr, found)
    tl.store(scalars_ptr + 1, norm)
    tl.store(scalars_ptr + 2, coef)
    tl.store(scalars_ptr + 3, skipped + found)
    tl.store(scalars_ptr + 4, scale)
    scale_after = scale
    if SCALER:
        scale_after = _dynamic_step(
            found, scale, tracker, left, scale_ptr, tracker_ptr, left_ptr,
            growth_factor, backoff_factor, growth_interval, hysteresis, min_scale,
        )  # fmt: skip
    tl.store(scalars_ptr + 5, scale_after)
    go = 1.0 - found
    for base in range(0, n_params, BLOCK):
        o = base + offs
        m = o < n_params
        act = tl.load(flags_ptr + o, mask=m, other=0).to(tl.float32) * go
        tl.store(flags_ptr + o, tl.zeros_like(o).to(tl.int32), mask=m)  # the grad marks are consumed
        s = tl.load(steps_ptr + o, mask=m, other=0.0) + act
        tl.store(steps_ptr + o, s, mask=m)
        hp = hp_ptr + tl.load(pgroup_ptr + o, mask=m, other=0).to(tl.int64) * _HP_WIDTH
        ps = _pscal_row(pscal_ptr, o.to(tl.int64))
        s64 = s.to(tl.float64)
        tl.store(ps + S.ACTIVE, act, mask=m)
        if KIND == _ADAM or KIND == _LAMB:  # noqa: SIM109 (@triton.jit compiles no `in`)
            lr = tl.load(hp + H.LR, mask=m, other=0.0)
            b1 = tl.load(hp + H.BETA1, mask=m, other=0.5)
            b2 = tl.load(hp + H.BETA2, mask=m, other=0.5)
            eps = tl.load(hp + H.EPS, mask=m, other=0.0)
            wd = tl.load(hp + H.WEIGHT_DECAY, mask=m, other=0.0)
            dec = tl.load(hp + H.DECOUPLED, mask=m, other=0.0)
            # counters at 0 (params never stepped) would divide 0 by 0; their scalars are not read
            s64 = tl.where(s64 > 0.0, s64, 1.0)
            bc1 = 1.0 - tl.exp(s64 * tl.log(b1))
            bc2 = 1.0 - tl.exp(s64 * tl.log(b2))
            if KIND == _ADAM:
                tl.store(ps + S.STEP_SIZE, (lr / bc1).to(tl.float32), mask=m)
            else:  # LAMB applies lr after the trust ratio
                tl.store(ps + S.STEP_SIZE, (1.0 / bc1).to(tl.float32), mask=m)
            tl.store(ps + S.BC2_SQRT, tl.sqrt(bc2).to(tl.float32), mask=m)
            tl.store(ps + S.DECAY, tl.where(dec != 0.0, 1.0 - lr * wd, 1.0).to(tl.float32), mask=m)
            tl.store(ps + S.WD, tl.where(dec != 0.0, 0.0, wd).to(tl.float32), mask=m)
            tl.store(ps + S.OMB1, (1.0 - b1).to(tl.float32), mask=m)
            tl.store(ps + S.BETA2, b2.to(tl.float32), mask=m)
            tl.store(ps + S.OMB2, (1.0 - b2).to(tl.float32), mask=m)
            tl.store(ps + S.EPS, eps.to(tl.float32), mask=m)
            tl.store(ps + S.LR, lr.to(tl.float32), mask=m)
            tl.store(ps + S.WD_RAW, wd.to(tl.float32), mask=m)
        elif KIND == _SGD:
            lr = tl.load(hp + H.LR, mask=m, other=0.0)
            mom = tl.load(hp + H.MOMENTUM, mask=m, other=0.0)
            damp = tl.load(hp + H.DAMPENING, mask=m, other=0.0)
            wd = tl.load(hp + H.WEIGHT_DECAY, mask=m, other=0.0)
            nest = tl.load(hp + H.NESTEROV, mask=m, other=0.0)
            tl.store(ps + S.LR, lr.to(tl.float32), mask=m)
            tl.store(ps + S.MOMENTUM, mom.to(tl.float32), mask=m)
            tl.store(ps + S.OMD, (1.0 - damp).to(tl.float32), mask=m)
            tl.store(ps + S.WD, wd.to(tl.float32), mask=m)
            tl.store(ps + S.FIRST, tl.where(s == 1.0, 1.0, 0.0), mask=m)
            tl.store(ps + S.NESTEROV, nest.to(tl.float32), mask=m)
            tl.store(ps + S.HAS_MOMENTUM, tl.where(mom != 0.0, 1.0, 0.0), mask=m)
        else:  # Adagrad
            lr = tl.load(hp + H.LR, mask=m, other=0.0)
            lr_decay = tl.load(hp + H.LR_DECAY, mask=m, other=0.0)
            wd = tl.load(hp + H.WEIGHT_DECAY, mask=m, other=0.0)
            eps = tl.load(hp + H.EPS, mask=m, other=0.0)
            s64 = tl.where(s64 > 0.0, s64, 1.0)
            tl.store(ps + S.CLR, (lr / (1.0 + (s64 - 1.0) * lr_decay)).to(tl.float32), mask=m)
            tl.store(ps + S.WD, wd.to(tl.float32), mask=m)
            tl.store(ps + S.EPS, eps.to(tl.float32), mask=m)


def sumsq(
    grad: torch.Tensor, table: torch.Tensor, flags: torch.Tensor, scale: torch.Tensor, sq: torch.Tensor,
    bad: torch.Tensor,
) -> None:  # fmt: skip
    """Partial sums of squares of ``grad / scale`` into ``sq`` and non-finite counts into ``bad``."""
    n = table.shape[0]
    if n == 0:
        return
    cfg = settings()
    block, warps = cfg.norm_block, cfg.norm_warps
    launch(_sumsq_kernel, (n,), grad, table, flags, scale, sq, bad, BLOCK=block, num_warps=warps)


def finalize(
    sq: torch.Tensor, bad: torch.Tensor, scale: torch.Tensor, scalars: torch.Tensor, max_norm: float | None,
    flags: torch.Tensor, steps: torch.Tensor, pgroup: torch.Tensor, hp: torch.Tensor, pscal: torch.Tensor, *,
    check: bool, kind: Kind, scaler: DynamicLossScaler | None = None,
) -> None:  # fmt: skip
    """Skip decision, clip coefficient, step counters and per-param scalars (one program); clears ``flags``.

    With ``scaler`` (a ``DynamicLossScaler`` that ``scaler.fusable`` accepts, whose ``scale`` is ``scale``) the
    program also runs the scaler's update from the skip decision, so the step needs no torch ops for it.
    ``scalars[5]`` is the loss scale after the step (the caller writes it when it updates the scaler itself).
    """
    if scaler is not None and scaler.scale is not scale:
        raise ValueError("finalize: scale must be the scaler's own scale tensor (scaler.scale)")
    # without a scaler: placeholders the kernel does not read
    sargs = (scale, scale, 1.0, 0.5, 1, 1, 1.0) if scaler is None else scaler_args(scaler)
    cfg = settings()
    launch(
        _finalize_kernel, (1,), sq, bad, sq.numel(), scale, scalars, 0.0 if max_norm is None else float(max_norm),
        flags, steps, pgroup, hp, pscal, steps.numel(), *sargs,
        CHECK=bool(check), CLIP=max_norm is not None, KIND=int(kind), H=HP_SLOTS[kind], S=PSCAL_SLOTS[kind],
        SCALER=scaler is not None,
        BLOCK=cfg.final_block, num_warps=cfg.final_warps,
    )  # fmt: skip
