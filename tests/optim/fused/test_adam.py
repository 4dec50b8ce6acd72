"""FusedAdamW / FusedAdam against the exact torch path (MixedPrecisionOptimizer over torch AdamW / Adam).

Runs in Triton's interpreter on CPU (fp16, fp32); bf16 and large sizes are in test_gpu.py.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch

import halfprec
from halfprec.optim import FusedAdam, FusedAdamW

from ...tolerances import approx, tol
from ..helpers import (
    DEVICE,
    assert_params_are_rounded_masters,
    assert_same_state,
    pair,
    random_grads,
    run_both,
    set_grads,
)

SIZES = [9, 41, 341, 4231, 1, 127, 4097]
HP = dict(lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)


@pytest.mark.parametrize(
    ("torch_cls", "fused_cls", "dtype", "clip"),
    [
        (torch.optim.AdamW, FusedAdamW, torch.float16, 1.0),
        (torch.optim.AdamW, FusedAdamW, torch.float32, None),
        (torch.optim.Adam, FusedAdam, torch.float16, None),
        (torch.optim.Adam, FusedAdam, torch.float16, 0.5),
    ],
)
def test_matches_torch_path(torch_cls, fused_cls, dtype, clip):
    ref, fused, a, b = pair(torch_cls, fused_cls, SIZES, dtype, HP, max_grad_norm=clip)
    run_both(ref, fused, a, b, 4)
    assert_same_state(ref, fused, dtype)
    assert_params_are_rounded_masters(fused)
    assert fused.grad_norm == approx(ref.grad_norm, "grad_norm")


def test_groups_mixed_dtypes_and_no_grad_params_keep_their_counters():
    groups = [([0, 2], dict(lr=3e-2, weight_decay=0.0)), ([1, 3, 4], dict(lr=1e-3))]
    ref, fused, a, b = pair(
        torch.optim.AdamW,
        FusedAdamW,
        [33, 129, 7, 1000, 5],
        torch.float16,
        HP,
        max_grad_norm=1.0,
        groups=groups,
    )
    # param 1 gets no grad on steps 0 and 2, param 4 never: their counters must not advance
    run_both(ref, fused, a, b, 4, none_at=lambda s: {1, 4} if s in (0, 2) else {4})
    assert_same_state(ref, fused, torch.float16)
    steps = fused.state_dict()["optimizer"]["state"]  # indexed in group order: a0, a2 | a1, a3, a4
    assert float(steps[2]["step"]) == 2.0 and 4 not in steps and float(steps[0]["step"]) == 4.0


def test_mixed_fp16_fp32_params_in_one_group():
    a16, b16 = pair(torch.optim.AdamW, FusedAdamW, [5], torch.float16, HP)[2:]
    a32 = [torch.nn.Parameter(torch.randn(77, device=DEVICE))]
    b32 = [torch.nn.Parameter(a32[0].detach().clone())]
    ref = halfprec.MixedPrecisionOptimizer(
        torch.optim.AdamW(a16 + a32, **HP), max_grad_norm=1.0, impl="torch"
    )
    fused = FusedAdamW(b16 + b32, **HP, max_grad_norm=1.0)
    run_both(ref, fused, a16 + a32, b16 + b32, 3)
    assert_same_state(ref, fused, torch.float16)


def test_skipped_step_changes_nothing_but_the_scaler(caplog):
    scaler = lambda: halfprec.DynamicLossScaler(init_scale=2.0**10, hysteresis=1)  # noqa: E731
    ref, fused, a, b = pair(
        torch.optim.AdamW, FusedAdamW, [41, 341], torch.float16, HP, scaler=scaler, max_grad_norm=1.0
    )
    run_both(ref, fused, a, b, 2, scale=2.0**10)
    before = fused.state_dict()
    grads = random_grads(a, 99)
    grads[1][3] = float("inf")
    set_grads(a, grads)
    set_grads(b, grads)
    ref.step()
    with caplog.at_level(logging.WARNING, logger="halfprec"):
        fused.step()
        fused.flush_reports()
    assert fused.step_was_skipped and ref.step_was_skipped
    assert fused.skipped_steps == 1
    assert fused.loss_scale == ref.loss_scale == 2.0**9
    after = fused.state_dict()
    for k, v in before["masters"].items():
        assert torch.equal(after["masters"][k], v)
    for k, st in before["optimizer"]["state"].items():
        for name, v in st.items():
            assert torch.equal(after["optimizer"]["state"][k][name], v), (k, name)
    skips = [
        r
        for r in caplog.records
        if "step skipped" in r.getMessage() and r.pathname.endswith(os.path.join("fused", "results.py"))
    ]
    assert len(skips) == 1
    fused.zero_grad()
    ref.zero_grad()
    run_both(ref, fused, a, b, 2, scale=2.0**9, seed=10)
    assert_same_state(ref, fused, torch.float16)
    assert not fused.step_was_skipped


def test_loss_scaled_grads_give_the_unscaled_update():
    scaler = lambda: halfprec.StaticLossScaler(2.0**12)  # noqa: E731
    ref, fused, a, b = pair(
        torch.optim.AdamW, FusedAdamW, SIZES[:4], torch.float16, HP, scaler=scaler, max_grad_norm=1.0
    )
    run_both(ref, fused, a, b, 3, scale=2.0**12)
    assert_same_state(ref, fused, torch.float16)


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(13, 7)
        self.b = torch.nn.Linear(7, 3)
        self.unused = torch.nn.Linear(3, 3)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _nets():
    torch.manual_seed(0)
    n1 = _Net().half().to(DEVICE)
    n2 = _Net().half().to(DEVICE)
    n2.load_state_dict(n1.state_dict())
    return n1, n2


@pytest.mark.parametrize("zero", ["opt_none", "opt_zero", "model_none"])
def test_backward_hooks_views_and_accumulation(zero):
    n1, n2 = _nets()
    ref = halfprec.MixedPrecisionOptimizer(
        torch.optim.AdamW(n1.parameters(), **HP), max_grad_norm=1.0, impl="torch"
    )
    fused = FusedAdamW(n2.parameters(), **HP, max_grad_norm=1.0)
    for s in range(3):
        for micro in range(2):  # gradient accumulation: the second backward adds into the same view
            x = torch.randn(4, 13, generator=torch.Generator().manual_seed(10 * s + micro)).half().to(DEVICE)
            ref.backward(n1(x).float().pow(2).mean())
            fused.backward(n2(x).float().pow(2).mean())
        ref.step()
        fused.step()
        ref.zero_grad()
        if zero == "opt_none":
            fused.zero_grad()
        elif zero == "opt_zero":
            fused.zero_grad(set_to_none=False)
        else:
            n2.zero_grad()
    assert_same_state(ref, fused, torch.float16)
    for p, q in zip(n1.parameters(), n2.parameters(), strict=True):
        assert torch.equal(p, q) or torch.allclose(
            p.float(), q.float(), **tol("fused_param_neighbour", torch.float16)
        )
    # the unused layer never got a grad: not updated, no state
    assert 4 not in fused.state_dict()["optimizer"]["state"]
    chunk, local = fused._where[0]
    assert n2.a.weight.grad is None or n2.a.weight.grad.data_ptr() == chunk.grad_views[local].data_ptr()


def test_view_is_never_mistaken_for_a_grad():
    _, fused, _, b = pair(torch.optim.AdamW, FusedAdamW, [9, 41], torch.float16, HP)
    set_grads(b, random_grads(b, 0))
    fused.step()
    before = [m.clone() for m in fused.master_params()]
    # .grad is now the (stale) view of the flat buffer, but no backward ran: nothing may move
    assert b[0].grad is not None
    fused.step()
    for m, m0 in zip(fused.master_params(), before, strict=True):
        assert torch.equal(m, m0)
    assert float(fused.state_dict()["optimizer"]["state"][0]["step"]) == 1.0


def test_checkpoints_move_between_the_paths():
    ref, fused, a, b = pair(torch.optim.AdamW, FusedAdamW, [41, 341, 9], torch.float16, HP, max_grad_norm=1.0)
    run_both(ref, fused, a, b, 2)
    # fused -> torch path and torch path -> fused, then both continue
    ref2, fused2, a2, b2 = pair(
        torch.optim.AdamW, FusedAdamW, [41, 341, 9], torch.float16, HP, max_grad_norm=1.0
    )
    ref2.load_state_dict(fused.state_dict())
    fused2.load_state_dict(ref.state_dict())
    assert_params_are_rounded_masters(fused2)
    run_both(ref2, fused2, a2, b2, 2, seed=5)
    run_both(ref, fused, a, b, 2, seed=5)
    assert_same_state(ref2, fused2, torch.float16)
    assert_same_state(ref, fused2, torch.float16)


def test_plain_torch_state_dict_loads():
    ref, fused, a, b = pair(torch.optim.AdamW, FusedAdamW, [41, 9], torch.float16, HP)
    run_both(ref, fused, a, b, 2)
    _, fused2, _, _ = pair(torch.optim.AdamW, FusedAdamW, [41, 9], torch.float16, HP)
    fused2.load_state_dict(ref.optimizer.state_dict())
    sd = fused2.state_dict()["optimizer"]["state"]
    assert float(sd[0]["step"]) == 2.0
    torch.testing.assert_close(sd[1]["exp_avg"], ref.optimizer.state_dict()["state"][1]["exp_avg"])


ERRORS = [
    (dict(lr=-1.0), ValueError, r"lr must be >= 0"),
    (dict(betas=(1.0, 0.9)), ValueError, r"betas\[0\] must be \[0.0, 1.0\)"),
    (dict(amsgrad=True), ValueError, r"amsgrad=True is not supported.*torch path"),
    (dict(max_grad_norm=0.0), ValueError, r"max_grad_norm must be a finite number > 0"),
    (dict(param_dtype=torch.float64), ValueError, r"param_dtype must be"),
    (dict(loss_scaler=object()), ValueError, r"loss_scaler must be a halfprec"),
]


@pytest.mark.parametrize(("kwargs", "error", "match"), ERRORS)
def test_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        FusedAdamW([torch.nn.Parameter(torch.zeros(3, dtype=torch.float16, device=DEVICE))], **kwargs)


def test_add_param_group_after_construction_and_unscale_raise():
    opt = FusedAdamW([torch.nn.Parameter(torch.zeros(3, dtype=torch.float16, device=DEVICE))])
    with pytest.raises(RuntimeError, match="pass every param group to the constructor"):
        opt.add_param_group(
            {"params": [torch.nn.Parameter(torch.zeros(3, dtype=torch.float16, device=DEVICE))]}
        )
    with pytest.raises(RuntimeError, match="folds unscaling"):
        opt.unscale_()


def test_param_dtype_casts_fp32_model_and_keeps_fp32_masters():
    p = torch.nn.Parameter(torch.randn(41, device=DEVICE))
    original = p.detach().clone()
    opt = FusedAdamW([p], param_dtype=torch.float16)
    assert p.dtype == torch.float16
    assert torch.equal(opt.master_params()[0], original)


def test_a_param_whose_storage_was_replaced_is_an_error():
    model = torch.nn.Linear(8, 4).to(DEVICE, torch.float16)
    opt = FusedAdamW(model.parameters(), lr=1e-2)
    model.float().half()  # new storage for every param: the masters would move, the model would not
    model(torch.randn(2, 8, device=DEVICE, dtype=torch.float16)).float().sum().backward()
    with pytest.raises(RuntimeError, match=r"no longer lives in FusedAdamW's flat buffer"):
        opt.step()
