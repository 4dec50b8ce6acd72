"""Ranks of the engine's FSDP2 tests (``python _engine_fsdp.py SCENARIO ARGS.json``, launched by
``test_engine_fsdp.py``): ``save`` on 2 gloo ranks, ``load`` at another world size.

``save``: ``initialize(fp32 model, zero_stage=3)`` next to the same steps written out by hand (fully_shard per
block, then the root; ``MixedPrecisionOptimizer`` with masters set to the fp32 rows), a checkpoint after
``FIRST`` steps, ``MORE`` steps on, and a fresh engine (other weights) that loads the checkpoint and redoes them;
a model the user sharded in bf16 with fp32 accumulation against ``MixedPrecisionOptimizer`` on its twin; the
refusals that need two ranks. Rank 0 keeps the whole masters and state at the save in ``whole.pt``.
"""

from __future__ import annotations

from pathlib import Path

import _worker  # the launch protocol (process group, results, teardown) is _worker.main's
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _fsdp import error_of
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import distribute_tensor

import halfprec
from halfprec.optim.mesh import as_dtensor, is_dtensor

LR, DECAY, CLIP, GAS = 1e-2, 0.1, 0.5, 2
FIRST, MORE = 2, 2


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(7, 9), torch.nn.Linear(9, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class Net(torch.nn.Module):
    """Repeated blocks in a ModuleList (the policy's unit), a layer before and after them, and a buffer. 7, 9 and
    1 output rows: uneven over 2 and 3 ranks, and rows no rank but the first holds."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.inp = torch.nn.Linear(5, 7)
        self.layers = torch.nn.ModuleList([Block(), Block()])
        self.head = torch.nn.Linear(7, 1)
        self.register_buffer("shift", torch.linspace(-0.1, 0.1, 7))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x) + self.shift
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def batch(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(3, 5, generator=g), torch.randn(3, 1, generator=g)


def schedule(optimizer: torch.optim.Optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + 0.2 * s))


def stage3_engine(seed: int = 0, **config):
    model = Net(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=DECAY)
    options = dict(precision="bf16", gradient_accumulation_steps=GAS, max_grad_norm=CLIP) | config
    return halfprec.initialize(model, opt, zero_stage=3, lr_scheduler=schedule(opt), **options)


def train(engine, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        for micro in range(engine.gradient_accumulation_steps):
            x, y = batch(engine.global_step, micro, dist.get_rank())
            loss = F.mse_loss(engine(x).float(), y)
            engine.backward(loss)
            losses.append(loss.item())
        engine.step()
    return losses


def gathered(mp, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Whole masters and optimizer state of ``mp`` by param name (collective over DTensor params' mesh)."""
    names = {p: n for n, p in model.named_parameters()}
    inner = [m for g in mp.param_groups for m in g["params"]]
    out = {}
    for p, m in zip(mp.model_params(), inner, strict=True):

        def whole(t: torch.Tensor, p=p) -> torch.Tensor:
            if is_dtensor(t):
                return t.full_tensor()
            return as_dtensor(p, t).full_tensor() if is_dtensor(p) and t.dim() else t.clone()

        out[f"master/{names[p]}"] = whole(m.detach())
        for key, value in mp.state[m].items():
            out[f"state/{names[p]}/{key}"] = whole(value)
    return out


def whole_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor() if is_dtensor(v) else v.clone() for k, v in model.state_dict().items()}


def by_hand(steps: int) -> dict:
    """What zero_stage=3 is documented to do, written out: cast, fully_shard each block then the root with an
    fp32 reduce-scatter, masters set to this rank's rows of the fp32 weights; the engine's loop."""
    model = Net()
    fp32 = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.to(torch.bfloat16)
    policy = MixedPrecisionPolicy(reduce_dtype=torch.float32)
    for block in model.layers:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=DECAY)
    sched = schedule(opt)
    mp = halfprec.MixedPrecisionOptimizer(opt, max_grad_norm=CLIP, grad_accum_dtype="fp32")
    names = {p: n for n, p in model.named_parameters()}
    with torch.no_grad():
        for p, m in zip(mp.model_params(), mp.master_params(), strict=True):
            m.copy_(
                distribute_tensor(fp32[names[p]], p.device_mesh, p.placements, src_data_rank=None).to_local()
            )
    losses = []
    for step in range(steps):
        for micro in range(GAS):
            x, y = batch(step, micro, dist.get_rank())
            loss = F.mse_loss(model(x.bfloat16()).float(), y)
            mp.backward(loss / GAS)
            losses.append(loss.item())
        mp.step()
        if not mp.step_was_skipped:
            sched.step()
        mp.zero_grad()
    return {"losses": losses, "state": gathered(mp, model), "weights": whole_weights(model)}


def user_sharded(seed: int = 0) -> torch.nn.Module:
    model = Net(seed).to(torch.bfloat16)
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    return model


def user_sharded_run(steps: int) -> dict:
    """A model the user sharded in bf16, two micro-batches (fp32 sums by default), against the optimizer alone."""
    model = user_sharded()
    engine = halfprec.initialize(
        model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=DECAY), precision="bf16",
        gradient_accumulation_steps=GAS,
    )  # fmt: skip
    twin = user_sharded()
    mp = halfprec.MixedPrecisionOptimizer(
        torch.optim.AdamW(twin.parameters(), lr=LR, weight_decay=DECAY), grad_accum_dtype="fp32"
    )
    for step in range(steps):
        for micro in range(GAS):
            x, y = batch(step, micro, dist.get_rank())
            engine.backward(F.mse_loss(engine(x).float(), y))
            engine.step()
            mp.backward(F.mse_loss(twin(x.bfloat16()).float(), y) / GAS)
        mp.step()
        mp.zero_grad()
    return {"engine": gathered(engine.optimizer, model), "optimizer": gathered(mp, twin)}


def fp32_sharded(frozen: bool) -> torch.nn.Module:
    """The user's fully_shard of the fp32 model; ``frozen``: bf16 trained shards beside a frozen fp32 one."""
    model = Net()
    if frozen:
        model.layers.to(torch.bfloat16)
        model.inp.requires_grad_(False)
        model.head.to(torch.bfloat16)
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    return model


def fp16_sharded() -> torch.nn.Module:
    model = Net().to(torch.float16)
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    return model


def user_fp32_run(frozen: bool) -> dict:
    """halfprec.initialize casts the user's fp32 shards (model.to, which FSDP2 handles) and starts the masters
    from their fp32 rows; the frozen fp32 shard is cast too."""
    model = fp32_sharded(frozen)
    fp32 = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    engine = halfprec.initialize(
        model, torch.optim.AdamW((p for p in model.parameters() if p.requires_grad), lr=LR), precision="bf16"
    )
    masters = {
        k.removeprefix("master/"): v for k, v in gathered(engine.optimizer, model).items() if "master/" in k
    }
    start = all(torch.equal(masters[n], fp32[n]) for n in masters) and len(masters) > 0
    losses = train(engine, 2)
    return {
        "dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "dtensors": all(is_dtensor(p) for p in model.parameters()),
        "masters_from_fp32": start,
        "trained": len(masters),
        "losses_finite": all(torch.isfinite(torch.tensor(losses))),
    }


def refusals(alone) -> dict:
    def init(model, **config):
        return halfprec.initialize(
            model, torch.optim.AdamW(p for p in model.parameters() if p.requires_grad), **config
        )

    def sub_mesh() -> torch.nn.Module:
        model = Net().to(torch.bfloat16)
        fully_shard(model, mesh=DeviceMesh.from_group(alone, "cpu"))
        return model

    return {
        "fp16_shards": error_of(lambda: init(fp16_sharded(), precision="bf16")),
        "sharded_twice": error_of(lambda: init(user_sharded(), precision="bf16", zero_stage=3)),
        "sub_mesh": error_of(lambda: init(sub_mesh(), precision="bf16")),
    }


def stage3_engine_losses(**config) -> list[float]:
    """The exact strategy's losses over the same run (``fused_run``'s reference)."""
    return train(stage3_engine(**config), FIRST + MORE)


def fused_run(out: Path, exact: list) -> dict:
    """``zero_stage=3`` with the fused strategy (Triton's interpreter; fp16, whose interpreted arithmetic is
    right): masters from the fp32 weights, the exact engine's losses within the fused path's tolerance, and a
    checkpoint that resumes to the same masters, state and weights as training on."""
    config = dict(impl="triton", precision="fp16", static_loss_scale=256.0)
    engine = stage3_engine(**config)
    fp32 = dict(Net().named_parameters())
    names = {p: n for n, p in engine.module.named_parameters()}
    rows = {
        names[p]: distribute_tensor(fp32[names[p]].detach(), p.device_mesh, p.placements, src_data_rank=None)
        for p in engine.optimizer.model_params()
    }
    starts = all(
        torch.equal(m, rows[names[p]].to_local())
        for p, m in zip(engine.optimizer.model_params(), engine.optimizer.master_params(), strict=True)
    )
    losses = train(engine, FIRST)
    engine.save_checkpoint(out / "ck-fused")
    losses += train(engine, MORE)
    resumed = stage3_engine(seed=1, **config)
    resumed.load_checkpoint(out / "ck-fused")
    resumed_losses = train(resumed, MORE)
    whole = [m.detach() for m in engine.optimizer.master_params()]
    again = [m.detach() for m in resumed.optimizer.master_params()]
    return {
        "type": type(engine.optimizer).__name__,
        "masters_start_from_fp32": starts,
        "losses": losses,
        "resumed_losses": resumed_losses,
        "resumed_masters_equal": all(torch.equal(a, b) for a, b in zip(whole, again, strict=True)),
        "resumed_weights_equal": all(
            torch.equal(a.to_local(), b.to_local())
            for a, b in zip(engine.module.parameters(), resumed.module.parameters(), strict=True)
        ),
        "exact_losses": exact,
    }


def scenario_save(out: str) -> dict:
    out = Path(out)
    rank = dist.get_rank()
    singles = [dist.new_group([r]) for r in range(dist.get_world_size())]  # every rank makes every group
    engine = stage3_engine()
    model = engine.module
    fp32 = {n: p.detach().clone() for n, p in Net().named_parameters()}
    start = gathered(engine.optimizer, model)
    params = {n: p.full_tensor() for n, p in model.named_parameters()}  # on every rank: a collective each
    result = {
        "sharded_modules": [n for n, m in model.named_modules() if isinstance(m, FSDPModule)],
        "dtensor_params": all(is_dtensor(p) for p in model.parameters()),
        "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "buffer_dtype": str(model.shift.dtype),
        "masters_are_fp32_originals": all(torch.equal(start[f"master/{n}"], w) for n, w in fp32.items()),
        "some_master_not_bf16": any(not torch.equal(w, w.bfloat16().float()) for w in fp32.values()),
        "params_are_rounded_masters": all(torch.equal(w, fp32[n].bfloat16()) for n, w in params.items()),
        "optimizer_over_the_shards": set(engine.optimizer.model_params()) == set(model.parameters()),
    }
    losses = train(engine, FIRST)
    path = engine.save_checkpoint(out / "ck", client_state={"note": 7})
    saved = {"state": gathered(engine.optimizer, model), "weights": whole_weights(model)}  # collectives
    if rank == 0:
        torch.save(saved, out / "whole.pt")
    losses += train(engine, MORE)
    full = {"losses": losses, "state": gathered(engine.optimizer, model), "weights": whole_weights(model)}
    resumed = stage3_engine(seed=1)  # other weights: the checkpoint must restore them
    client = resumed.load_checkpoint(out / "ck")
    resumed_losses = train(resumed, MORE)
    result |= {
        "path": str(path),
        "client": client,
        "full": full,
        "by_hand": by_hand(FIRST + MORE),
        "resumed": {
            "losses": resumed_losses,
            "state": gathered(resumed.optimizer, resumed.module),
            "weights": whole_weights(resumed.module),
        },
        "counters": [engine.global_step, resumed.global_step, engine.micro_step, resumed.micro_step],
        "lr": [engine.optimizer.param_groups[0]["lr"], resumed.optimizer.param_groups[0]["lr"]],
        "user": user_sharded_run(2),
        "user_fp32": [user_fp32_run(frozen) for frozen in (False, True)],
        "fused": fused_run(out, stage3_engine_losses(precision="fp16", static_loss_scale=256.0)),
        "refusals": refusals(singles[rank]),
    }
    return result


def scenario_load(out: str, ck: str) -> dict:
    """Load the 2-rank checkpoint into a zero_stage=3 engine at this world size; the whole masters and state."""
    engine = stage3_engine(seed=1)
    engine.load_checkpoint(ck)
    return {
        "state": gathered(engine.optimizer, engine.module),
        "weights": whole_weights(engine.module),
        "global_step": engine.global_step,
    }


if __name__ == "__main__":
    _worker.scenario_save = scenario_save
    _worker.scenario_load = scenario_load
    _worker.main()
