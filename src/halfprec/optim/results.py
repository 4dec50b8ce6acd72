"""What a step leaves behind, for every strategy: the step record, the grad marks, the skip log, the scale guard."""

from __future__ import annotations

import functools
import inspect
import logging
import os
import sys
import warnings
import weakref
from dataclasses import dataclass, field

import torch

from .mesh import local

__all__ = [
    "Delivered", "GradMarks", "ScaleGuard", "SkipLog", "StepResults", "StepState", "refuse_backward_after_unscale", "warn_caller",
    "weak_hook",
]  # fmt: skip

logger = logging.getLogger("halfprec")
# frames of halfprec and of torch (its optimizer-step and no_grad wrappers) are not the user's line
_INTERNAL = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.path.dirname(torch.__file__))


def warn_caller(message: str, category: type[Warning]) -> None:
    """``warnings.warn`` attributed to the first frame outside halfprec and torch (the user's line, however deep
    the strategy's constructor or step chain is)."""
    frame, level = inspect.currentframe().f_back, 1
    while frame is not None and frame.f_code.co_filename.startswith(_INTERNAL):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level + 1)


def weak_hook(method, *args):
    """A post-accumulate-grad hook that calls ``method(*args)`` while ``method``'s object lives. The hook lives on
    the param, which autograd's C++ side also holds: a strong reference would keep the optimizer alive."""
    return functools.partial(_call_weak, weakref.WeakMethod(method), args)


def _call_weak(ref: weakref.WeakMethod, args: tuple, param: torch.Tensor) -> None:
    bound = ref()
    if bound is not None:
        bound(*args)


def refuse_backward_after_unscale(lost: str) -> None:
    """The RuntimeError of every strategy for a backward between ``unscale_()`` and ``step()``, from ``backward()``
    or from a grad hook (a plain ``loss.backward()``); ``lost``: what would become of its grads."""
    raise RuntimeError(
        f"a backward ran after unscale_() and before step(): {lost}. Call unscale_() after the last backward() "
        "of the step."
    )


class GradMarks:
    """Which grad tensors a step saw, and their in-place versions: what tells a new backward from grads already
    consumed. Weak references: a grad freed by ``zero_grad``/``model.zero_grad()`` is not kept alive, and a new
    grad allocated at the freed one's address is not mistaken for it (``id()`` would be). A DTensor grad's
    version is its local shard's: FSDP2 accumulates into the shard in place, which leaves the DTensor's own
    counter as it was."""

    def __init__(self, params) -> None:
        self.marks = [(weakref.ref(p.grad), local(p.grad)._version) for p in params if p.grad is not None]

    def same(self, params) -> bool:
        grads = [p.grad for p in params if p.grad is not None]
        return len(grads) == len(self.marks) and all(
            ref() is g and local(g)._version == version
            for (ref, version), g in zip(self.marks, grads, strict=True)
        )


@dataclass(frozen=True)
class StepResults:
    """One step's results, kept after the next step (``MixedPrecisionOptimizer.step_results()``)."""

    step_was_skipped: bool
    grad_norm: float | None
    step_loss_scale: float | None

    @property
    def grad_norm_deferred(self) -> float | None:
        """``grad_norm`` without waiting for the step: here the float (the fused record's is a device tensor)."""
        return self.grad_norm


@dataclass
class StepState:
    """The last step's results and the order guards' state, in one object so that wrappers that copy an
    optimizer's ``__dict__`` (Lightning's, Fabric's) update the real optimizer. The fused strategy's record has
    the same attribute names."""

    unscaled: bool = False  # unscale_() ran and step() has not consumed its grads yet
    grads: list[torch.Tensor] = field(default_factory=list)  # exact strategy: the unscaled master grads
    unscaled_grads: GradMarks | None = None
    stepped_grads: GradMarks | None = None
    grad_norm: float | None = None
    step_loss_scale: float | None = None
    step_was_skipped: bool = False
    skipped_steps: int = 0

    def snapshot(self) -> StepResults:
        return StepResults(self.step_was_skipped, self.grad_norm, self.step_loss_scale)


class SkipLog:
    """The one record of a skipped step (a log line) and the one warning when the scale cannot go lower."""

    def __init__(self) -> None:
        self.warned_min_scale = False

    def report(
        self, *, before: float, after: float, skipped_so_far: int, at_min_scale: bool, where: str = ""
    ) -> None:
        logger.warning(
            "halfprec: step skipped, non-finite gradients or gradient norm%s (loss scale %g -> %g, %d skipped so far)",
            where,
            before,
            after,
            skipped_so_far,
            stacklevel=2,  # the record names the strategy that skipped, not this helper
        )
        if at_min_scale and not self.warned_min_scale:
            self.warned_min_scale = True
            warn_caller(
                f"halfprec: gradients overflowed at the minimum loss scale {before:g}; the scale cannot go lower, "
                "so every such step is skipped. Lower min_scale, lower the learning rate, or train in bf16.",
                RuntimeWarning,
            )


class ScaleGuard:
    """Whether the grads a step reads came through ``scale_loss``. With a loss scale, a plain ``loss.backward()``
    leaves grads that unscale ``loss_scale`` times too small (65536x at fp16's default), and nothing else notices:
    the step is finite and trains on. One warning per optimizer (a loop that scales by hand on purpose is told once)."""

    def __init__(self) -> None:
        self.scaled = False  # scale_loss ran since the last step
        self.warned = False
        self.marks = 0  # scale_loss calls ever: fp32 accumulation over FSDP2 counts backwards by them

    def mark(self) -> None:
        self.scaled = True
        self.marks += 1

    def check(self, params, loss_scaler) -> None:
        """``params()``: the params whose grads to look at, called only off the usual path."""
        scaled, self.scaled = self.scaled, False
        if scaled or self.warned or loss_scaler.is_unit or all(p.grad is None for p in params()):
            return
        self.warned = True
        warn_caller(
            "halfprec: step() after a backward that was not loss-scaled: the grads are divided by the loss scale "
            "(mp.loss_scale, 65536 at fp16's default) and so are that many times too small. Call mp.backward(loss) "
            "or mp.scale_loss(loss).backward() instead of loss.backward().",
            RuntimeWarning,
        )


class Delivered:
    """Over FSDP2 with fp32 sums: the backwards since the last step (``guard.marks``: one per ``mp.backward`` or
    ``scale_loss``; a plain ``loss.backward()`` is not counted) against the sharded grads FSDP2 delivered to the
    hooks. A backward under ``set_requires_gradient_sync(False)`` reduces nothing and calls no hook: FSDP2 sums its
    grads into its unsharded buffer and hands the hooks one reduced shard at the next synced backward, so the fp32
    sums would hold that micro-batch only as part of a 16-bit sum. ``check()`` refuses that gap. torch 2.11's FSDP2
    also calls no hook under compiled autograd (2.12 and later always do: docs/distributed.md), which the error
    names when the switch is on."""

    def __init__(self, guard: ScaleGuard) -> None:
        self.guard = guard
        self.counted = guard.marks  # backwards before this accumulation
        self.fired: dict = {}  # hook calls per param in this accumulation

    def fire(self, key) -> None:
        self.fired[key] = self.fired.get(key, 0) + 1

    def check(self) -> None:
        """RuntimeError when more backwards ran since the last check than FSDP2 delivered sharded grads for."""
        ran, most = self.guard.marks - self.counted, max(self.fired.values(), default=0)
        self.counted, self.fired = self.guard.marks, {}
        if ran <= most:
            return
        if most == 0 and _compiled_autograd_skips_hooks():
            why = (
                "compiled autograd is on (torch._dynamo.config.compiled_autograd), and torch "
                f"{torch.__version__}'s FSDP2 calls no post-accumulate-grad hook under it, so grad_accum_dtype='fp32' "
                "gets no sharded grad. Turn compiled autograd off, pass grad_accum_dtype='param' (the step takes the "
                "16-bit grads FSDP2 accumulated), or use torch 2.12 or later, whose FSDP2 always calls the hooks"
            )
        else:
            why = (
                "a backward under model.set_requires_gradient_sync(False) adds its grads into FSDP2's unsharded "
                "buffer (in the params' dtype, or FSDP2's reduce_dtype), so grad_accum_dtype='fp32' would get them "
                "only as part of that sum. Keep set_requires_gradient_sync(True) on every micro-batch (the fp32 sums "
                "of the sharded grads replace FSDP2's unsharded accumulation), or pass grad_accum_dtype='param'"
            )
        raise RuntimeError(
            f"{ran} backward() calls since the last step, and FSDP2 delivered the sharded grads of {most}: {why}"
        )


def _compiled_autograd_skips_hooks() -> bool:
    """Whether FSDP2 calls no post-accumulate-grad hook because of compiled autograd: torch before 2.12 (2.11, the
    oldest halfprec takes) with ``torch._dynamo.config.compiled_autograd`` on, the documented switch under which
    ``torch.compile``d calls enter compiled autograd. Read from ``sys.modules``: a process that never imported
    dynamo has it off, and importing it here would be slow. Compiled autograd entered by hand around one backward
    is not seen."""
    return torch.__version__ < (2, 12) and bool(
        getattr(sys.modules.get("torch._dynamo.config"), "compiled_autograd", False)
    )
