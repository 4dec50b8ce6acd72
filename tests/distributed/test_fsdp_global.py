"""halfprec over FSDP2 against one process without FSDP2 on the same global batch (``_fsdp_global.py``: 2 and 4
gloo ranks, a 1-D mesh of all of them, so 4 shards of every param train, some of them empty).

Rank r trains on rows ``3r .. 3r + 2`` of every step's global batch; the oracle is this process: the model
unsharded, fed the whole batch, its loss the mean over it (FSDP2 averages the ranks' grads, so the mean of the
ranks' means is the global mean). Two checks per step, each where its arithmetic is:

- the grads: FSDP2's reduced bf16 grads (gathered whole) against one backward over the global batch at the same
  weights. The per-row products are the same; their sum is rounded to bf16 per rank and then summed over the ranks
  in bf16, where one process sums all rows at once: ``tol("fsdp_reduced_grad")`` (tests/tolerances.py), taken in
  units of the tensor's largest grad.
- the step: halfprec in this process (the same strategy over the unsharded model) given those grads holds, before
  every step, the weights the ranks held, and ends at their fp32 masters, bf16 params, AdamW state and step counts
  bit for bit: the update is elementwise, so shards change nothing. With clipping the global norm is summed in
  another order (fp64 partial sums over the mesh against torch's norm of per-tensor norms), so the norm agrees to
  ``grad_norm`` and the clipped updates to ``sharded_clipped_master``.

The fused strategy runs in Triton's interpreter; its split masters over the shards step as its fp32 masters, bit
for bit (``tests/optim/fused/test_split_masters.py`` has the same on an unsharded model).
"""

from __future__ import annotations

from pathlib import Path

import _fsdp_global as fsdp
import _launch
import pytest
import torch
from _compare import describe
from tests.tolerances import approx, tol

from halfprec.optim.split import split_master

pytestmark = [
    pytest.mark.skipif(torch.cuda.is_available(), reason="gloo on CPU, Triton's interpreter"),
    pytest.mark.slow,
]

STEPS = 4
CASES = {
    2: [
        {"name": "exact", "steps": STEPS},
        {"name": "exact-clip", "clip": 0.05, "steps": STEPS},
        {"name": "fused", "fused": True, "steps": STEPS},
        {"name": "fused-split", "fused": True, "masters": "split", "steps": STEPS},
    ],
    4: [
        {"name": "exact", "steps": STEPS},
        {"name": "exact-clip", "clip": 0.05, "steps": STEPS},
        {"name": "fused", "fused": True, "steps": STEPS},
    ],
}
RUNS = [
    pytest.param(world, cfg, id=f"{world}ranks-{cfg['name']}")
    for world, cases in CASES.items()
    for cfg in cases
    if cfg.get("masters") != "split"  # the split run is compared with the fp32 one, below
]
# the local rows of the 6 params (weight, bias of each Linear) on each rank
ROWS = {
    2: [[(4, 5), (4,), (5, 7), (5,), (1, 9), (1,)], [(3, 5), (3,), (4, 7), (4,), (0, 9), (0,)]],
    4: [
        [(2, 5), (2,), (3, 7), (3,), (1, 9), (1,)],
        [(2, 5), (2,), (3, 7), (3,), (0, 9), (0,)],
        [(2, 5), (2,), (3, 7), (3,), (0, 9), (0,)],
        [(1, 5), (1,), (0, 7), (0,), (0, 9), (0,)],
    ],
}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """``ranks(world)``: what each of ``world`` ranks returned (one launch per world size, on first use)."""
    done: dict[int, list] = {}

    def get(world: int) -> list:
        if world not in done:
            out = tmp_path_factory.mktemp(f"fsdp-global-{world}")
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(_launch, "WORKER", Path(__file__).with_name("_fsdp_global.py"))
                _launch.launch(world, "fsdp_global", out, timeout=300.0, cases=CASES[world])
            done[world] = _launch.results(out, world)
        return done[world]

    return get


def _backward(weights: list[torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    """The bf16 grads of ``loss_of`` over ``(x, y)`` at ``weights``, in this process: no FSDP2, no halfprec."""
    model = fsdp.make_model()
    with torch.no_grad():
        for p, w in zip(model.parameters(), weights, strict=True):
            p.copy_(w)
    fsdp.loss_of(model, x, y).backward()
    return [p.grad for p in model.parameters()]


def _global_grads(weights: list[torch.Tensor], step: int, world: int) -> tuple[list, list]:
    """One backward over step ``step``'s global batch at ``weights``; and the bound's unit, sum_r |P_r|, from
    each rank's share P_r (the backward over its slice, divided by ``world``)."""
    x, y = fsdp.global_batch(step, world)
    shares = [
        _backward(weights, x[fsdp.ROWS * r : fsdp.ROWS * (r + 1)], y[fsdp.ROWS * r : fsdp.ROWS * (r + 1)])
        for r in range(world)
    ]
    units = [sum(s[i].float().abs() / world for s in shares) for i in range(len(weights))]
    return _backward(weights, x, y), units


def _single_process(cfg: dict, run: dict) -> dict:
    """halfprec over the unsharded model, given at each step the grads the ranks reduced: the weights it held
    before each step, its norms, and its masters, params and AdamW state at the end."""
    model = fsdp.make_model()
    mp = fsdp.build(model, cfg)
    weights, norms = [], []
    for grads in run["grads"]:
        weights.append([p.detach().clone() for p in model.parameters()])
        for p, g in zip(model.parameters(), grads, strict=True):
            p.grad = g.clone()
        mp.step()
        norms.append(mp.grad_norm)
        mp.zero_grad()
    state = mp.state_dict()["optimizer"]["state"]
    return {
        "strategy": [type(mp).__name__, getattr(mp, "masters", "fp32")],
        "weights": weights,
        "norms": norms,
        "skipped": mp.skipped_steps,
        "masters": [m.detach().clone() for m in mp.master_params()],
        "params": [p.detach().clone() for p in model.parameters()],
        "state": {key: [state[i][key] for i in range(len(state))] for key in ("exp_avg", "exp_avg_sq")},
        "step": [float(state[i]["step"]) for i in range(len(state))],
    }


def _assert_equal(got: torch.Tensor, want: torch.Tensor, where: str) -> None:
    assert got.dtype == want.dtype and torch.equal(got, want), f"{where}: {describe(got, want)}"


@pytest.mark.parametrize(("world", "cfg"), RUNS)
def test_every_rank_holds_its_rows_and_gathers_the_same(ranks, world, cfg):
    runs = [r[cfg["name"]] for r in ranks(world)]
    assert [run["rows"] for run in runs] == ROWS[world]
    for rank, run in enumerate(runs[1:], 1):
        for key in ("weights", "grads", "masters", "params", "state"):
            assert str(run[key]) == str(runs[0][key]), f"rank {rank}'s {key} differ from rank 0's"
        assert run["norms"] == runs[0]["norms"] and run["step"] == runs[0]["step"]


@pytest.mark.parametrize(("world", "cfg"), RUNS)
def test_reduced_grads_are_one_backward_over_the_global_batch(ranks, world, cfg):
    run = ranks(world)[0][cfg["name"]]
    bound = tol("fsdp_reduced_grad", torch.bfloat16)["atol"]  # in units of sum_r |P_r|, elementwise
    for step, (weights, grads) in enumerate(zip(run["weights"], run["grads"], strict=True)):
        want, units = _global_grads(weights, step, world)
        for i, (got, one, unit) in enumerate(zip(grads, want, units, strict=True)):
            assert got.dtype == one.dtype == torch.bfloat16
            off = (got.float() - one.float()).abs() / unit
            # where every share is 0 both must be: 0 / 0 is NaN (not over the bound), anything else / 0 is inf
            assert not (off > bound).any(), (
                f"step {step}, grad {i}: {describe(got, one)}; off by up to {off.nan_to_num(0).max():.3g}"
                f" x sum_r |P_r|, bound {bound}"
            )


@pytest.mark.parametrize(("world", "cfg"), RUNS)
def test_steps_over_shards_are_the_single_process_steps(ranks, world, cfg):
    run = ranks(world)[0][cfg["name"]]
    one = _single_process(cfg, run)
    want = ["FusedAdamW" if cfg.get("fused") else "ExactMixedPrecisionOptimizer", "fp32"]
    assert run["strategy"] == one["strategy"] == want
    assert run["skipped"] == one["skipped"] == 0
    assert run["step"] == one["step"] == [float(STEPS)] * 6
    exact = cfg.get("clip") is None
    for step in range(STEPS):
        assert run["norms"][step] == approx(one["norms"][step], "grad_norm"), f"step {step}"
        for i, (mine, theirs) in enumerate(zip(one["weights"][step], run["weights"][step], strict=True)):
            if exact:
                _assert_equal(mine, theirs, f"weight {i} before step {step}")
    for i in range(6):
        for key, got, want in [
            ("master", run["masters"][i], one["masters"][i]),
            *((key, run["state"][key][i], one["state"][key][i]) for key in ("exp_avg", "exp_avg_sq")),
        ]:
            if exact:
                _assert_equal(got, want, f"{key} {i}")
            else:
                torch.testing.assert_close(got, want, **tol("sharded_clipped_master"), msg=f"{key} {i}")
        if exact:
            _assert_equal(run["params"][i], one["params"][i], f"param {i}")
        # either way the ranks' bf16 params are their own masters rounded to nearest even
        _assert_equal(run["params"][i], run["masters"][i].to(torch.bfloat16), f"param {i} from its master")


def test_split_masters_over_shards_step_as_fp32_masters(ranks):
    """The fused strategy with ``masters="split"`` over 2 ranks' bf16 shards: the fp32 masters (each the bf16
    param joined with its low 16 bits) and the AdamW state equal the fp32-master run's bit for bit, after the same
    norms; each bf16 param is its master rounded ties away (split) where the fp32 run's rounds ties to even, so the
    two differ exactly at ties."""
    split, fp32 = (ranks(2)[0][name] for name in ("fused-split", "fused"))
    assert (split["strategy"], fp32["strategy"]) == (["FusedAdamW", "split"], ["FusedAdamW", "fp32"])
    assert split["norms"] == fp32["norms"] and split["step"] == fp32["step"] == [float(STEPS)] * 6
    for step in range(STEPS):
        for i, (a, b) in enumerate(zip(split["grads"][step], fp32["grads"][step], strict=True)):
            _assert_equal(a, b, f"grad {i} of step {step}")  # the same weights, so the same grads
    ties = 0
    for i, (m, r) in enumerate(zip(split["masters"], fp32["masters"], strict=True)):
        _assert_equal(m, r, f"master {i}")
        for key in ("exp_avg", "exp_avg_sq"):
            _assert_equal(split["state"][key][i], fp32["state"][key][i], f"{key} {i}")
        away, even = split["params"][i], fp32["params"][i]
        _assert_equal(away.view(torch.int16), split_master(r)[0].view(torch.int16), f"split param {i}")
        _assert_equal(even, r.to(torch.bfloat16), f"fp32-master param {i}")
        ties += int((away != even).sum())
    assert ties == 0, f"{ties} params differ (ties rounded away); none expected on this data"
