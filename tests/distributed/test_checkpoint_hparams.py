"""Resume restores the scheduled float hyper-parameters, not their truncation to the int the optimizer was built with.

An optimizer built with ``lr=1`` (an int) and ``weight_decay=0`` (SGD's int default) and scheduled to ``lr=0.25``
must resume at 0.25 (it resumed at ``int(0.25) == 0``, silently), and an int setting stays an int. Checked through
``halfprec.distributed.checkpoint`` for the unsharded optimizer (no process group), for the ZeRO-1 optimizer and
the ZeRO-1 engine (one gloo rank in this process).
"""

from __future__ import annotations

import torch

import halfprec
from halfprec import MixedPrecisionOptimizer
from halfprec.distributed import ShardedMixedPrecisionOptimizer, checkpoint


def _model():
    torch.manual_seed(0)
    return torch.nn.Linear(3, 2).bfloat16()


def _step(model, opt) -> None:
    opt.backward(model(torch.ones(4, 3, dtype=torch.bfloat16)).float().square().sum())
    opt.step()
    opt.zero_grad()


def _check(opt) -> None:
    group = opt.param_groups[0]
    assert group["lr"] == 0.25 and type(group["lr"]) is float
    assert group["weight_decay"] == 0 and type(group["weight_decay"]) is int
    assert group["momentum"] == 0.5


def test_unsharded_resume_keeps_a_scheduled_float_lr(tmp_path):
    model = _model()
    mp = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=1, momentum=0.5))
    _step(model, mp)
    mp.param_groups[0]["lr"] = 0.25  # what a scheduler does
    checkpoint.save(mp, tmp_path / "ck", named_parameters=model)
    fresh_model = _model()
    fresh = MixedPrecisionOptimizer(torch.optim.SGD(fresh_model.parameters(), lr=1, momentum=0.5))
    checkpoint.load(fresh, tmp_path / "ck", named_parameters=fresh_model)
    _check(fresh)


def test_zero_resume_keeps_a_scheduled_float_lr(tmp_path, one_rank):
    def build():
        model = _model()
        sgd = torch.optim.SGD(model.parameters(), lr=1, momentum=0.5)
        return model, ShardedMixedPrecisionOptimizer(sgd, named_parameters=model, stage=1)

    model, opt = build()
    _step(model, opt)
    opt.param_groups[0]["lr"] = 0.25
    checkpoint.save(opt, tmp_path / "ck")
    _, fresh = build()
    checkpoint.load(fresh, tmp_path / "ck")
    _check(fresh)


def test_zero_engine_resume_keeps_a_scheduled_float_lr(tmp_path, one_rank):
    def build():
        model = torch.nn.Linear(3, 2)
        torch.manual_seed(0)
        sgd = torch.optim.SGD(model.parameters(), lr=1, momentum=0.5)
        return halfprec.initialize(model, sgd, precision="bf16", zero_stage=1)

    engine = build()
    loss = engine(torch.ones(4, 3, dtype=torch.bfloat16)).float().square().sum()
    engine.backward(loss)
    engine.step()
    engine.optimizer.param_groups[0]["lr"] = 0.25
    engine.save_checkpoint(tmp_path / "ck")
    fresh = build()
    fresh.load_checkpoint(tmp_path / "ck")
    _check(fresh.optimizer)
