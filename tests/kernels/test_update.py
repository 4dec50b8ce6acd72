"""The update kernels' 16-bit store: round to nearest even, bit-identical to torch's casts."""

from __future__ import annotations

import pytest
import torch

from ..optim.helpers import DEVICE


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_param_store_rounds_to_nearest_even(dtype):
    from halfprec.kernels.settings import settings
    from halfprec.kernels.slots import ADAM_PSCAL as S
    from halfprec.kernels.slots import PSCAL_WIDTH, Kind
    from halfprec.kernels.update import update
    from halfprec.optim.layout import build_table

    n = 4112  # a multiple of 16, as chunks are padded
    g = torch.Generator().manual_seed(0)
    master = torch.randn(n, generator=g) * 3
    master[:6] = torch.tensor([65520.0, -65504.0, 1e-8, 0.0, -0.0, 3.4e38])  # finite: inf * 0 would be nan
    # ties: values exactly halfway between two 16-bit numbers
    master[6:10] = torch.tensor([1 + 2**-11, 1 + 3 * 2**-11, 1 + 2**-8, 1 + 3 * 2**-8])
    param = torch.empty(n, dtype=dtype)
    grad = torch.zeros(n, dtype=dtype)
    m, v = torch.zeros(n), torch.zeros(n)
    table = build_table([0], [n], [0], settings().update_block, master.device)
    pscal = torch.zeros(1, PSCAL_WIDTH)
    slots = dict(
        ACTIVE=1.0, STEP_SIZE=0.0, BC2_SQRT=1.0, DECAY=1.0, WD=0.0, OMB1=0.1, BETA2=0.9, OMB2=0.1, EPS=1.0
    )
    for name, value in slots.items():  # STEP_SIZE 0: p unchanged
        pscal[0, getattr(S, name)] = value
    scalars = torch.zeros(8)
    scalars[2] = 1.0
    expected = master.to(dtype)
    param, grad, m, v, table, pscal, scalars = (
        t.to(DEVICE) for t in (param, grad, m, v, table, pscal, scalars)
    )
    update(Kind.ADAM, param, grad, master.clone().to(DEVICE), (m, v), table, pscal, scalars)
    got, want = param.cpu().view(torch.int16), expected.view(torch.int16)
    assert torch.equal(got, want)


def test_inactive_param_is_not_touched():
    from halfprec.kernels.slots import PSCAL_WIDTH, Kind
    from halfprec.kernels.slots import SGD_PSCAL as S
    from halfprec.kernels.update import update

    n = 128
    param = torch.full((n,), 7.0, dtype=torch.float16)
    master = torch.full((n,), 7.0)
    grad = torch.ones(n, dtype=torch.float16)
    pscal = torch.zeros(1, PSCAL_WIDTH)  # ACTIVE = 0
    pscal[0, S.LR] = 1.0
    param, master, grad, pscal = (t.to(DEVICE) for t in (param, master, grad, pscal))
    table = torch.tensor([[0, n, 0]], device=DEVICE)
    update(Kind.SGD, param, grad, master, (), table, pscal, torch.ones(8, device=DEVICE))
    assert (master == 7.0).all() and (param == 7.0).all()
