"""What a step leaves behind (``halfprec.optim.results``): grad marks that tell a new backward from grads already
consumed, the skip log's one line per skip and one warning at the minimum scale."""

from __future__ import annotations

import gc
import logging
import warnings

import torch

from halfprec.optim.results import GradMarks, SkipLog, StepState


def _params(n: int = 3) -> list[torch.nn.Parameter]:
    ps = [torch.nn.Parameter(torch.zeros(4)) for _ in range(n)]
    for p in ps[:-1]:
        p.grad = torch.ones(4)
    return ps  # the last one has no grad


def test_marks_hold_until_a_grad_changes_in_place():
    ps = _params()
    marks = GradMarks(ps)
    assert marks.same(ps)
    ps[0].grad.add_(1)  # a second backward accumulates in place
    assert not marks.same(ps)


def test_marks_see_a_new_grad_tensor_and_a_grad_appearing():
    ps = _params()
    marks = GradMarks(ps)
    ps[1].grad = torch.ones(4)
    assert not marks.same(ps)
    ps = _params()
    marks = GradMarks(ps)
    ps[2].grad = torch.ones(4)
    assert not marks.same(ps)


def test_marks_do_not_keep_freed_grads_alive():
    ps = _params()
    marks = GradMarks(ps)
    ps[0].grad = None  # zero_grad(): the grad is freed, not kept alive by the marks
    gc.collect()
    assert marks.marks[0][0]() is None
    ps[0].grad = torch.ones(4)  # a new grad, maybe at the freed one's address: not the one marked
    assert not marks.same(ps)


def test_step_state_starts_empty():
    s = StepState()
    assert (s.unscaled, s.grads, s.grad_norm, s.step_was_skipped, s.skipped_steps) == (
        False,
        [],
        None,
        False,
        0,
    )
    assert StepState().grads is not s.grads  # no list shared between optimizers


def test_skip_log_logs_every_skip_and_warns_once_at_the_minimum(caplog):
    log = SkipLog()
    with caplog.at_level(logging.WARNING, logger="halfprec"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        log.report(before=1024.0, after=512.0, skipped_so_far=1, at_min_scale=False)
        for n in (2, 3):
            log.report(before=1.0, after=1.0, skipped_so_far=n, at_min_scale=True, where=" on rank 0")
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == (
        "halfprec: step skipped, non-finite gradients or gradient norm (loss scale 1024 -> 512, 1 skipped so far)"
    )
    assert lines[2].endswith("on rank 0 (loss scale 1 -> 1, 3 skipped so far)") and len(lines) == 3
    ours = [w for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(ours) == 1 and "minimum loss scale 1" in str(ours[0].message)
