"""Moving a torch optimizer's state onto the masters (``halfprec.optim.state``): state the constructor created is
re-created in fp32 (upcasting a 16-bit copy is not exact: 0.1 in fp16 is 0.0999755859375), state the user populated
in the param's dtype is upcast, other tensors keep their dtype, non-tensors are kept (docs/guarantees.md)."""

from __future__ import annotations

import pytest
import torch

from halfprec import MixedPrecisionOptimizer

from ..reference import assert_same_state, fp32_copy, make_model
from ..test_optimizer import LOW, _assert_parity, _roundtrip, _run


@pytest.mark.parametrize("dtype", LOW)
def test_adagrad_eager_state_recreated_exactly(dtype):
    model = make_model(dtype)
    ref = fp32_copy(model)
    params, rparams = list(model.parameters()), list(ref.parameters())

    def groups(ps):
        return [
            {"params": ps[:2], "lr": 0.05, "eps": 1e-6, "lr_decay": 0.01},
            {"params": ps[2:], "lr": 0.2, "initial_accumulator_value": 0.3},
        ]

    mp = MixedPrecisionOptimizer(torch.optim.Adagrad(groups(params), initial_accumulator_value=0.1))
    oracle = torch.optim.Adagrad(groups(rparams), initial_accumulator_value=0.1)
    masters = mp.master_params()
    for m, q in zip(masters, rparams, strict=True):
        assert mp.state[m]["sum"].dtype == torch.float32
        assert torch.equal(mp.state[m]["sum"], oracle.state[q]["sum"])  # 0.1, not fp16's 0.0999755859375
    _run(model, ref, mp, oracle, 30)
    _assert_parity(model, ref, mp, oracle)


class _Eager(torch.optim.Optimizer):
    """A custom optimizer whose constructor populates state of several kinds (SGD with a running mean)."""

    def __init__(self, params, lr=0.1, init=0.1):
        super().__init__(params, dict(lr=lr, init=init))
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p] = {
                    "avg": torch.full_like(p, group["init"]),
                    "count": torch.zeros((), dtype=torch.int64),
                    "seen": torch.zeros(p.shape, dtype=torch.bool),
                    "tag": "eager",
                }

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                st["count"] += 1
                st["avg"].mul_(0.9).add_(p.grad, alpha=0.1)
                st["seen"] |= p.grad != 0
                p.add_(st["avg"] * st["seen"], alpha=-group["lr"])


class _NotRerunnable(_Eager):
    def __init__(self, params, token, lr=0.1):
        super().__init__(params, lr=lr)


@pytest.mark.parametrize("dtype", LOW)
def test_custom_eager_state_kept_exact_and_typed(dtype):
    model = make_model(dtype)
    ref = fp32_copy(model)
    mp = MixedPrecisionOptimizer(_Eager(model.parameters()))
    oracle = _Eager(ref.parameters())
    m0 = mp.master_params()[0]
    assert {k: type(v) for k, v in mp.state[m0].items()} == {
        "avg": torch.Tensor,
        "count": torch.Tensor,
        "seen": torch.Tensor,
        "tag": str,
    }
    assert mp.state[m0]["avg"].dtype == torch.float32 and mp.state[m0]["count"].dtype == torch.int64
    _run(model, ref, mp, oracle, 12)
    _assert_parity(model, ref, mp, oracle)
    # state-dict round trip keeps int64 / bool dtypes (torch's load casts them to the param dtype)
    fresh_model = make_model(dtype)
    mp2 = MixedPrecisionOptimizer(_Eager(fresh_model.parameters()))
    mp2.load_state_dict(_roundtrip(mp.state_dict()))
    assert_same_state(mp2.state, mp.state, mp2.master_params(), mp.master_params())


def test_user_populated_state_is_upcast():
    model = make_model(torch.float16)
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    p0 = next(model.parameters())
    inner.state[p0]["momentum_buffer"] = torch.full_like(p0, 0.1)
    mp = MixedPrecisionOptimizer(inner)
    buf = mp.state[mp.master_params()[0]]["momentum_buffer"]
    assert buf.dtype == torch.float32 and torch.equal(buf, torch.full_like(p0, 0.1).float())


def test_non_rerunnable_constructor_warns_once_and_upcasts():
    model = make_model(torch.float16)
    with pytest.warns(RuntimeWarning, match="could not re-run _NotRerunnable") as record:
        mp = MixedPrecisionOptimizer(_NotRerunnable(model.parameters(), token=object()))
    assert len([w for w in record if "re-run" in str(w.message)]) == 1
    avg = mp.state[mp.master_params()[0]]["avg"]
    assert avg.dtype == torch.float32 and torch.equal(avg, torch.full_like(avg, 0.1).half().float())
