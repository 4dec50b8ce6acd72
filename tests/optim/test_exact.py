"""The exact strategy: a param is stepped by the same rule as torch's, whatever holds its grad sums."""

from __future__ import annotations

import pytest
import torch

import halfprec
from halfprec.optim import ExactMixedPrecisionOptimizer


def _run(accum, set_to_none, steps=3):
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"a": torch.nn.Linear(4, 4), "b": torch.nn.Linear(4, 4)}).to(torch.bfloat16)
    mp = halfprec.MixedPrecisionOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2), grad_accum_dtype=accum, impl="torch"
    )
    assert type(mp) is ExactMixedPrecisionOptimizer
    for step in range(steps):
        h = model["a"](torch.randn(2, 4, dtype=torch.bfloat16))
        if step == 0:
            h = model["b"](h)  # b gets a grad in step 0 only
        mp.backward(h.float().pow(2).mean())
        mp.step()
        mp.zero_grad(set_to_none=set_to_none)
    return model, mp


@pytest.mark.parametrize("set_to_none", [True, False])
def test_fp32_sums_step_the_same_params_as_16_bit_sums(set_to_none):
    # zero_grad(set_to_none=False) leaves zero grads, which torch steps (AdamW's momentum keeps moving b);
    # set_to_none=True leaves None, which torch does not step: fp32 accumulation must follow either rule
    plain, plain_mp = _run("param", set_to_none)
    fp32, fp32_mp = _run("fp32", set_to_none)
    for (name, p), q in zip(plain.named_parameters(), fp32.parameters(), strict=True):
        assert torch.equal(p, q), name
    for m, n in zip(plain_mp.master_params(), fp32_mp.master_params(), strict=True):
        assert torch.equal(m, n)
        assert torch.equal(plain_mp.state[m]["exp_avg"], fp32_mp.state[n]["exp_avg"])
        assert plain_mp.state[m]["step"] == fp32_mp.state[n]["step"]
    b_steps = fp32_mp.state[fp32_mp.master_params()[2]]["step"].item()
    assert b_steps == (3.0 if not set_to_none else 1.0)


def test_zero_grad_keeps_zeroed_master_grads_until_the_next_backward():
    model, mp = _run("fp32", set_to_none=False, steps=1)
    grads = [m.grad for m in mp.master_params()]
    assert all(g is not None and not g.any() for g in grads)
    mp.zero_grad(set_to_none=True)
    assert all(m.grad is None for m in mp.master_params())


def test_a_plain_torch_state_dict_loads_its_state_and_groups_and_keeps_the_masters():
    # as on the fused strategy: the inner optimizer's state and hyper-parameters, the masters untouched
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(3, 5))
    ref = torch.optim.AdamW([w], lr=0.25)
    w.grad = torch.randn(3, 5)
    ref.step()
    model = torch.nn.Linear(5, 3, bias=False).bfloat16()
    mp = halfprec.MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=0.1), impl="torch")
    before = [m.detach().clone() for m in mp.master_params()]
    mp.load_state_dict(ref.state_dict())
    (master,) = mp.master_params()
    assert mp.param_groups[0]["lr"] == 0.25
    assert torch.equal(mp.state[master]["exp_avg"], ref.state[w]["exp_avg"])
    assert mp.state[master]["exp_avg"].dtype == torch.float32
    assert torch.equal(master, before[0])
