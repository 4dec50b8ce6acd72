"""One rank of ``test_fsdp_global.py`` (``python _fsdp_global.py fsdp_global ARGS.json``, on 2 or 4 gloo ranks).

Every rank trains the same bf16 model over FSDP2 on a 1-D mesh of all the ranks, each on its slice of every step's
global batch, and returns, gathered whole: per step the weights the backward ran on and the grads FSDP2 reduced
(before the step), and after the last step the fp32 masters, the 16-bit params and the AdamW state. The model, the
batches and the optimizer are built here for both sides: the single-process oracle (``test_fsdp_global.py``)
imports them.
"""

from __future__ import annotations

import _worker  # the launch protocol (process group, results, teardown) is _worker.main's
import torch
import torch.distributed as dist
import torch.nn.functional as F

import halfprec
from halfprec.optim.mesh import as_dtensor, local

__all__ = ["ROWS", "build", "global_batch", "loss_of", "make_model", "scenario_fsdp_global"]

LR, DECAY = 1e-2, 0.1
ROWS = 3  # rows of the global batch per rank


def make_model(mesh=None) -> torch.nn.Module:
    """5 -> 7 -> 9 -> 1 in bf16; over ``mesh``, sharded per block, then the root, as torchtitan does. 7, 9 and 1
    rows: uneven over 2 and 4 ranks, and over 4 ranks rank 3 holds none of the 9 and ranks 1-3 none of the 1."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(
        torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 9), torch.nn.Tanh(), torch.nn.Linear(9, 1)
    ).to(torch.bfloat16)
    if mesh is not None:
        from torch.distributed.fsdp import fully_shard  # noqa: PLC0415 - the oracle's side needs no FSDP2

        for block in (m[0], m[2], m[4]):
            fully_shard(block, mesh=mesh)
        fully_shard(m, mesh=mesh)
    return m


def global_batch(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s global batch, ``ROWS`` rows per rank: bf16 inputs, fp32 targets; rank r's slice is rows
    ``ROWS * r`` to ``ROWS * (r + 1)``."""
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(ROWS * world, 5, generator=g), torch.randn(ROWS * world, 1, generator=g)
    return x.to(torch.bfloat16), y


def loss_of(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The mean over the rows given. FSDP2 averages the ranks' grads (reduce-scatter with avg), and the mean of
    the ranks' means over equal slices is the mean over the global batch."""
    return F.mse_loss(model(x).float(), y)


def build(model: torch.nn.Module, cfg: dict) -> halfprec.MixedPrecisionOptimizer:
    """AdamW under halfprec: the exact strategy, or with ``fused`` the fused one (fp32 or ``masters`` split)."""
    if cfg.get("fused"):
        options = {"impl": "triton", "masters": cfg.get("masters", "fp32")}
    else:
        options = {"impl": "torch"}
    adamw = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=DECAY)
    return halfprec.MixedPrecisionOptimizer(adamw, max_grad_norm=cfg.get("clip"), **options)


def _whole(p: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` (``p``'s local shard, or a DTensor laid out as ``p``) gathered whole (collective)."""
    return as_dtensor(p, local(value)).full_tensor()


def _run_case(cfg: dict, mesh) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model(mesh)
    params = list(model.parameters())
    mp = build(model, cfg)
    weights, grads, norms = [], [], []
    for step in range(cfg["steps"]):
        x, y = global_batch(step, world)
        rows = slice(ROWS * rank, ROWS * (rank + 1))
        weights.append([p.full_tensor() for p in params])
        mp.backward(loss_of(model, x[rows], y[rows]))
        grads.append([_whole(p, p.grad) for p in params])
        mp.step()
        norms.append(mp.grad_norm)
        mp.zero_grad()
    state = mp.state_dict()["optimizer"]["state"]  # every strategy's: local tensors by param index
    return {
        "strategy": [type(mp).__name__, getattr(mp, "masters", "fp32")],
        "weights": weights,
        "grads": grads,
        "norms": norms,
        "skipped": mp.skipped_steps,
        "masters": [_whole(p, m.detach()) for p, m in zip(params, mp.master_params(), strict=True)],
        "params": [p.full_tensor() for p in params],
        "state": {key: [_whole(p, state[i][key]) for i, p in enumerate(params)] for key in ("exp_avg", "exp_avg_sq")},
        "step": [float(state[i]["step"]) for i in range(len(params))],
        "rows": [tuple(local(p).shape) for p in params],
    }  # fmt: skip


def scenario_fsdp_global(out: str, cases: list) -> dict:
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    return {cfg["name"]: _run_case(cfg, mesh) for cfg in cases}


if __name__ == "__main__":
    _worker.scenario_fsdp_global = scenario_fsdp_global
    _worker.main()
