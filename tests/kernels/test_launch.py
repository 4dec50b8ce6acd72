"""Launches replayed from CUDA graphs (kernels/launch.py): which launch runs eagerly, is captured or replayed (on
any machine, with a stand-in kernel and graph), and on the GPU that replayed steps equal Triton-launched ones bit
for bit, as users call them (zero_grad, backward, step) and with the grad buffer moving."""

from __future__ import annotations

import pytest
import torch

import halfprec
from halfprec.kernels import launch as launch_mod
from halfprec.optim import FusedAdamW, FusedSGD


class _Kernel:
    """Records each launch's grid and args, as ``kernel[grid](*args)`` would run them."""

    def __init__(self):
        self.runs = []

    def __getitem__(self, grid):
        return lambda *args, **meta: self.runs.append((grid, args, meta))


class _Graph:
    def __init__(self, run):
        self.run = run

    def replay(self):
        self.run()


@pytest.fixture(autouse=True)
def _no_block_left_open():
    """A test that leaves a together() block open (a regression) fails alone, not every launch after it."""
    yield
    launch_mod._collecting.group = None


@pytest.fixture
def staged(monkeypatch):
    """``launch`` with replay on for CPU tensors: a capture keeps the launch and a replay runs it again."""
    captured = []

    def capture(run):
        captured.append(run)
        return _Graph(run)

    monkeypatch.setattr(launch_mod, "_replayable", lambda device: True)
    monkeypatch.setattr(launch_mod, "_capture", capture)
    monkeypatch.setattr(launch_mod, "_sites", {})
    return captured


def test_a_launch_runs_eagerly_then_is_captured_then_replays(staged):
    kernel, x = _Kernel(), torch.zeros(4)
    for _ in range(4):
        launch_mod.launch(kernel, (2,), x, 1.5, BLOCK=8)
    assert len(staged) == 1  # captured once, at the second launch
    assert kernel.runs == [((2,), (x, 1.5), {"BLOCK": 8})] * 4  # eager, then three replays of the same launch


@pytest.mark.parametrize(
    "change",
    [
        lambda x, y: ((3,), (x, 1.5), {"BLOCK": 8}),  # the grid
        lambda x, y: ((2,), (y, 1.5), {"BLOCK": 8}),  # a tensor at another address
        lambda x, y: ((2,), (x.view(torch.int32), 1.5), {"BLOCK": 8}),  # same address, other dtype
        lambda x, y: ((2,), (x, 2.5), {"BLOCK": 8}),  # a host scalar
        lambda x, y: ((2,), (x, 1.5), {"BLOCK": 16}),  # a meta-parameter
    ],
)
def test_any_change_the_kernel_would_see_is_a_new_launch(staged, change):
    kernel, x, y = _Kernel(), torch.zeros(4), torch.zeros(4)
    launch_mod.launch(kernel, (2,), x, 1.5, BLOCK=8)
    launch_mod.launch(kernel, (2,), x, 1.5, BLOCK=8)
    grid, args, meta = change(x, y)
    launch_mod.launch(kernel, grid, *args, **meta)  # eager: never captured with these
    assert len(staged) == 1
    assert kernel.runs[-1] == (grid, args, meta)
    launch_mod.launch(kernel, grid, *args, **meta)  # seen before: captured now
    assert len(staged) == 2


def test_each_site_keeps_its_latest_keys(staged):
    kernel, xs = _Kernel(), [torch.zeros(4) for _ in range(launch_mod._KEPT + 1)]
    for x in xs:
        launch_mod.launch(kernel, (1,), x)
    launch_mod.launch(kernel, (1,), xs[0])  # dropped by the last one: eager again
    assert staged == []
    launch_mod.launch(kernel, (1,), xs[-1])
    assert len(staged) == 1


def test_on_the_cpu_every_launch_runs_as_it_is(monkeypatch):
    monkeypatch.setattr(launch_mod, "_sites", {})
    kernel = _Kernel()
    for _ in range(3):
        launch_mod.launch(kernel, (1,), torch.zeros(2))
    assert len(kernel.runs) == 3 and launch_mod._sites == {}


def test_launches_together_are_one_key_one_capture_one_replay(staged):
    a, b, x = _Kernel(), _Kernel(), torch.zeros(4)
    for i in range(3):
        with launch_mod.together():
            launch_mod.launch(a, (1,), x, 1.0)
            assert len(a.runs) == i  # collected: nothing runs inside the block
            launch_mod.launch(b, (2,), x)
    assert len(staged) == 1  # both launches in one graph, captured at the second block
    assert a.runs == [((1,), (x, 1.0), {})] * 3 and b.runs == [((2,), (x,), {})] * 3


def test_a_block_reads_the_launch_settings_once(staged, monkeypatch):
    from halfprec.kernels.settings import settings

    monkeypatch.setenv("HALFPREC_LAUNCH", "update_warps=2")
    with launch_mod.together():
        inside = settings()
        monkeypatch.setenv("HALFPREC_LAUNCH", "update_warps=8")  # read when the block opened: not seen inside
        assert settings() is inside and inside.update_warps == 2
    assert settings().update_warps == 8  # read again after the block
    with pytest.raises(ValueError), launch_mod.together():
        raise ValueError
    monkeypatch.setenv("HALFPREC_LAUNCH", "update_warps=16")
    assert settings().update_warps == 16  # a block that raised let go of its settings too


def test_settings_that_fail_to_read_leave_no_block_open(staged, monkeypatch):
    kernel, x = _Kernel(), torch.zeros(4)
    monkeypatch.setenv("HALFPREC_LAUNCH", "no_such_field=1")
    with pytest.raises(ValueError, match="no_such_field"), launch_mod.together():
        launch_mod.launch(kernel, (1,), x)
    monkeypatch.delenv("HALFPREC_LAUNCH")
    launch_mod.launch(kernel, (1,), x)  # runs: not collected by a block left open
    with launch_mod.together():
        launch_mod.launch(kernel, (2,), x)
    assert kernel.runs == [((1,), (x,), {}), ((2,), (x,), {})]


def test_each_site_keeps_its_own_keys(staged):
    a, b, xs = _Kernel(), _Kernel(), [torch.zeros(4) for _ in range(launch_mod._KEPT)]
    for _ in range(2):
        with launch_mod.together("first"):
            launch_mod.launch(a, (1,), xs[0])
        for x in xs:  # as many keys as a site keeps, at another site
            with launch_mod.together("second"):
                launch_mod.launch(b, (1,), x)
    assert len(staged) == 1 + launch_mod._KEPT  # "first" captured at its second block: not pushed out


def test_a_block_that_raises_launches_nothing(staged):
    kernel = _Kernel()
    with pytest.raises(ValueError), launch_mod.together():
        launch_mod.launch(kernel, (1,), torch.zeros(2))
        raise ValueError("a check inside the block")
    assert kernel.runs == []
    launch_mod.launch(kernel, (1,), torch.zeros(2))  # launches run alone again after the block
    assert len(kernel.runs) == 1


def test_together_blocks_do_not_nest():
    with launch_mod.together(), pytest.raises(RuntimeError, match="do not nest"), launch_mod.together():
        pass


# --- on the GPU -----------------------------------------------------------------------------------------------


def _train(opt_cls, dtype, steps, *, move_grads, **kw):
    """Params, state and scaler after ``steps`` steps of a 3-layer MLP as users call them; step 3 overflows in fp16.
    ``move_grads``: a tensor allocated between zero_grad and backward makes the grad buffer land elsewhere."""
    torch.manual_seed(0)
    model = (
        torch.nn.Sequential(torch.nn.Linear(33, 65), torch.nn.GELU(), torch.nn.Linear(65, 7)).cuda().to(dtype)
    )
    scaler = halfprec.DynamicLossScaler(init_scale=2.0**10, hysteresis=2) if dtype == torch.float16 else None
    opt = opt_cls(model.parameters(), lr=1e-2, loss_scaler=scaler, max_grad_norm=0.5, **kw)
    x = torch.randn(16, 33, device="cuda", dtype=dtype)
    keep = []
    for s in range(steps):
        opt.zero_grad()
        if move_grads:
            keep.append(torch.empty(1000 + 37 * s, device="cuda"))
        loss = model(x * (s + 1)).float().square().mean()
        if s == 3 and scaler is not None:
            loss = loss * float("inf")
        opt.backward(loss)
        opt.step()
    torch.cuda.synchronize()
    state = opt.state_dict()
    kept = {"state": state["optimizer"]["state"], "masters": state["masters"], "scale": opt.loss_scale}
    return [p.detach().clone() for p in model.parameters()], kept


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("opt_cls", "kw"), [(FusedAdamW, {}), (FusedSGD, {"momentum": 0.9})])
@pytest.mark.parametrize("move_grads", [False, True])
def test_replayed_steps_equal_triton_launched_ones_bit_for_bit(monkeypatch, dtype, opt_cls, kw, move_grads):
    monkeypatch.setenv("HALFPREC_LAUNCH", "replay=0")
    before = launch_mod.replay_stats()
    plain, plain_state = _train(opt_cls, dtype, 8, move_grads=move_grads, **kw)
    assert launch_mod.replay_stats() == before
    monkeypatch.delenv("HALFPREC_LAUNCH")
    replayed, replayed_state = _train(opt_cls, dtype, 8, move_grads=move_grads, **kw)
    after = launch_mod.replay_stats()
    if not move_grads:
        # the step's launch groups (norm; finalize and update) replay from their second sighting on; the caching
        # allocator may hand the grad buffer two blocks in turn (seen with fp16 AdamW on an H100): two keys, each
        # launched once and captured once, then replayed
        assert after["replayed"] - before["replayed"] >= 4
    else:  # a moved grad buffer is a new key: launched as it is
        assert after["eager"] - before["eager"] >= 3
    for a, b in zip(plain, replayed, strict=True):
        assert torch.equal(a, b)
    torch.testing.assert_close(replayed_state, plain_state, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_skip_record_read_after_replayed_steps_is_each_steps_own(caplog):
    """The record copied on the side stream (what ``grad_norm`` and ``step_was_skipped`` read) equals the device's
    scalars of the same step, replay after replay, and each skip is logged once."""
    torch.manual_seed(0)
    model = (
        torch.nn.Sequential(torch.nn.Linear(33, 65), torch.nn.GELU(), torch.nn.Linear(65, 7)).cuda().half()
    )
    opt = FusedAdamW(
        model.parameters(),
        lr=1e-2,
        max_grad_norm=0.5,
        loss_scaler=halfprec.DynamicLossScaler(init_scale=2.0**8),
    )
    x = torch.randn(16, 33, device="cuda", dtype=torch.float16)
    before = launch_mod.replay_stats()["replayed"]
    for s in range(10):
        opt.zero_grad()
        loss = model(x * (s + 1)).float().square().mean()
        opt.backward(loss * float("inf") if s in (4, 7) else loss)
        opt.step()
        on_device = opt.step_results()  # a device copy of this step's scalars
        assert opt.step_was_skipped == on_device.step_was_skipped == (s in (4, 7))
        assert opt.grad_norm == on_device.grad_norm or s in (4, 7)
    assert launch_mod.replay_stats()["replayed"] - before >= 6
    opt.flush_reports()
    assert sum("step skipped" in r.getMessage() for r in caplog.records) == 2
