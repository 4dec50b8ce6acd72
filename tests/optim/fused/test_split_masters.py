"""``masters="split"`` on the fused optimizers: exact fp32 masters of bf16 params held as the param plus its low
16 bits (``optim/split.py``). The oracle is the fp32-master fused optimizer fed the same grads: masters and state
bit-identical, params equal except where a tie (low half 0x8000 exactly, even top half) rounded away instead of
to even. In the interpreter both runs share its bf16 arithmetic, so the oracle holds there too; the GPU runs are
the compiled kernels' (``pytest.mark.gpu``)."""

from __future__ import annotations

import copy
import gc

import pytest
import torch

import halfprec
from halfprec.optim import FusedAdagrad, FusedAdam, FusedAdamW, FusedLamb, FusedSGD
from halfprec.optim.chunk import Chunk
from halfprec.optim.layout import aligned
from halfprec.optim.split import split_master
from tests.engine_util import build, train

from ..helpers import DEVICE

ALGORITHMS = [
    (FusedAdamW, dict(lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1)),
    (FusedAdam, dict(lr=1e-2, weight_decay=0.05)),  # L2 decay
    (FusedSGD, dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)),
    (FusedAdagrad, dict(lr=0.05, lr_decay=0.01, weight_decay=0.01)),
    (FusedLamb, dict(lr=1e-2, weight_decay=0.05)),
]
_IDS = [cls.__name__ for cls, _ in ALGORITHMS]


def _sources(sizes, seed=0, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n if isinstance(n, tuple) else (n,), generator=g).to(device) for n in sizes]


def _patterns(device=DEVICE) -> torch.Tensor:
    """fp32 masters around every rounding point: a sample of top halves over every exponent (signed zeros,
    subnormals, the largest finite values), each with the low halves 0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF; no
    inf or NaN (SGD's ``g + wd * p`` is NaN there even with ``wd = 0``)."""
    tops = torch.cat([torch.arange(0, 0x8000, 7), torch.tensor([0x7F7F, 0x7F7E, 0x0001, 0x0080])])
    tops = torch.cat([tops, tops | 0x8000]).to(torch.int64)
    tops = tops[(tops & 0x7F80) != 0x7F80]  # finite: the exponent is not all ones
    lows = torch.tensor([0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=torch.int64)
    bits = ((tops[:, None] << 16) | lows[None, :]).flatten()
    return (bits - ((bits >> 31) << 32)).to(torch.int32).view(torch.float32).to(device)


def _pair(cls, hp, sources, *, groups=None, **options):
    """(split optimizer, fp32-master optimizer, their params), from the same fp32 sources cast to bf16."""
    runs = []
    for masters in ("split", "fp32"):
        params = [torch.nn.Parameter(s.clone()) for s in sources]
        held = [{"params": [params[i] for i in idx], **kw} for idx, kw in groups] if groups else params
        runs.append((cls(held, **hp, param_dtype=torch.bfloat16, masters=masters, **options), params))
    (split, a), (ref, b) = runs
    return split, ref, a, b


def _step_both(split, ref, a, b, steps, *, seed=0):
    for s in range(steps):
        g = torch.Generator().manual_seed(seed + s)
        for i, (p, q) in enumerate(zip(a, b, strict=True)):
            if s % 3 == 1 and i == 1:  # param 1 gets no grad every third step: it keeps its master exactly
                p.grad = q.grad = None
                continue
            p.grad = torch.randn(p.shape, generator=g).to(device=p.device, dtype=p.dtype)
            q.grad = p.grad.clone()
        split.step()
        ref.step()
        split.zero_grad()
        ref.zero_grad()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().view(torch.int32 if t.dtype == torch.float32 else torch.int16)


def _ties(master: torch.Tensor) -> torch.Tensor:
    """Where rounding ``master`` to bf16 ties away and to even differ: low half 0x8000, even top half."""
    bits = _bits(master)
    return ((bits & 0xFFFF) == 0x8000) & ((bits >> 16) & 1 == 0)


def _rounded(opt, master: torch.Tensor) -> torch.Tensor:
    """The bf16 param ``opt``'s master storage keeps beside ``master``: ties away (split) or to even."""
    if getattr(opt, "masters", "fp32") == "split":
        return split_master(master.detach().float())[0]
    return master.detach().to(torch.bfloat16)


def assert_split_matches(split, ref) -> int:
    """Masters and state bit-identical, each param its master rounded as its storage rounds (so the two differ
    exactly at the ties when one is split and the other not); returns how many params differ."""
    differ = 0
    modes = {getattr(opt, "masters", "fp32") for opt in (split, ref)}
    masters = zip(split.master_params(), ref.master_params(), strict=True)
    for (m, r), p, q in zip(masters, split.model_params(), ref.model_params(), strict=True):
        assert torch.equal(_bits(m), _bits(r)), p.shape
        if p.dtype == torch.bfloat16:
            assert torch.equal(_bits(p), _bits(_rounded(split, r)).view(p.shape)), p.shape
            assert torch.equal(_bits(q), _bits(_rounded(ref, r)).view(p.shape)), p.shape
            where = _bits(p) != _bits(q)
            ties = _ties(r).view(where.shape) if len(modes) == 2 else torch.zeros_like(where)
            assert torch.equal(where, ties), p.shape
            differ += int(where.sum())
        else:
            assert torch.equal(_bits(p), _bits(q))
    sa, sb = split.state_dict(), ref.state_dict()
    assert sa["optimizer"]["state"].keys() == sb["optimizer"]["state"].keys()
    for k, state in sb["optimizer"]["state"].items():
        assert state.keys() == sa["optimizer"]["state"][k].keys(), k
        for name, v in state.items():
            assert torch.equal(_bits(sa["optimizer"]["state"][k][name]), _bits(v)), (k, name)
    for k, v in sb["masters"].items():
        assert torch.equal(_bits(sa["masters"][k]), _bits(v)), k
    return differ


# --- construction, memory, errors ------------------------------------------------------------------------------
def test_construction_splits_the_fp32_sources_exactly():
    source = _patterns()
    plain = torch.randn(9).to(DEVICE, torch.bfloat16)  # no fp32 original
    params = [torch.nn.Parameter(source.clone()), torch.nn.Parameter(plain.clone())]
    opt = FusedAdamW(params, param_dtype=torch.bfloat16, masters="split")
    master, joined = opt.master_params()
    assert torch.equal(_bits(master), _bits(source))
    assert torch.equal(_bits(params[0]), _bits(split_master(source.cpu())[0]))
    assert int(_ties(source).sum()) > 0  # the patterns hold ties, where the cast to bf16 rounded to even
    rne = source.to(torch.bfloat16)
    assert torch.equal(_bits(params[0]) != _bits(rne), _ties(source))
    # a bf16 param without an fp32 original is its own master exactly (low half 0)
    assert torch.equal(_bits(joined), _bits(plain.float()))
    assert torch.equal(_bits(params[1]), _bits(plain))


def _bytes(chunk: Chunk) -> int:
    held = [chunk.param, chunk.data, chunk.low, chunk.grad, *chunk.state.values()]
    return sum(t.numel() * t.element_size() for t in held if t is not None)


@pytest.mark.parametrize(("masters", "per_param"), [("split", 14), ("fp32", 16)])
def test_adamw_holds_14_bytes_per_param_with_split_masters(masters, per_param):
    sizes = [9, 41, 127]
    params = [torch.nn.Parameter(s) for s in _sources(sizes)]
    opt = FusedAdamW(params, param_dtype=torch.bfloat16, masters=masters)
    chunk = opt._where[0][0]
    assert (chunk.data is None) == (masters == "split")
    # construction: param and master; after a step the grad and the moments too
    assert _bytes(chunk) == (2 + (2 if masters == "split" else 4)) * chunk.numel
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    assert chunk.numel == sum(aligned(n) for n in sizes)
    assert _bytes(chunk) == per_param * chunk.numel


def test_fp32_params_stay_their_own_masters():
    bf16 = torch.nn.Parameter(torch.randn(41).to(DEVICE, torch.bfloat16))
    fp32 = torch.nn.Parameter(torch.randn(9).to(DEVICE))
    opt = FusedSGD([bf16, fp32], lr=0.1, masters="split")
    chunks = {chunk.dtype: chunk for chunk, _ in opt._where}
    assert chunks[torch.float32].low is None and chunks[torch.float32].data is not None
    assert chunks[torch.bfloat16].data is None and chunks[torch.bfloat16].low is not None
    assert opt.master_params()[1].data_ptr() == fp32.data_ptr()


ERRORS = [
    (dict(masters="bf16"), torch.float32, r"masters must be one of \('fp32', 'split'\), got 'bf16'"),
    (dict(masters=None), torch.bfloat16, r"masters must be one of"),
    (dict(masters="split"), torch.float16, r"masters='split'.*torch.float16.*use masters='fp32'"),
    (dict(masters="split", param_dtype=torch.float16), torch.float32, r"masters='split'.*torch.float16"),
]


@pytest.mark.parametrize(("kwargs", "dtype", "match"), ERRORS)
def test_errors(kwargs, dtype, match):
    p = torch.nn.Parameter(torch.randn(9).to(DEVICE, dtype))
    with pytest.raises(ValueError, match=match):
        FusedAdamW([p], **kwargs)
    assert p.dtype == dtype  # refused before any param was cast


# --- the kernels' join/split path (PARAM 3) --------------------------------------------------------------------
@pytest.mark.parametrize("cls", [FusedSGD, FusedAdamW])
def test_a_zero_update_keeps_every_master_bit_for_bit(cls):
    # SGD with lr 0, and AdamW whose step size is 0 (lr 0): the kernel joins, updates by zero and splits back
    source = _patterns()
    params = [torch.nn.Parameter(source.clone())]
    opt = cls(params, lr=0.0, weight_decay=0.0, param_dtype=torch.bfloat16, masters="split")
    before = _bits(params[0]).clone()
    for _ in range(2):
        params[0].grad = torch.zeros_like(params[0])
        opt.step()
        assert not opt.step_was_skipped
    assert torch.equal(_bits(opt.master_params()[0]), _bits(source))
    assert torch.equal(_bits(params[0]), before)


@pytest.mark.parametrize(("cls", "hp"), ALGORITHMS, ids=_IDS)
def test_interpreted_steps_match_the_fp32_master_optimizer(cls, hp):
    # the patterns' group has lr 0: updated through the kernel's join and split, its ties persist to be counted
    groups = [([0, 1, 2, 3], {}), ([4], {"lr": 0.0})]
    split, ref, a, b = _pair(cls, hp, _sources([9, 41, 127, (7, 13)]) + [_patterns()[:1000]], groups=groups)
    _step_both(split, ref, a, b, 4)
    assert assert_split_matches(split, ref) > 0


@pytest.mark.parametrize(("cls", "hp"), ALGORITHMS, ids=_IDS)
def test_fp32_grad_accumulation_composes_with_split_masters(cls, hp):
    # 4 micro-batches of bf16 grads, summed in fp32 by both (backward's hook: mark_grads); the step reads the sums
    split, ref, a, b = _pair(cls, hp, _sources([9, 41, 127, (7, 13)]), grad_accum_dtype="fp32")
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        for _ in range(4):
            for p, q in zip(a, b, strict=True):
                p.grad = torch.randn(p.shape, generator=g).to(device=p.device, dtype=p.dtype)
                q.grad = p.grad.clone()
            split.mark_grads()
            ref.mark_grads()
            assert all(p.grad is None for p in a + b)  # added into the fp32 buffers and released
        for x, y in zip(
            split.unscaled_grads(), ref.unscaled_grads(), strict=True
        ):  # the sums, read on demand
            assert x is not None and torch.equal(_bits(x), _bits(y))
        split.step()
        ref.step()
        split.zero_grad()
        ref.zero_grad()
    assert_split_matches(split, ref)


# --- everything that reads or writes masters ----------------------------------------------------------------------
def test_checkpoints_move_between_split_fp32_masters_and_the_exact_path():
    hp = dict(lr=1e-2, weight_decay=0.1)
    split, ref, a, b = _pair(FusedAdamW, hp, _sources([9, 41, 127]) + [_patterns()[:600]])
    _step_both(split, ref, a, b, 2)
    saved_split, saved_ref = copy.deepcopy(split.state_dict()), copy.deepcopy(ref.state_dict())

    # split -> fp32 masters, and fp32 masters -> split: the same masters and state bit for bit
    other_split, other_ref, c, d = _pair(FusedAdamW, hp, _sources([9, 41, 127, 600], seed=7))
    other_split.load_state_dict(copy.deepcopy(saved_ref))
    other_ref.load_state_dict(copy.deepcopy(saved_split))
    assert_split_matches(other_split, other_ref)
    assert_split_matches(other_split, ref)
    _step_both(split, ref, a, b, 2, seed=50)
    _step_both(other_split, other_ref, c, d, 2, seed=50)  # and both resume bit-exactly
    assert_split_matches(other_split, split)
    assert_split_matches(other_ref, ref)

    # split -> the exact path and back
    params = [torch.nn.Parameter(s) for s in _sources([9, 41, 127, 600], seed=3)]
    exact = halfprec.MixedPrecisionOptimizer(
        torch.optim.AdamW(params, **hp), param_dtype=torch.bfloat16, impl="torch"
    )
    exact.load_state_dict(copy.deepcopy(saved_split))
    for m, r in zip(exact.master_params(), saved_ref["masters"].values(), strict=True):
        assert torch.equal(_bits(m), _bits(r))
    back = _pair(FusedAdamW, hp, _sources([9, 41, 127, 600], seed=5))[0]
    back.load_state_dict(exact.state_dict())
    for m, r in zip(back.master_params(), saved_ref["masters"].values(), strict=True):
        assert torch.equal(_bits(m), _bits(r))


def test_master_params_are_joined_copies():
    params = [torch.nn.Parameter(_patterns()[:100].clone())]
    opt = FusedSGD(params, lr=0.1, param_dtype=torch.bfloat16, masters="split")
    copy_ = opt.master_params()[0]
    before = _bits(copy_).clone()
    copy_.add_(1.0)  # a copy: the optimizer's masters do not change
    assert torch.equal(_bits(opt.master_params()[0]), before)


def test_refresh_masters_takes_the_bf16_weights_exactly():
    params = [torch.nn.Parameter(s) for s in _sources([9, 41])]
    opt = FusedAdamW(params, param_dtype=torch.bfloat16, masters="split")
    new = [torch.randn(p.shape).to(torch.bfloat16) for p in params]
    with torch.no_grad():
        for p, w in zip(params, new, strict=True):
            p.copy_(w)  # an external weights-only load
    opt.refresh_masters()
    for m, w in zip(opt.master_params(), new, strict=True):
        assert torch.equal(_bits(m), _bits(w.float()))


# --- the engine ---------------------------------------------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test (CPU params)")
def test_engine_builds_split_masters_and_resumes_bit_exactly(tmp_path):
    engine = build("bf16", impl="triton", masters="split")
    assert isinstance(engine.optimizer, FusedAdamW) and engine.optimizer.masters == "split"
    reference = build("bf16", impl="triton")
    train(engine, 3)
    train(reference, 3)
    assert assert_split_matches(engine.optimizer, reference.optimizer) == 0  # no tie: equal weights all along
    engine.save_checkpoint(tmp_path)
    train(engine, 2)
    resumed = build("bf16", seed=9, impl="triton", masters="split")
    resumed.load_checkpoint(tmp_path)
    train(resumed, 2)
    assert_split_matches(resumed.optimizer, engine.optimizer)
    weights = engine.module.state_dict()
    for k, v in resumed.module.state_dict().items():
        assert torch.equal(v, weights[k]), k


CONFIG_ERRORS = [
    (dict(masters="fp16"), r"masters must be one of 'fp32', 'split', got 'fp16'"),
    (dict(masters="split", impl="torch"), r"masters='split' with impl='torch'.*use masters='fp32'"),
    (dict(masters="split", zero_stage=1, impl="torch"), r"masters='split' with impl='torch'"),
    (dict(masters="split", precision="fp16"), r"precision='fp16'.*the exact path and fp16"),
]


@pytest.mark.parametrize(("fields", "match"), CONFIG_ERRORS)
def test_config_errors(fields, match):
    with pytest.raises(ValueError, match=match):
        halfprec.Config(**fields)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU params: impl='auto' refuses the fused path")
def test_initialize_names_why_the_fused_path_cannot_run():
    with pytest.raises(
        ValueError,
        match=r"masters='split' runs on the fused kernels, which cannot take.*CUDA.*masters='fp32'",
    ):
        build("bf16", masters="split")


# --- the compiled kernels (H200) -----------------------------------------------------------------------------------
GPU_SIZES = [9, 41, 341, 4231, 1, 127, 4097, 2**16 + 3, (1024, 1031)]


@pytest.mark.gpu
@pytest.mark.parametrize(("cls", "hp"), ALGORITHMS, ids=_IDS)
def test_cuda_50_steps_match_the_fp32_master_optimizer(cls, hp):
    # per-group scalars; the patterns' group (lr 0) keeps its ties through the kernel's join and split
    groups = [([0, 1, 2, 3, 4], {}), ([5, 6, 7, 8], {"lr": hp["lr"] / 3}), ([9], {"lr": 0.0})]
    patterns = _patterns("cuda")
    if (
        cls is FusedLamb
    ):  # beyond these, |p|^2 overflows: trust ratio inf, NaN masters (payloads: optim/split.py)
        patterns = patterns[:1000]
    split, ref, a, b = _pair(cls, hp, _sources(GPU_SIZES, device="cuda") + [patterns], groups=groups)
    _step_both(split, ref, a, b, 50)
    ties = assert_split_matches(split, ref)
    assert ties > 0
    print(f"{cls.__name__}: {ties} ties rounded away instead of to even")


@pytest.mark.gpu
@pytest.mark.parametrize(("masters", "per_param"), [("split", 14), ("fp32", 16)])
def test_cuda_allocated_bytes_per_param_after_the_first_step(masters, per_param):
    gc.collect()  # earlier tests' garbage freed now, not during the measurement
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    params = [
        torch.nn.Parameter(torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)) for _ in range(8)
    ]
    n = sum(p.numel() for p in params)
    opt = FusedAdamW(params, lr=1e-3, masters=masters)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    opt.zero_grad(set_to_none=False)  # the grads stay views of the flat grad buffer
    torch.cuda.synchronize()
    got = (torch.cuda.memory_allocated() - base) / n
    print(f"masters={masters}: {got:.4f} allocated bytes per param")
    # model 2 + grad 2 + master (2 or 4) + moments 8; the tables and scalars are a few bytes per 1,000 params
    assert per_param <= got < per_param + 0.05
