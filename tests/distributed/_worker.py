"""One rank of a multi-process test: ``python _worker.py SCENARIO ARGS.json`` (env: RANK, WORLD_SIZE, MASTER_*).

Each scenario runs many checks in one process group (start-up costs seconds) and saves plain tensors and
numbers to ``out/result-RANK.pt``; the pytest side compares them with the oracles.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import halfprec
from halfprec.distributed import ShardedMixedPrecisionOptimizer

RANK = int(os.environ.get("RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


# --- the model, the data, the per-rank gradient ---------------------------------------------------------
class Net(torch.nn.Module):
    """Odd sizes, a 0-d param, a param that never gets a grad and a frozen one."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.fc1 = torch.nn.Linear(7, 13)
        self.fc2 = torch.nn.Linear(13, 5)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.4)
        self.gain = torch.nn.Parameter(torch.tensor(0.75))
        self.unused = torch.nn.Parameter(torch.randn(3, generator=g))
        self.frozen = torch.nn.Parameter(torch.randn(4, generator=g), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x))) * self.gain


def make_model(dtype: torch.dtype) -> Net:
    return Net().to(dtype)


def make_optimizer(model: torch.nn.Module, kind: str) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    if kind == "adamw":
        return torch.optim.AdamW(groups, lr=0.01, foreach=False)
    if kind == "adam":
        return torch.optim.Adam(groups, lr=0.01, foreach=False)
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=0.05, momentum=0.9, foreach=False)
    if kind == "adagrad":
        return torch.optim.Adagrad(groups, lr=0.05, initial_accumulator_value=0.1, foreach=False)
    raise ValueError(kind)


def group_order_names(model: torch.nn.Module) -> list[str]:
    """Trainable param names in make_optimizer's group order (the order of master_params())."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    return [n for n in names if n.endswith("weight")] + [n for n in names if not n.endswith("weight")]


def batch(step: int, rank: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * step + 100 * micro + rank)
    return torch.randn(6, 7, generator=g), torch.randn(6, 5, generator=g)


def loss_of(
    model: torch.nn.Module, step: int, rank: int, micro: int, dtype: torch.dtype, poison: list
) -> torch.Tensor:
    x, y = batch(step, rank, micro)
    loss = F.mse_loss(model(x.to(dtype)).float(), y)
    if [step, rank] in poison:
        loss = loss * float("inf")
    return loss


def make_scaler(cfg: dict):
    if cfg["dtype"] == "fp16":
        return halfprec.DynamicLossScaler(init_scale=2.0**10, growth_interval=3, hysteresis=1)
    return None


# --- the oracle: one process, each rank's micro-batch grads computed separately, summed in rank order ----
def oracle(cfg: dict, steps: int, world: int) -> dict:
    dtype = DTYPES[cfg["dtype"]]
    low = make_model(dtype)
    ref = Net()  # fp32 params: the masters
    with torch.no_grad():
        for p, q in zip(ref.parameters(), low.parameters(), strict=True):
            p.copy_(q.float())
        if cfg.get("param_dtype"):
            ref.load_state_dict(Net().state_dict())  # fp32 originals are the masters
    names = [n for n, p in low.named_parameters() if p.requires_grad and n != "unused"]
    opt = make_optimizer(ref, cfg["opt"])
    scaler = make_scaler(cfg) or halfprec.StaticLossScaler(1.0)
    mp = halfprec.MixedPrecisionOptimizer(opt, loss_scaler=scaler, max_grad_norm=cfg.get("clip"))
    micro = cfg.get("micro", 1)
    out = {"norms": [], "skipped": [], "scales": []}
    for step in range(steps):
        scale = mp.loss_scale
        per_rank = []
        for r in range(world):
            low.zero_grad(set_to_none=True)
            acc = None
            for m in range(micro):
                (loss_of(low, step, r, m, dtype, cfg.get("poison", [])) * scale).backward()
                grads = [low.get_parameter(n).grad for n in names]
                if cfg["stage"] == 2:  # stage 2 reduces each micro-batch: keep them apart
                    acc = (acc or []) + [[g.clone() for g in grads]]
                    low.zero_grad(set_to_none=True)
            per_rank.append(
                acc if cfg["stage"] == 2 else [[low.get_parameter(n).grad.clone() for n in names]]
            )
        total = None
        for m in range(len(per_rank[0])):
            if cfg["reduce"] == "fp32":
                s = [
                    sum((per_rank[r][m][k].float() for r in range(1, world)), per_rank[0][m][k].float())
                    for k in range(len(names))
                ]
            else:
                s = [per_rank[0][m][k] / world for k in range(len(names))]
                for r in range(1, world):
                    s = [a + per_rank[r][m][k] / world for k, a in enumerate(s)]
                s = [t.float() for t in s]
            total = s if total is None else [a + b for a, b in zip(total, s, strict=True)]
        for n, g in zip(names, total, strict=True):
            ref.get_parameter(n).grad = g / world if (cfg["reduce"] == "fp32" and world > 1) else g
        unused = ref.get_parameter("unused")
        unused.grad = None  # no rank ever produced one
        mp.step()
        out["norms"].append(mp.grad_norm)
        out["skipped"].append(mp.step_was_skipped)
        out["scales"].append(mp.loss_scale)
        with torch.no_grad():
            for n in names:
                low.get_parameter(n).copy_(ref.get_parameter(n))
        mp.zero_grad()
    every = [n for n, p in low.named_parameters() if p.requires_grad]
    out["masters"] = {n: ref.get_parameter(n).detach().clone() for n in every}
    out["state"] = {
        n: {k: v.clone() for k, v in opt.state[ref.get_parameter(n)].items()}
        for n in every
        if opt.state.get(ref.get_parameter(n))
    }
    out["params"] = {n: low.get_parameter(n).detach().clone() for n in every}
    return out


# --- the system under test -------------------------------------------------------------------------------
def build_sharded(cfg: dict, **extra) -> tuple[Net, ShardedMixedPrecisionOptimizer]:
    dtype = DTYPES[cfg["dtype"]]
    if cfg.get("param_dtype"):
        model = Net()
        opt = make_optimizer(model, cfg["opt"])
        kw = {"param_dtype": dtype}
    else:
        model = make_model(dtype)
        opt = make_optimizer(model, cfg["opt"])
        kw = {}
    sharded = ShardedMixedPrecisionOptimizer(
        opt,
        named_parameters=model,
        stage=cfg["stage"],
        loss_scaler=make_scaler(cfg),
        max_grad_norm=cfg.get("clip"),
        reduce_dtype=cfg["reduce"],
        bucket_size=cfg.get("bucket", 40),
        **kw,
        **extra,
    )
    return model, sharded


def train(model, opt, cfg: dict, steps: range, trace: dict | None = None, sched=None) -> None:
    dtype = DTYPES[cfg["dtype"]]
    micro = cfg.get("micro", 1)
    for step in steps:
        for m in range(micro):
            loss = loss_of(model, step, RANK, m, dtype, cfg.get("poison", []))
            if cfg["stage"] == 1 and m < micro - 1:
                with opt.no_sync():
                    opt.backward(loss)
            else:
                opt.backward(loss)
        opt.step()
        if sched is not None and not opt.step_was_skipped:
            sched.step()
        if trace is not None:
            trace["norms"].append(opt.grad_norm)
            trace["skipped"].append(opt.step_was_skipped)
            trace["scales"].append(opt.loss_scale)
        opt.zero_grad()


def pieces(opt: ShardedMixedPrecisionOptimizer) -> dict:
    """This rank's share of masters and state in model space: name -> (lo, hi, master, {key: value})."""
    out = {}
    for name, _shape, _g, piece, param in opt.model_space():
        if piece is None:
            continue
        st = {k: v.clone() for k, v in opt.state.get(param, {}).items()}
        out[name] = {"lo": piece.lo, "hi": piece.hi, "master": param.detach().clone(), "state": st}
    return out


def scenario_sharded(out: str, configs: list, steps: int) -> dict:
    res = {}
    for i, cfg in enumerate(configs):
        model, opt = build_sharded(cfg)
        trace = {"norms": [], "skipped": [], "scales": []}
        train(model, opt, cfg, range(steps), trace)
        res[i] = {
            "trace": trace,
            "pieces": pieces(opt),
            "params": {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad},
            "skipped_steps": opt.skipped_steps,
            "frozen": model.frozen.detach().clone(),
        }
        if RANK == 0:
            res[i]["oracle"] = oracle(cfg, steps, WORLD)
    return res


def scenario_ddp(out: str, configs: list, steps: int) -> dict:
    """ZeRO-0: MixedPrecisionOptimizer over a DistributedDataParallel model (DDP averages in the param dtype)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    res = {}
    for i, cfg in enumerate(configs):
        dtype = DTYPES[cfg["dtype"]]
        model = make_model(dtype)
        ddp = DDP(model, find_unused_parameters=True)
        mp = halfprec.MixedPrecisionOptimizer(
            make_optimizer(model, cfg["opt"]), loss_scaler=make_scaler(cfg), max_grad_norm=cfg.get("clip")
        )
        trace = {"norms": [], "skipped": [], "scales": []}
        micro = cfg.get("micro", 1)
        for step in range(steps):
            for m in range(micro):
                # DDP decides whether to reduce in forward: the forward must run inside no_sync() too
                sync = contextlib.nullcontext() if m == micro - 1 else ddp.no_sync()
                with sync:
                    mp.backward(loss_of(ddp, step, RANK, m, dtype, cfg.get("poison", [])))
            mp.step()
            trace["norms"].append(mp.grad_norm)
            trace["skipped"].append(mp.step_was_skipped)
            trace["scales"].append(mp.loss_scale)
            mp.zero_grad()
        masters = dict(zip(group_order_names(model), mp.master_params(), strict=True))
        res[i] = {
            "trace": trace,
            "masters": {n: m.detach().clone() for n, m in masters.items()},
            "state": {
                n: {k: v.clone() for k, v in mp.state[m].items()}
                for n, m in masters.items()
                if mp.state.get(m)
            },
            "params": {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad},
            "skipped_steps": mp.skipped_steps,
        }
        if RANK == 0:
            res[i]["oracle"] = oracle({**cfg, "stage": 1, "reduce": "param"}, steps, WORLD)
    return res


def scenario_ckpt_save(out: str, configs: list, steps: int, more: int) -> dict:
    """Train, save ``out/A{i}``, train ``more`` steps: the continuation a resharded resume must reproduce."""
    from halfprec.distributed import checkpoint

    res = {}
    for i, cfg in enumerate(configs):
        model, opt = build_sharded(cfg)
        train(model, opt, cfg, range(steps))
        checkpoint.save(opt, Path(out) / f"A{i}")
        train(model, opt, cfg, range(steps, steps + more))
        res[i] = {
            "pieces": pieces(opt),
            "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        }
    return res


def scenario_ckpt_reshard(
    out: str, configs: list, steps: int, more: int, source: str, target: str, resume: bool
) -> dict:
    """Load ``source{i}`` into a fresh sharded optimizer at this world size; save ``target{i}``; maybe resume."""
    from halfprec.distributed import checkpoint

    res = {}
    for i, cfg in enumerate(configs):
        model, opt = build_sharded(cfg)
        checkpoint.load(opt, Path(out) / f"{source}{i}")
        complete = all(
            set(opt.state.get(p, {})) == {"step", "exp_avg", "exp_avg_sq"} or cfg["opt"] != "adamw"
            for n, _s, _g, piece, p in opt.model_space()
            if piece is not None and n != "unused"
        )
        checkpoint.save(opt, Path(out) / f"{target}{i}")
        res[i] = {
            "complete": complete,
            "state_keys": {
                n: sorted(opt.state.get(p, {}))
                for n, _s, _g, piece, p in opt.model_space()
                if piece is not None
            },
            "n_pieces": len(opt.layout.pieces),
            "groups_held": [len(g["params"]) for g in opt.param_groups],
        }
        if resume:
            train(model, opt, cfg, range(steps, steps + more))
            res[i]["pieces"] = pieces(opt)
            res[i]["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return res


def scenario_ckpt_die(out: str, cfg: dict) -> dict:
    """Save ``ck`` after one step; rank 1 dies in the middle of overwriting it after a second step."""
    from torch.distributed.checkpoint import FileSystemWriter

    from halfprec.distributed import checkpoint

    model, opt = build_sharded(cfg)
    train(model, opt, cfg, range(1))
    checkpoint.save(opt, Path(out) / "ck")
    torch.save(pieces(opt), Path(out) / f"first-{RANK}.pt")
    train(model, opt, cfg, range(1, 2))
    if RANK == 1:

        def die(self, *args, **kwargs):
            os._exit(3)

        FileSystemWriter.write_data = die
    checkpoint.save(opt, Path(out) / "ck")
    return {}


def scenario_gpu(out: str, steps: int) -> dict:
    """World size 1 on CUDA/NCCL: stage 1 and 2 equal MixedPrecisionOptimizer bit for bit; DCP round trip."""
    from halfprec.distributed import checkpoint, consolidate

    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if torch.cuda.is_available() else "cpu"
    )
    res = {}
    for stage in (1, 2):
        cfg = {"dtype": "fp16", "opt": "adamw", "stage": stage, "reduce": "fp32"}
        ref_model = make_model(torch.float16).to(device)
        ref = halfprec.MixedPrecisionOptimizer(
            make_optimizer(ref_model, "adamw"), loss_scaler=make_scaler(cfg), impl="torch"
        )
        model = make_model(torch.float16).to(device)
        opt = ShardedMixedPrecisionOptimizer(
            make_optimizer(model, "adamw"), named_parameters=model, stage=stage, loss_scaler=make_scaler(cfg)
        )
        for step in range(steps):
            for m, o in ((ref_model, ref), (model, opt)):
                x, y = batch(step, 0)
                o.backward(F.mse_loss(m(x.to(device, torch.float16)).float(), y.to(device)))
                o.step()
                o.zero_grad()
        checkpoint.save(opt, Path(out) / f"gpu{stage}")
        weights = consolidate(Path(out) / f"gpu{stage}")
        masters = dict(zip(group_order_names(ref_model), ref.master_params(), strict=True))
        model2 = make_model(torch.float16).to(device)
        opt2 = ShardedMixedPrecisionOptimizer(
            make_optimizer(model2, "adamw"),
            named_parameters=model2,
            stage=stage,
            loss_scaler=make_scaler(cfg),
        )
        checkpoint.load(opt2, Path(out) / f"gpu{stage}")
        res[stage] = {
            "params": {"sharded": _cpu_params(model), "unsharded": _cpu_params(ref_model)},
            "exported": {
                "checkpoint": {n: weights[n] for n in masters},
                "masters": {n: m.detach().cpu() for n, m in masters.items()},
            },
            "reloaded": {
                "saved": {"flat_master": opt.flat_master.detach().cpu(), **_cpu_params(model)},
                "loaded": {"flat_master": opt2.flat_master.detach().cpu(), **_cpu_params(model2)},
            },
            "scale": opt.loss_scale,
            "fused": _gpu_fused(device, stage, steps, cfg, ref, ref_model),
        }
    return res


def _gpu_fused(device, stage: int, steps: int, cfg: dict, ref, ref_model) -> dict:
    """The fused local step on CUDA (impl='auto' picks it for an AdamW with default flags) against the exact
    unsharded run ``ref`` of the same steps: masters and state within the fused tolerance, counters exact."""
    model = make_model(torch.float16).to(device)
    inner = torch.optim.AdamW(
        [
            {"params": [p for n, p in model.named_parameters() if n.endswith("weight")], "weight_decay": 0.1},
            {
                "params": [p for n, p in model.named_parameters() if not n.endswith("weight")],
                "weight_decay": 0.0,
            },
        ],
        lr=0.01,
    )
    opt = ShardedMixedPrecisionOptimizer(
        inner, named_parameters=model, stage=stage, loss_scaler=make_scaler(cfg)
    )
    for step in range(steps):
        x, y = batch(step, 0)
        opt.backward(F.mse_loss(model(x.to(device, torch.float16)).float(), y.to(device)))
        opt.step()
        opt.zero_grad()
    got = dict(zip(group_order_names(model), opt.master_params(), strict=True))
    want = dict(zip(group_order_names(ref_model), ref.master_params(), strict=True))

    def state(o, masters: dict) -> dict:
        return {
            f"{n}.{k}": v.detach().reshape(-1).cpu()
            for n, m in masters.items()
            for k, v in o.state.get(m, {}).items()
        }

    return {
        "impl": opt.impl,
        "masters": {n: m.detach().reshape(-1).cpu() for n, m in got.items()},
        "oracle_masters": {n: m.detach().reshape(-1).cpu() for n, m in want.items()},
        "state": state(opt, got),
        "oracle_state": state(ref, want),
        "params": {n: p.detach().reshape(-1).cpu() for n, p in model.named_parameters() if n in got},
        "masters_rounded": {
            n: got[n].detach().reshape(-1).to(p.dtype).cpu() for n, p in model.named_parameters() if n in got
        },
    }


def _cpu_params(model: torch.nn.Module) -> dict:
    return {n: p.detach().cpu() for n, p in model.named_parameters()}


def scenario_misc(out: str) -> dict:
    """Surface checks that need a process group: schedulers, named groups, errors, rank-local state dicts."""
    cfg = {"dtype": "bf16", "opt": "adamw", "stage": 1, "reduce": "fp32", "bucket": 30}
    res: dict = {}
    model, opt = build_sharded(cfg)
    res["mro"] = [f"{c.__module__}.{c.__qualname__}" for c in type(opt).__mro__]
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(model, opt, cfg, range(2))
        sched.step()
    res["lr_after"] = [g["lr"] for g in opt.param_groups]
    res["scheduler_warnings"] = [str(w.message) for w in caught if "lr_scheduler" in str(w.message)]
    # buckets are launched while backward runs, not all at its end. Here bucket 0 holds `unused`, which never
    # gets a grad, so (buckets go strictly in order) everything waits for the end of backward ...
    opt.backward(loss_of(model, 5, RANK, 0, torch.bfloat16, []))
    res["buckets"] = len(opt.layout.buckets)
    res["overlapped_with_unused_first"] = opt.reducer.overlapped
    # ... while without it the early buckets go out during backward
    model5 = make_model(torch.bfloat16)
    used = [p for n, p in model5.named_parameters() if p.requires_grad and n != "unused"]
    opt5 = ShardedMixedPrecisionOptimizer(torch.optim.AdamW(used), named_parameters=model5, bucket_size=30)
    opt5.backward(loss_of(model5, 5, RANK, 0, torch.bfloat16, []))
    res["overlapped"] = opt5.reducer.overlapped
    # bytes from the start of the flat grad buffer (None: no grad): views into it are at offsets >= 0
    res["stage1_grad_offsets"] = {
        n: None if p.grad is None else p.grad.data_ptr() - opt.reducer.flat_grad.data_ptr()
        for n, p in model.named_parameters()
        if p.requires_grad and n != "unused"
    }
    try:
        opt.unscale_()
        opt.backward(loss_of(model, 5, RANK, 0, torch.bfloat16, []))
        res["backward_after_unscale"] = "no error"
    except RuntimeError as e:
        res["backward_after_unscale"] = str(e)
    try:
        (
            loss_of(model, 5, RANK, 0, torch.bfloat16, []) * 1.0
        ).backward()  # a plain backward, not opt.backward
        res["plain_backward_after_unscale"] = "no error"
    except RuntimeError as e:
        res["plain_backward_after_unscale"] = str(e)
    opt.step()
    opt.zero_grad()
    # refresh_masters after an external weights-only change
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.mul_(2)
    opt.refresh_masters()
    held = [(n, piece, param) for n, _s, _g, piece, param in opt.model_space() if piece is not None]
    res["refresh"] = {
        "masters": {n: param.detach().clone() for n, _piece, param in held},
        "weights": {
            n: model.get_parameter(n).detach().reshape(-1)[piece.lo : piece.hi].float()
            for n, piece, _p in held
        },
    }
    # rank-local state dict: same world size round trip
    sd = opt.state_dict()
    model2, opt2 = build_sharded(cfg)
    opt2.load_state_dict(sd)
    res["round_trip"] = {
        "saved": {"flat_master": opt.flat_master.detach().clone(), **_cpu_params(model)},
        "loaded": {"flat_master": opt2.flat_master.detach().clone(), **_cpu_params(model2)},
    }
    # stage 2 frees whole grads and refuses no_sync
    cfg2 = dict(cfg, stage=2)
    model3, opt3 = build_sharded(cfg2)
    opt3.backward(loss_of(model3, 0, RANK, 0, torch.bfloat16, []))
    res["stage2_grads_kept"] = [n for n, p in model3.named_parameters() if p.grad is not None]
    try:
        with opt3.no_sync():
            pass
        res["stage2_no_sync"] = "no error"
    except RuntimeError as e:
        res["stage2_no_sync"] = str(e)
    # an optimizer built from named_parameters (torch keeps param_names in its groups)
    model4 = make_model(torch.bfloat16)
    inner = torch.optim.AdamW(model4.named_parameters(), lr=0.01)
    opt4 = ShardedMixedPrecisionOptimizer(inner, named_parameters=model4, bucket_size=30)
    train(model4, opt4, cfg, range(1))
    res["param_names"] = [list(g.get("param_names", [])) for g in opt4.param_groups]
    try:
        opt4.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
        res["add_param_group"] = "no error"
    except RuntimeError as e:
        res["add_param_group"] = str(e)
    # halfprec.initialize(zero_stage=2) builds the sharded optimizer from a Config over an fp32 model
    model6 = Net()
    engine = halfprec.initialize(
        model6, make_optimizer(model6, "adamw"), zero_stage=2, precision="bf16", gradient_accumulation_steps=2
    )
    records = []
    for step in range(2):
        for m in range(2):
            engine.backward(loss_of(engine, step, RANK, m, torch.bfloat16, []))
            record = engine.step()
        records.append([record.step, record.loss_scale, record.grad_norm, record.skipped])
    res["engine"] = {
        "type": type(engine.optimizer).__name__,
        "dtypes": sorted({str(p.dtype) for p in model6.parameters()}),
        "records": records,
    }
    return res


def _engine(stage: int, gas: int):
    torch.manual_seed(0)
    model = Net()  # fp32: the engine casts it and keeps the fp32 masters
    opt = make_optimizer(model, "adamw")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.2 * s))
    return halfprec.initialize(
        model,
        opt,
        precision="fp16",
        zero_stage=stage,
        gradient_accumulation_steps=gas,
        max_grad_norm=1.0,
        initial_scale=2.0**10,
        growth_interval=2,
        lr_scheduler=sched,
    )


def _engine_train(engine, steps: int, poison: list) -> list[float]:
    losses = []
    for _ in range(steps):
        step = engine.global_step
        for micro in range(engine.gradient_accumulation_steps):
            loss = loss_of(engine.module, step, RANK, micro, torch.float16, poison)
            engine.backward(loss)
            losses.append(loss.item())
        engine.step()
    return losses


def scenario_engine_ckpt(out: str, stage: int, gas: int, first: int, more: int) -> dict:
    """Engine at ZeRO-``stage``: ``first`` steps, save, ``more`` steps; a fresh engine loads and redoes them."""
    poison = [[1, 1]]  # an overflow on rank 1 only, before the save
    engine = _engine(stage, gas)
    _engine_train(engine, first, poison)
    path = engine.save_checkpoint(Path(out) / "ck", client_state={"rank0_pos": 7})
    full = _engine_train(engine, more, poison)
    resumed = _engine(stage, gas)
    with torch.no_grad():
        for p in resumed.module.parameters():
            p.add_(1.0)  # wrong weights: the checkpoint must restore them
    client = resumed.load_checkpoint(Path(out) / "ck")
    again = _engine_train(resumed, more, poison)
    weights = {k: v.clone() for k, v in engine.module.state_dict().items()}
    return {
        "path": str(path),
        "client": client,
        "full": full,
        "again": again,
        "weights": weights,
        "resumed_weights": {k: v.clone() for k, v in resumed.module.state_dict().items()},
        "counters": [engine.global_step, engine.skipped_steps, resumed.global_step, resumed.skipped_steps],
        "lr": [engine.optimizer.param_groups[0]["lr"], resumed.optimizer.param_groups[0]["lr"]],
        "scale": [engine.optimizer.loss_scale, resumed.optimizer.loss_scale],
    }


def _error(fn) -> str:
    try:
        fn()
    except RuntimeError as e:
        return str(e)
    return "no error"


def _sgd_line(stage: int):
    """Linear(4, 1) in bf16 at 0, SGD lr=1: a step moves the weight by exactly minus the applied grad."""
    model = torch.nn.Linear(4, 1, bias=False).bfloat16()
    with torch.no_grad():
        model.weight.zero_()
    opt = ShardedMixedPrecisionOptimizer(
        torch.optim.SGD(model.parameters(), lr=1.0), named_parameters=model, stage=stage
    )
    return model, opt


class _Two(torch.nn.Module):
    """fp32 params; ``b`` gets a grad only at step 0 (on every rank)."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.a = torch.nn.Parameter(torch.randn(5, generator=g))
        self.b = torch.nn.Parameter(torch.randn(3, generator=g))

    def loss(self, step: int, rank: int) -> torch.Tensor:
        x = torch.randn(5, generator=torch.Generator().manual_seed(50 * step + rank))
        out = (self.a * x).sum() ** 2
        return out + (self.b * x[:3]).sum() ** 2 if step == 0 else out


def scenario_semantics(out: str, steps: int) -> dict:
    """step() twice, step() without zero_grad(), zero_grad(set_to_none=False), frozen params, min-scale warning."""
    import warnings

    x = torch.ones(1, 4, dtype=torch.bfloat16) * (RANK + 1)  # grads 1 and 2: mean 1.5
    res: dict = {}
    for stage in (1, 2):
        r: dict = {}
        model, opt = _sgd_line(stage)
        opt.backward(model(x).sum())
        opt.step()
        r["twice"] = _error(opt.step)
        opt.zero_grad()
        r["after_zero_grad"] = _error(opt.step)  # no backward since zero_grad: allowed, updates nothing
        r["w_after_zero_grad_step"] = model.weight.detach().float().clone()
        model, opt = _sgd_line(stage)
        opt.backward(model(x).sum())
        opt.step()
        r["w1"] = model.weight.detach().float().clone()

        def again(model=model, opt=opt) -> None:
            opt.backward(model(x).sum())
            opt.step()

        r["no_zero_grad"] = _error(again)  # stage 1: accumulates like torch; stage 2: refused
        r["w2"] = model.weight.detach().float().clone()
        # zero_grad(set_to_none=False): b had a grad at step 0 and keeps a zero one, so AdamW keeps moving it
        two = _Two()
        ref = _Two()
        opt = ShardedMixedPrecisionOptimizer(
            torch.optim.AdamW(two.parameters(), lr=0.1, foreach=False), named_parameters=two, stage=stage
        )
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.1, foreach=False)
        b0 = two.b.detach().clone()
        for step in range(steps):
            opt.backward(two.loss(step, RANK))
            opt.step()
            opt.zero_grad(set_to_none=False)
            grads = []
            for rank in range(WORLD):
                ref.zero_grad(set_to_none=True)
                ref.loss(step, rank).backward()
                grads.append([None if p.grad is None else p.grad.clone() for p in ref.parameters()])
            for k, p in enumerate(ref.parameters()):
                if grads[0][k] is not None:
                    total = sum((g[k] for g in grads[1:]), grads[0][k])
                    p.grad = total / WORLD
                elif p.grad is not None or step > 0:
                    p.grad = torch.zeros_like(p)
            ref_opt.step()
        r["keep_zero"] = {
            "params": {n: p.detach().clone() for n, p in two.named_parameters()},
            "oracle": {n: p.detach().clone() for n, p in ref.named_parameters()},
            "b_before": b0,
        }
        # a param frozen when wrapped: refused once unfrozen and given a grad; its stale grad cleared by zero_grad
        lin = torch.nn.Linear(4, 1, bias=True).bfloat16()
        lin.bias.requires_grad_(False)
        opt = ShardedMixedPrecisionOptimizer(
            torch.optim.SGD(lin.parameters(), lr=1.0), named_parameters=lin, stage=stage
        )
        lin.bias.grad = torch.ones_like(lin.bias)
        opt.zero_grad(set_to_none=False)
        r["frozen_grad_zeroed"] = None if lin.bias.grad is None else lin.bias.grad.detach().clone()
        opt.zero_grad()
        r["frozen_grad_cleared"] = lin.bias.grad
        lin.bias.requires_grad_(True)
        opt.backward(lin(x).sum())
        r["unfrozen"] = _error(opt.step)
        res[stage] = r
    # overflow at the minimum scale: one RuntimeWarning, on rank 0 only
    lin = torch.nn.Linear(4, 1, bias=False).half()
    scaler = halfprec.DynamicLossScaler(init_scale=1.0, min_scale=1.0, hysteresis=1)
    opt = ShardedMixedPrecisionOptimizer(
        torch.optim.SGD(lin.parameters(), lr=1.0), named_parameters=lin, stage=2, loss_scaler=scaler
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            opt.backward(lin(x.half()).sum() * float("inf"))
            opt.step()
            opt.zero_grad()
    res["min_scale_warnings"] = [
        str(w.message)
        for w in caught
        if issubclass(w.category, RuntimeWarning) and "minimum" in str(w.message)
    ]
    res["min_scale_skipped"] = opt.skipped_steps
    return res


def scenario_fused(out: str, configs: list, steps: int, more: int) -> dict:
    """The fused local step (impl='triton', the interpreter on CPU) against the torch local step on the same
    data; then a save after ``steps``, a load into a fresh fused optimizer and ``more`` steps against the
    uninterrupted fused run."""
    from halfprec.distributed import checkpoint

    res: dict = {}
    sched_state: dict = {}
    for i, cfg in enumerate(configs):
        r: dict = {}
        for impl in ("torch", "triton"):
            model, opt = build_sharded(cfg, impl=impl)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)  # the lr reaches the kernel
            trace = {"norms": [], "skipped": [], "scales": []}
            train(model, opt, cfg, range(steps), trace, sched)
            if impl == "triton":
                checkpoint.save(opt, Path(out) / f"fused{i}")
                sched_state[i] = sched.state_dict()
            train(model, opt, cfg, range(steps, steps + more), trace, sched)
            trace["lr"] = [g["lr"] for g in opt.param_groups]
            r[impl] = {
                "impl": opt.impl,
                "trace": trace,
                "pieces": pieces(opt),
                "params": {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad},
            }
        model, opt = build_sharded(cfg, impl="triton")
        checkpoint.load(opt, Path(out) / f"fused{i}")  # restores the lr the scheduler had set
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
        sched.load_state_dict(sched_state[i])
        train(model, opt, cfg, range(steps, steps + more), sched=sched)
        r["resumed"] = {
            "pieces": pieces(opt),
            "params": {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad},
        }
        res[i] = r
    res["edges"] = _fused_edges()
    # what the fused local step refuses: inner step hooks (they would not run), optimizers without a kernel
    cfg = configs[0]
    model, opt = build_sharded(cfg, impl="triton")
    opt.optimizer.register_step_post_hook(lambda *a: None)
    opt.backward(loss_of(model, 0, RANK, 0, DTYPES[cfg["dtype"]], []))
    res["hooks"] = _error(opt.step)
    try:
        m = make_model(torch.bfloat16)
        ShardedMixedPrecisionOptimizer(torch.optim.NAdam(m.parameters()), named_parameters=m, impl="triton")
        res["nadam"] = "no error"
    except ValueError as e:
        res["nadam"] = str(e)
    return res


def _fused_edges() -> dict:
    """Fused local step: a rank holding no piece; a rank none of whose pieces got a grad yet; a scheduler built
    on the torch optimizer before wrapping; a flag the kernel lacks turned on after construction."""
    import warnings

    res: dict = {}
    # Linear(5, 1): one bucket of 2 x 16 elements, the weight wholly in rank 0's shard
    lin = torch.nn.Linear(5, 1, bias=False).bfloat16()
    opt = ShardedMixedPrecisionOptimizer(
        torch.optim.AdamW(lin.parameters(), lr=0.1), named_parameters=lin, impl="triton"
    )
    res["no_piece_pieces"] = len(opt.layout.pieces)
    before = lin.weight.detach().float().clone()
    for _ in range(2):
        opt.backward(lin(torch.ones(2, 5, dtype=torch.bfloat16)).float().sum())
        opt.step()
        opt.zero_grad()
    res["no_piece_weight"] = lin.weight.detach().float().clone()
    res["no_piece_before"] = before
    # optimizer order [y, x] -> layout [x, y]: rank 0 holds x and y[:4], rank 1 only y[4:]; y gets no grad at
    # step 0, so rank 1 has nothing to update there
    two = torch.nn.ParameterDict(
        {
            "y": torch.nn.Parameter(torch.ones(12, dtype=torch.bfloat16)),
            "x": torch.nn.Parameter(torch.ones(12, dtype=torch.bfloat16)),
        }
    )
    inner = torch.optim.AdamW([two["y"], two["x"]], lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(inner, step_size=1, gamma=0.5)  # built before wrapping
    opt = ShardedMixedPrecisionOptimizer(inner, named_parameters=two, bucket_size=1000, impl="triton")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            loss = (two["x"].float() * (RANK + 1)).sum()
            if step > 0:
                loss = loss + (two["y"].float() ** 2).sum()
            opt.backward(loss)
            opt.step()
            opt.zero_grad()
            sched.step()
    res["pieces_held"] = [opt.param_name(pc.param) for pc in opt.layout.pieces]
    res["xy"] = {n: p.detach().float().clone() for n, p in two.items()}
    res["sched_warnings"] = [str(w.message) for w in caught if "lr_scheduler" in str(w.message)]
    res["steps"] = {
        opt.param_name(pc.param): float(opt.state[opt.piece_param(pc.param)]["step"])
        for pc in opt.layout.pieces
    }
    opt.param_groups[0]["maximize"] = True
    opt.backward((two["x"].float() + two["y"].float()).sum())
    try:
        opt.step()
        res["maximize"] = "no error"
    except ValueError as e:
        res["maximize"] = str(e)
    return res


def scenario_accum(out: str, configs: list) -> dict:
    """fp32 gradient accumulation against its oracle, both local steps (``_accum.py``)."""
    from _accum import scenario_accum as run

    return run(out, configs)


def scenario_zero0(out: str, configs: list) -> dict:
    """ZeRO-0: the exact and fused optimizers all-reduce their fp32 sums (``_zero0.py``)."""
    from _zero0 import scenario_zero0 as run

    return run(out, configs)


def scenario_engine_zero0(out: str) -> dict:
    """The engine at ZeRO-0 with fp32 accumulation across ranks (``_zero0.py``)."""
    from _zero0 import scenario_engine_zero0 as run

    return run(out)


def scenario_grads(out: str, twice: list, edits: list) -> dict:
    """A param's hook firing twice in one backward, and grads changed by hand before the step (``_grads.py``)."""
    from _grads import scenario_grads as run

    return run(out, twice, edits)


def scenario_raised(out: str) -> dict:
    """A backward that raises part-way, caught, then training goes on, against its oracle (``_raised.py``)."""
    from _raised import scenario_raised as run

    return run(out)


def scenario_split(out: str, configs: list, steps: int, more: int) -> dict:
    """Split masters against fp32 masters, checkpoints between them (``_split.py``)."""
    from _split import scenario_split as run

    return run(out, configs, steps, more)


def scenario_split_load(out: str, configs: list) -> dict:
    """Split-master and fp32-master checkpoints loaded into either storage at this world size (``_split.py``)."""
    from _split import scenario_split_load as run

    return run(out, configs)


def scenario_multi(out: str, parts: list) -> dict:
    """Several scenarios in one process group: ``parts`` is ``[[name, kwargs], ...]``."""
    return {name: globals()[f"scenario_{name}"](out=out, **kwargs) for name, kwargs in parts}


def main() -> None:
    scenario, args_path = sys.argv[1], sys.argv[2]
    args = json.loads(Path(args_path).read_text())
    torch.set_num_threads(1)
    dist.init_process_group(
        os.environ.get("HALFPREC_TEST_BACKEND", "gloo"),
        init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
        rank=RANK,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        result = globals()[f"scenario_{scenario}"](**args)
        torch.save(result, Path(args["out"]) / f"result-{RANK}.pt")
        # every rank is done with every collective before any rank tears its sockets down
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # Skip interpreter finalization: on an oversubscribed CPU (3 ranks on 2 cores in CI) torch 2.13's gloo
    # threads have been seen to abort there ("terminate called without an active exception", SIGABRT) after
    # the rank had finished and saved its result. The result file is written and closed above.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
