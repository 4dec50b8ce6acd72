"""One rank of the FSDP2 tests (``python _fsdp.py fsdp ARGS.json``, launched by ``test_fsdp.py`` on 4 gloo ranks).

One launch does it all, each phase on its own mesh: ranks {0, 1} and {2, 3} run two halves of the 1-D cases at
the same time (two 2-rank meshes), all four run HSDP on a 2x2 mesh, then ranks {0, 1, 2} and {3} load the
checkpoint the first pair saved, at world sizes 3 and 1. Cases with ``fused`` run the fused strategy (Triton's
interpreter) and have a second oracle: the same fused optimizer over the whole model, fed the whole grads.

The oracle of a case, on every rank: the same model unsharded, as fp32 copies stepped by the same torch AdamW on
the full grads. The grads come from a twin FSDP2 model given the same weights and batches before every step, whose
reduced 16-bit shards are summed in fp32 per micro-batch by hand (no halfprec in the way), gathered, unscaled,
clipped with ``clip_coefficient`` on the norm fp32(sqrt(fp64 sum of squares)); a step is skipped where an inf was
planted in one rank's grad shard.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import _worker  # the launch protocol (process group, results, teardown) is _worker.main's
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as torch_dcp
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard, distribute_tensor

import halfprec
from halfprec.distributed import checkpoint as dcp
from halfprec.optim import FusedAdamW
from halfprec.optim.clip import clip_coefficient
from halfprec.optim.mesh import as_dtensor, local

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
LR, DECAY = 1e-2, 0.1


def make_model(dtype: torch.dtype, mesh, policy: MixedPrecisionPolicy | None = None) -> torch.nn.Module:
    """7, 9 and 1 output rows: uneven over 2 and 3 ranks, and a (1, 9) weight of which rank 1 of 2 holds no row."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(
        torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 9), torch.nn.Tanh(), torch.nn.Linear(9, 1)
    ).to(dtype)
    options = {"mesh": mesh} | ({} if policy is None else {"mp_policy": policy})
    for block in (m[0], m[2], m[4]):  # per block, then the root, as torchtitan does
        fully_shard(block, **options)
    fully_shard(m, **options)
    return m


def batch(step: int, micro: int, rank: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(3, 5, generator=g).to(dtype), torch.randn(3, 1, generator=g)


def loss_of(model, step: int, micro: int, dtype: torch.dtype) -> torch.Tensor:
    x, y = batch(step, micro, dist.get_rank(), dtype)
    return F.mse_loss(model(x).float(), y)


def full(p: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` (``p``'s local shard) gathered whole (collective over ``p``'s mesh)."""
    return as_dtensor(p, value).full_tensor()


def fp64_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([g.to(torch.float64).square().sum() for g in grads]).sum().sqrt().to(torch.float32)


def make_scaler(cfg: dict):
    if cfg.get("scaler") == "dynamic":
        return halfprec.DynamicLossScaler(init_scale=2.0**10, hysteresis=2)
    return None


def run_case(cfg: dict, mesh) -> dict:
    """Train ``cfg`` with halfprec over FSDP2 on ``mesh`` beside its oracle; return both, gathered."""
    dtype, micro = DTYPES[cfg["dtype"]], cfg.get("micro", 1)
    model, twin = make_model(dtype, mesh), make_model(dtype, mesh)
    params, twins = list(model.parameters()), list(twin.parameters())
    foreach = cfg.get("foreach", False)
    fused = {"impl": "triton", "masters": cfg.get("masters", "fp32")} if cfg.get("fused") else {}
    mp = halfprec.MixedPrecisionOptimizer(
        torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=DECAY, foreach=foreach),
        loss_scaler=make_scaler(cfg), max_grad_norm=cfg.get("clip"), **fused,
        grad_accum_dtype="fp32" if micro > 1 else "param",
    )  # fmt: skip
    # the fused cases' second oracle: the same fused optimizer over the model unsharded, fed the whole grads
    plain = [torch.nn.Parameter(p.full_tensor()) for p in params] if fused and micro == 1 else []
    fopt = None
    if plain:
        fopt = FusedAdamW(
            plain, lr=LR, weight_decay=DECAY, loss_scaler=make_scaler(cfg), max_grad_norm=cfg.get("clip"),
            masters=fused["masters"],
        )  # fmt: skip
    oracle = [torch.nn.Parameter(p.full_tensor().float()) for p in params]
    oopt = torch.optim.AdamW(oracle, lr=LR, weight_decay=DECAY, foreach=foreach)
    oscaler = make_scaler(cfg)
    steps, rows, differs = [], [tuple(local(p).shape) for p in params], False
    for step in range(cfg["steps"]):
        scale = mp.loss_scaler.scale.clone()
        with torch.no_grad():
            for t, p in zip(twins, params, strict=True):
                local(t).copy_(local(p))
        sums: list = [None] * len(params)
        low: list = [None] * len(params)  # the same sums in 16 bits: fp32 accumulation must differ from it
        for k in range(micro):
            (loss_of(twin, step, k, dtype) * scale).backward()
            for i, t in enumerate(twins):
                g = local(t.grad)
                sums[i] = g.float() if sums[i] is None else sums[i] + g
                low[i] = g.clone() if low[i] is None else low[i] + g
                t.grad = None
            mp.backward(loss_of(model, step, k, dtype))
        planted = [r for s, r in cfg.get("inf", []) if s == step]
        if dist.get_rank() in planted:
            with torch.no_grad():
                local(params[0].grad)[0, 0] = float("inf")
        differs = differs or any(not torch.equal(s, w.float()) for s, w in zip(sums, low, strict=True))
        if fopt is not None:
            for q, p in zip(plain, params, strict=True):
                q.grad = full(p, local(p.grad))
            if planted:  # HSDP: the other replica's ranks gather a shard without it
                plain[0].grad[0, 0] = float("inf")
            with (
                warnings.catch_warnings()
            ):  # scaled grads set by hand, on purpose: no "not loss-scaled" warning
                warnings.simplefilter("ignore", RuntimeWarning)
                fopt.step()
            fopt.zero_grad()
        mp.step()
        mp.zero_grad()
        # the oracle's step
        grads = [full(p, s) * (1.0 / scale) for p, s in zip(params, sums, strict=True)]
        norm = fp64_norm(grads)
        planted_anywhere = any(s == step for s, _ in cfg.get("inf", []))
        skipped = planted_anywhere or not bool(norm.isfinite())
        if oscaler is not None:
            oscaler.step_update(torch.tensor(float(skipped)))
        if not skipped:
            if cfg.get("clip") is not None:
                torch._foreach_mul_(grads, clip_coefficient(cfg["clip"], norm))
            for o, g in zip(oracle, grads, strict=True):
                o.grad = g
            oopt.step()
        steps.append(
            {
                "skipped": mp.step_was_skipped,
                "oracle_skipped": skipped,
                "norm": mp.grad_norm,
                "oracle_norm": None if planted_anywhere else norm.item(),
                "scale": mp.loss_scale,
                "oracle_scale": None if oscaler is None else oscaler.loss_scale,
                "fused_oracle": None
                if fopt is None
                else [fopt.step_was_skipped, fopt.grad_norm, fopt.loss_scale],
            }
        )
    masters = mp.master_params()
    saved = mp.state_dict()["optimizer"]["state"]  # every strategy's: local tensors by param index
    state = {key: [full(p, saved[i][key]) for i, p in enumerate(params)] for key in ("exp_avg", "exp_avg_sq")}
    if fopt is not None:
        theirs = fopt.state_dict()["optimizer"]["state"]
        fused_oracle = {
            "masters": [m.detach().clone() for m in fopt.master_params()],
            "params": [q.detach().clone() for q in plain],
            "state": {key: [theirs[i][key] for i in range(len(plain))] for key in state},
        }
    return {
        "fused_oracle": fused_oracle if fopt is not None else None,
        # the fused strategy writes the 16-bit shards in place: its chunks hold no flat param copy
        "in_place": [chunk.param is None and chunk.in_place for chunk, _ in mp._where] if fused else None,
        "steps": steps,
        "rows": rows,
        "placements": str(params[0].placements),
        "differs": differs,
        "masters": [full(p, m.detach()) for p, m in zip(params, masters, strict=True)],
        "params": [p.full_tensor() for p in params],
        "state": state,
        "step_count": [float(saved[i]["step"]) for i in range(len(params))],
        "oracle": [o.detach() for o in oracle],
        "oracle_state": {key: [oopt.state[o][key] for o in oracle] for key in state},
    }


# --- checkpoints ------------------------------------------------------------------------------------------
def gathered(mp, model) -> dict:
    """Whole masters and AdamW state of ``mp`` (any strategy: its state dict's) by param name (collective)."""
    out = {}
    state = mp.state_dict()["optimizer"]["state"]
    for i, ((name, p), m) in enumerate(zip(model.named_parameters(), mp.master_params(), strict=True)):
        out[f"master/{name}"] = full(p, m.detach())
        for key, value in state[i].items():
            out[f"state/{name}/{key}"] = full(p, local(value)) if value.dim() else value.clone()
    return out


def build_for_checkpoint(mesh, impl: str = "torch"):
    """``impl="triton"``: the fused strategy (Triton's interpreter), fp16, whose interpreted rounding is right."""
    model = make_model(torch.float16 if impl == "triton" else torch.bfloat16, mesh)
    mp = halfprec.MixedPrecisionOptimizer(
        torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=DECAY), max_grad_norm=0.05, impl=impl,
        loss_scaler=halfprec.StaticLossScaler(64.0) if impl == "triton" else None,
    )  # fmt: skip
    return model, mp


def train_and_save(model, mp, path: Path, group) -> dict:
    """Three steps, a DCP save into ``path``; the whole masters and state (also in ``path``-whole.pt)."""
    dtype = next(model.parameters()).dtype
    for step in range(3):
        mp.backward(loss_of(model, step, 0, dtype))
        mp.step()
        mp.zero_grad()
    dcp.save(mp, path, named_parameters=model, process_group=group)
    whole = gathered(mp, model)
    if dist.get_rank(group) == 0:
        torch.save(whole, path.with_name(f"{path.name}-whole.pt"))
    return whole


def save_checkpoint(out: Path, mesh, group) -> dict:
    """Three steps at world size 2, then a DCP save (the exact strategy, and the fused one into ck-fused); pair
    rank 0 keeps the whole masters and state."""
    train_and_save(*build_for_checkpoint(mesh, "triton"), out / "ck-fused", group)
    model, mp = build_for_checkpoint(mesh)
    whole = train_and_save(model, mp, out / "ck", group)
    # the state dict as torch's DCP saves it (its DTensors whole), for load_checkpoint to reshard
    torch_dcp.save({"optimizer": mp.state_dict()}, checkpoint_id=out / "ck-torch-dcp", process_group=group)
    # saved per rank: loads into a fresh optimizer on the same rank, refused on the other rank (other rows)
    torch.save(mp.state_dict(), out / f"sd-{dist.get_rank()}.pt")
    dist.barrier(group)
    fresh_model, fresh = build_for_checkpoint(mesh)
    fresh.load_state_dict(torch.load(out / f"sd-{dist.get_rank()}.pt", weights_only=False))
    same = gathered(fresh, fresh_model)
    other = torch.load(out / f"sd-{1 - dist.get_rank()}.pt", weights_only=False)
    # even shards (8 rows, 4 per rank): the other rank's file has this rank's shapes, and is refused all the same
    even = torch.nn.Linear(4, 8).bfloat16()
    fully_shard(even, mesh=mesh)
    even_mp = halfprec.MixedPrecisionOptimizer(torch.optim.AdamW(even.parameters(), lr=LR), impl="torch")
    even_mp.backward(even(torch.ones(2, 4, dtype=torch.bfloat16)).float().square().mean())
    even_mp.step()
    torch.save(even_mp.state_dict(), out / f"even-{dist.get_rank()}.pt")
    dist.barrier(group)
    even_other = torch.load(out / f"even-{1 - dist.get_rank()}.pt", weights_only=False)
    even_own = torch.load(out / f"even-{dist.get_rank()}.pt", weights_only=False)
    return {
        "even_other_rank": error_of(lambda: even_mp.load_state_dict(even_other)),
        "even_own_rank": error_of(lambda: even_mp.load_state_dict(even_own)),
        "local_state_dict_round_trip": all(torch.equal(same[k], whole[k]) for k in whole),
        "local_state_dict_shapes": [e["shape"] for e in mp.state_dict()["params"]],
        "other_rank_state_dict": error_of(lambda: fresh.load_state_dict(other)),
    }


def load_checkpoint(out: Path, mesh, group) -> dict:
    """Load the world-size-2 checkpoints into this world size's shards: the exact strategy's, and the fused one's
    into the fused and the exact strategy."""
    fused_saved = torch.load(out / "ck-fused-whole.pt", weights_only=True)
    fused_unequal = {}
    for impl in ("triton", "torch"):
        f_model, f_mp = build_for_checkpoint(mesh, "triton")
        if impl == "torch":  # the exact strategy over the same fp16 shards
            f_mp = halfprec.MixedPrecisionOptimizer(
                torch.optim.AdamW(f_model.parameters(), lr=LR, weight_decay=DECAY),
                max_grad_norm=0.05, loss_scaler=halfprec.StaticLossScaler(64.0), impl="torch",
            )  # fmt: skip
        dcp.load(f_mp, out / "ck-fused", named_parameters=f_model, process_group=group)
        got = gathered(f_mp, f_model)
        fused_unequal[impl] = sorted(
            k for k in fused_saved if k not in got or not torch.equal(got[k], fused_saved[k])
        )
    model, mp = build_for_checkpoint(mesh)
    dcp.load(mp, out / "ck", named_parameters=model, process_group=group)
    loaded = gathered(mp, model)
    saved = torch.load(out / "ck-whole.pt", weights_only=True)
    masters = [loaded[f"master/{n}"] for n, _ in model.named_parameters()]
    # torch's DCP: into an optimizer that has not stepped (no state for DCP to fill: refused by its has_state),
    # then into one that has (resharded: every tensor equal to the saved run's)
    t_model, t_mp = build_for_checkpoint(mesh)
    fresh = {"optimizer": t_mp.state_dict()}
    torch_dcp.load(fresh, checkpoint_id=out / "ck-torch-dcp", process_group=group)
    fresh_refused = error_of(lambda: t_mp.load_state_dict(fresh["optimizer"]))
    t_mp.backward(loss_of(t_model, 0, 0, torch.bfloat16))
    t_mp.step()
    t_mp.zero_grad()
    stepped = {"optimizer": t_mp.state_dict()}
    torch_dcp.load(stepped, checkpoint_id=out / "ck-torch-dcp", process_group=group)
    t_mp.load_state_dict(stepped["optimizer"])
    t_loaded = gathered(t_mp, t_model)
    return {
        "torch_dcp_unequal": sorted(
            k for k in saved if k not in t_loaded or not torch.equal(t_loaded[k], saved[k])
        ),
        "torch_dcp_into_fresh": fresh_refused,
        "world": dist.get_world_size(group),
        "keys_equal": sorted(loaded) == sorted(saved),
        "unequal": sorted(k for k in saved if k not in loaded or not torch.equal(loaded[k], saved[k])),
        "params_are_rounded_masters": all(
            torch.equal(p.full_tensor(), m.to(p.dtype))
            for p, m in zip(model.parameters(), masters, strict=True)
        ),
        "rows": [tuple(local(p).shape) for p in model.parameters()],
        "fused_unequal": fused_unequal,
    }


# --- surface: fp32 shards, refusals that need several ranks ---------------------------------------------------
def error_of(fn) -> list[str]:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test reads the type and the message
        return [type(e).__name__, str(e)]
    return ["no error", ""]


def fp32_shards(out: Path, mesh, group) -> dict:
    """fp32 shards computed in bf16 by FSDP2's MixedPrecisionPolicy, param_dtype=torch.float32: halfprec's step is
    the torch optimizer's own on the DTensor params, bit for bit, with the norm reduced over the mesh; its DTensor
    state goes through a DCP checkpoint and back."""
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

    def build():
        model = make_model(torch.float32, mesh, policy)
        adamw = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=DECAY)
        return model, halfprec.MixedPrecisionOptimizer(adamw, param_dtype=torch.float32)

    (ours, mp), theirs = build(), make_model(torch.float32, mesh, policy)
    opt = torch.optim.AdamW(theirs.parameters(), lr=LR, weight_decay=DECAY)
    norms = []
    for step in range(3):
        mp.backward(loss_of(ours, step, 0, torch.float32))
        loss_of(theirs, step, 0, torch.float32).backward()
        whole = fp64_norm([p.grad.full_tensor() for p in theirs.parameters()])
        mp.step()
        opt.step()
        mp.zero_grad()
        opt.zero_grad()
        norms.append((mp.grad_norm, whole.item()))
    dcp.save(mp, out / "ck32", named_parameters=ours, process_group=group)
    again_model, again = build()
    dcp.load(again, out / "ck32", named_parameters=again_model, process_group=group)
    pairs = list(zip(ours.parameters(), again_model.parameters(), strict=True))
    same_state = all(
        type(again.state[b][k]) is type(v) and torch.equal(local(again.state[b][k]), local(v))
        for a, b in pairs
        for k, v in mp.state[a].items()
    )
    return {
        "equal": all(
            torch.equal(local(a), local(b))
            for a, b in zip(ours.parameters(), theirs.parameters(), strict=True)
        ),
        "norms": norms,
        "reloaded": same_state and all(torch.equal(local(a), local(b)) for a, b in pairs),
    }


def refusals(mesh) -> dict:
    """Errors that need several ranks: a no-sync micro-batch under fp32 accumulation, and two meshes."""
    model = make_model(torch.bfloat16, mesh)
    mp = halfprec.MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters()), grad_accum_dtype="fp32")
    for k in range(3):
        model.set_requires_gradient_sync(k == 2)
        mp.backward(loss_of(model, 0, k, torch.bfloat16))
    out = {"no_sync": error_of(mp.step)}
    alone = DeviceMesh.from_group(SINGLES[dist.get_rank()], "cpu")
    other = make_model(torch.bfloat16, alone)
    params = [*model.parameters(), *other.parameters()]
    out["two_meshes"] = error_of(lambda: halfprec.MixedPrecisionOptimizer(torch.optim.AdamW(params)))
    columns = torch.nn.Parameter(distribute_tensor(torch.randn(4, 6), mesh, [Shard(1)]).bfloat16())
    out["shard_1"] = error_of(lambda: halfprec.MixedPrecisionOptimizer(torch.optim.AdamW([columns])))
    return out


# --- the launch -------------------------------------------------------------------------------------------
SINGLES: list = []


def scenario_fsdp(out: str, pairs: list, hsdp: list) -> dict:
    out = Path(out)
    rank = dist.get_rank()
    # every group is made by every rank, in one order
    pair_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    three = dist.new_group([0, 1, 2])
    SINGLES[:] = [dist.new_group([r]) for r in range(4)]
    result: dict = {"cases": {}}
    pair = pair_groups[rank // 2]
    mesh = DeviceMesh.from_group(pair, "cpu")
    for cfg in pairs[rank // 2]:
        result["cases"][cfg["name"]] = run_case(cfg, mesh)
    if rank < 2:
        result["checkpoint"] = save_checkpoint(out, mesh, pair)
    else:
        result["fp32_shards"] = fp32_shards(out, mesh, pair)
        result["refusals"] = refusals(mesh)
    hsdp_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    for cfg in hsdp:
        result["cases"][cfg["name"]] = run_case(cfg, hsdp_mesh)
    dist.barrier()  # the checkpoint is in
    group = three if rank < 3 else SINGLES[3]
    result["load"] = load_checkpoint(out, DeviceMesh.from_group(group, "cpu"), group)
    return result


if __name__ == "__main__":
    _worker.scenario_fsdp = scenario_fsdp
    _worker.main()
