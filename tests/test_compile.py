"""A ``torch.compile``d model trains under every strategy exactly as the same model run eagerly.

Oracle: the same model uncompiled, the same optimizer and options, the same batches. Inductor's CPU code for this
MLP's forward and backward gives the eager losses and grads bit for bit (``test_compiled_grads_are_the_eager_ones``
checks that first, so a codegen change that rounds differently shows up there and not as an optimizer fault).
Given the same grads every strategy is deterministic, so after the steps the 16-bit params, the fp32 masters and
every optimizer state tensor must be bit-identical: no tolerance (``test_the_comparison_sees_one_ulp`` shows the
comparison can fail). Each compiled run also checks that its output's backward is the compiled one, and that no
step after the first recompiles (``torch.compiler.set_stance("fail_on_recompile")``).

Two backends: ``"inductor"`` (torch.compile's default, generated C++ kernels) and ``"aot_eager"`` (the same
TorchDynamo capture and AOTAutograd forward/backward split, running torch's own kernels). What halfprec meets of
compile (a compiled backward feeding ``.grad`` and the grad hooks, params cast or re-pointed in place under a
compiled module, recompile guards) is in both; inductor adds its own arithmetic. Its first compile in a process
builds C++ kernels (10-15 s on 2 CPU cores with an empty inductor cache, about 2 s with a warm one), so its tests
are marked slow; the aot_eager ones cost about 2 s in all.

Strategies: exact, exact with fp32 grad accumulation (post-accumulate-grad hooks), fused (the Triton interpreter
on CPU; fp16, as the interpreter's bf16 arithmetic is wrong), split masters (fused, bf16: eager and compiled share
the interpreter's arithmetic), ZeRO-0 with ``process_group=`` (fp32 sums all-reduced), ZeRO-1 and ZeRO-2 on a
one-rank gloo world, the exact and fused strategies over FSDP2's shards (``fully_shard`` per block, then the root,
on a one-rank mesh, before the compile), and the engine, unsharded and at ``zero_stage=3``.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable

import pytest
import torch

import halfprec
from halfprec.optim import FusedAdamW
from halfprec.optim.mesh import is_dtensor, local
from halfprec.optim.names import clean_name

from .optim.helpers import world_of_one
from .tolerances import tol

STEPS = 3  # optimizer steps per run
MICRO = 2  # micro-batches per step: grads accumulate across two backwards of the compiled graph
HP = dict(lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1)

# name: (param dtype, MixedPrecisionOptimizer options)
STRATEGIES = {
    "exact": (torch.bfloat16, dict(impl="torch")),
    "exact_fp32_accum": (torch.bfloat16, dict(impl="torch", grad_accum_dtype="fp32")),
    "fused": (torch.float16, dict(impl="triton")),
    "stage1": (torch.bfloat16, dict(impl="torch", stage=1)),
    "stage2": (torch.bfloat16, dict(impl="torch", stage=2)),
    "split": (torch.bfloat16, dict(impl="triton", masters="split")),
    "zero0_group": (torch.bfloat16, dict(impl="torch", grad_accum_dtype="fp32")),  # and process_group=WORLD
    "fsdp_exact": (torch.bfloat16, dict(impl="torch")),
    "fsdp_fused": (torch.float16, dict(impl="triton")),
}
IN_A_WORLD = {"stage1", "stage2", "zero0_group", "fsdp_exact", "fsdp_fused"}  # a one-rank gloo world
ON_MESH = {"fsdp_exact", "fsdp_fused"}  # the model sharded by fully_shard on a one-rank mesh
BACKENDS = ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)]
INTERPRETED = pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="the Triton interpreter on CPU params; the CUDA variant is test_fused_on_cuda_takes_compiled_grads",
)
GLOO = pytest.mark.skipif(torch.cuda.is_available(), reason="FSDP2 on a gloo mesh: CPU params")
MARKS = {"fused": INTERPRETED, "split": INTERPRETED, "fsdp_exact": GLOO, "fsdp_fused": INTERPRETED}


def _model(dtype: torch.dtype = torch.float32, device: str = "cpu") -> torch.nn.Sequential:
    """Odd sizes (13 -> 37 -> 5), GELU between: no dimension a multiple of a vector width."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(13, 37), torch.nn.GELU(), torch.nn.Linear(37, 5))
    return model.to(device=device, dtype=dtype)


def _batches(dtype: torch.dtype, device: str = "cpu") -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """``STEPS`` steps of ``MICRO`` (input in the model's dtype, fp32 target) pairs, the same for every run."""
    g = torch.Generator().manual_seed(1)
    return [
        [
            (torch.randn(8, 13, generator=g).to(device, dtype), torch.randn(8, 5, generator=g).to(device))
            for _ in range(MICRO)
        ]
        for _ in range(STEPS)
    ]


class _Block(torch.nn.Module):
    """A Linear and the activation after it, with its forward written here. Compiling a model that FSDP2 shards
    breaks the graph at FSDP2's hooks (TorchDynamo runs them eagerly) and compiles each block's forward on its
    own; with ``torch.nn.Linear`` blocks nothing was compiled (torch 2.13, CPU: the output's grad_fn was
    AddmmBackward0), with these the output's is CompiledFunctionBackward, as ``_loss`` checks."""

    def __init__(self, inputs: int, outputs: int, activation: torch.nn.Module) -> None:
        super().__init__()
        self.linear, self.activation = torch.nn.Linear(inputs, outputs), activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.activation(self.linear(x))


def _blocks(dtype: torch.dtype = torch.float32) -> torch.nn.Sequential:
    """``_model``'s MLP, the same weights, as two ``_Block``s: the model FSDP2 shards here."""
    torch.manual_seed(0)
    return torch.nn.Sequential(_Block(13, 37, torch.nn.GELU()), _Block(37, 5, torch.nn.Identity())).to(dtype)


def _sharded(dtype: torch.dtype, backend: str | None) -> tuple[torch.nn.Module, torch.nn.Module]:
    """``_blocks`` sharded by FSDP2 on a one-rank mesh of the world the fixture started (each block, then the
    root, as torchtitan does), then compiled: (model, forward)."""
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415
    from torch.distributed.fsdp import fully_shard  # noqa: PLC0415

    model = _blocks(dtype)
    mesh = init_device_mesh("cpu", (1,))
    for block in (*model, model):
        fully_shard(block, mesh=mesh)
    return model, _compile(model, backend)


def _compile(model: torch.nn.Module, backend: str | None) -> torch.nn.Module:
    """``torch.compile(model, backend=backend)``, sharing ``model``'s params; ``None``: ``model`` itself."""
    return model if backend is None else torch.compile(model, backend=backend)


def _loss(forward: Callable, x: torch.Tensor, y: torch.Tensor, compiled: bool) -> torch.Tensor:
    out = forward(x)
    if compiled:  # the compiled graph ran, with its AOT-compiled backward (not a silent eager fallback)
        assert out.grad_fn.name() == "CompiledFunctionBackward", out.grad_fn.name()
    return torch.nn.functional.mse_loss(out.float(), y)  # the loss in fp32


def _no_recompile(compiled: bool, step: int):
    """Steps after the first must reuse the first step's graphs: a recompile raises."""
    if compiled and step > 0:
        return torch.compiler.set_stance("fail_on_recompile")
    return contextlib.nullcontext()


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as integers: ``torch.equal`` on them tells -0.0 from 0.0 and compares NaN payloads."""
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.detach().cpu().contiguous().view(ints[t.element_size()])


def _snapshot(model: torch.nn.Module, mp: halfprec.MixedPrecisionOptimizer) -> dict[str, list[torch.Tensor]]:
    """The 16-bit params, the fp32 masters and every tensor of the optimizer state, in a fixed order; of DTensors
    (FSDP2) their local shards, plain tensors that compare without the process group."""
    state = mp.state_dict()["optimizer"]["state"]
    return {
        "params": [local(p).detach().clone() for p in model.parameters()],
        "masters": [local(m).detach().clone() for m in mp.master_params()],
        "state": [
            local(state[k][name]).clone()
            for k in sorted(state)
            for name in sorted(state[k])
            if torch.is_tensor(state[k][name])
        ],
    }


def _assert_same(got: dict[str, list[torch.Tensor]], want: dict[str, list[torch.Tensor]]) -> None:
    """Bit-identical, tensor by tensor; every category non-empty (a comparison of nothing passes nothing)."""
    assert got.keys() == want.keys()
    for kind in want:
        assert len(got[kind]) == len(want[kind]) > 0, (kind, len(got[kind]), len(want[kind]))
        for i, (a, b) in enumerate(zip(got[kind], want[kind], strict=True)):
            assert a.dtype == b.dtype and a.shape == b.shape, (kind, i, a.dtype, b.dtype, a.shape, b.shape)
            assert torch.equal(_bits(a), _bits(b)), (
                f"{kind}[{i}]: max |diff| {(a.double() - b.double()).abs().max()}"
            )


def _assert_precisions(
    model: torch.nn.Module, mp: halfprec.MixedPrecisionOptimizer, dtype: torch.dtype
) -> None:
    assert all(p.dtype == dtype for p in model.parameters())
    assert mp.master_params() and all(m.dtype == torch.float32 for m in mp.master_params())


def _train(name: str, backend: str | None) -> tuple[list[float], dict[str, list[torch.Tensor]]]:
    """One run of ``STEPS`` steps of strategy ``name`` (``backend`` None: eager): (the micro-batch losses, the
    final snapshot)."""
    dtype, options = STRATEGIES[name]
    if name in ON_MESH:
        model, forward = _sharded(dtype, backend)
    else:
        model = _model(dtype)
        forward = _compile(model, backend)
    compiled = backend is not None
    if "stage" in options:
        options = dict(options, named_parameters=forward)
    if name == "zero0_group":
        options = dict(options, process_group=torch.distributed.group.WORLD)
    # fp16: a power-of-two static scale, exact, and small enough that no step overflows
    scaler = halfprec.StaticLossScaler(2.0**8) if dtype == torch.float16 else None
    mp = halfprec.MixedPrecisionOptimizer(
        torch.optim.AdamW(forward.parameters(), **HP), loss_scaler=scaler, max_grad_norm=1.0, **options
    )
    losses = []
    for step, micro in enumerate(_batches(dtype)):
        with _no_recompile(compiled, step):
            for x, y in micro:
                loss = _loss(forward, x, y, compiled)
                mp.backward(loss)
                losses.append(loss.item())
            mp.step()
            mp.zero_grad()
        assert not mp.step_was_skipped
    _assert_precisions(model, mp, dtype)
    return losses, _snapshot(model, mp)


@pytest.fixture(autouse=True)
def _fresh_compile_caches():
    """TorchDynamo caches compiled code per Python frame, at most ``recompile_limit`` (8) entries each, then runs
    the frame eagerly. Frames are shared by this file's tests (torch.compile's module wrapper, ``_Block.forward``)
    and each test compiles its own models (dtypes, FSDP2's classes, backends), so the caches are emptied before
    each test: one test's compiles never push another's into eager mode. Recompiles within a test are what the
    tests pin (``_no_recompile``)."""
    torch._dynamo.reset()
    yield


@pytest.fixture
def world(request, tmp_path):
    """A one-rank gloo world for the strategies that need a process group; nothing for the others."""
    if request.node.callspec.params["name"] in IN_A_WORLD:
        with world_of_one(tmp_path / "store"):
            yield
    else:
        yield


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_compiled_grads_are_the_eager_ones(dtype, backend):
    """The precondition of the bit-exact oracle: with the same weights and batches, the compiled forward and
    backward give the eager losses and 16-bit grads bit for bit (summed over two micro-batches, as the strategy
    tests accumulate them)."""
    eager, compiled_model = _model(dtype), _model(dtype)
    compiled = _compile(compiled_model, backend)
    for step, micro in enumerate(_batches(dtype)):
        with _no_recompile(True, step):
            for x, y in micro:
                a, b = _loss(eager, x, y, False), _loss(compiled, x, y, True)
                a.backward()
                b.backward()
                assert torch.equal(_bits(a), _bits(b)), (step, a.item(), b.item())
        for p, q in zip(eager.parameters(), compiled_model.parameters(), strict=True):
            assert q.grad.dtype == dtype and torch.equal(_bits(p.grad), _bits(q.grad)), step
            p.grad = q.grad = None


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=MARKS[n]) if n in MARKS else n for n in STRATEGIES],
)
def test_compiled_model_trains_like_the_eager_one(name, backend, world):
    """Every strategy over the compiled model ends at the eager run's params, masters and optimizer state, bit for
    bit, after the same micro-batch losses; the masters stay fp32 and the params 16-bit."""
    eager_losses, eager = _train(name, None)
    compiled_losses, compiled = _train(name, backend)
    assert compiled_losses == eager_losses
    _assert_same(compiled, eager)


@pytest.mark.parametrize("zero_stage", [0, pytest.param(3, marks=GLOO)])
@pytest.mark.parametrize("backend", BACKENDS)
def test_engine_over_a_compiled_model_trains_like_the_eager_one(backend, zero_stage, tmp_path):
    """``halfprec.initialize`` given a compiled fp32 model casts its params to bf16 in place (the compiled module
    shares them) and trains it as it trains the eager model: bf16 with two micro-batches sums grads in fp32 through
    post-accumulate-grad hooks; an LR schedule steps after every step. At ``zero_stage=3`` (a one-rank gloo world)
    the engine shards the model itself with FSDP2, compiled or not (``_blocks``: see ``_Block``)."""

    def run(compiled: bool):
        model = _blocks() if zero_stage == 3 else _model()
        wrapped = _compile(model, backend if compiled else None)
        opt = torch.optim.AdamW(wrapped.parameters(), **HP)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.5 * s))
        engine = halfprec.initialize(
            wrapped, opt, precision="bf16", gradient_accumulation_steps=MICRO, max_grad_norm=1.0,
            lr_scheduler=sched, zero_stage=zero_stage,
        )  # fmt: skip
        assert engine.config.grad_accum() == "fp32"
        assert all(is_dtensor(p) for p in model.parameters()) == (zero_stage == 3)
        losses = []
        for step, micro in enumerate(_batches(torch.float32)):  # fp32 batches: the engine casts them
            with _no_recompile(compiled, step):
                for x, y in micro:
                    loss = _loss(engine, x, y, compiled)
                    engine.backward(loss)
                    losses.append(loss.item())
                    engine.step()
        assert engine.global_step == STEPS and engine.skipped_steps == 0
        _assert_precisions(model, engine.optimizer, torch.bfloat16)
        return losses, _snapshot(model, engine.optimizer)

    with world_of_one(tmp_path / "store") if zero_stage == 3 else contextlib.nullcontext():
        eager_losses, eager = run(compiled=False)
        compiled_losses, compiled = run(compiled=True)
    assert compiled_losses == eager_losses
    _assert_same(compiled, eager)


def test_zero_stage_3_shards_a_compiled_model_into_the_same_units(tmp_path):
    """The default policy's units (each block, then the root) are found through torch.compile's wrapper, not taken
    as the wrapper's one child (which would gather the whole model at once)."""
    from torch.distributed.fsdp import FSDPModule

    units = []
    with world_of_one(tmp_path / "store"):
        for compiled in (False, True):
            model = _compile(_model(), "aot_eager") if compiled else _model()
            engine = halfprec.initialize(
                model, torch.optim.AdamW(model.parameters()), precision="bf16", zero_stage=3
            )
            units.append(
                [clean_name(n) for n, m in engine.module.named_modules() if isinstance(m, FSDPModule) and n]
            )
    assert units[0] == units[1] and len(units[0]) > 1, units


@pytest.mark.parametrize("kind", ["params", "masters", "state"])
def test_the_comparison_sees_one_ulp(kind):
    """A planted wrong update, one element one ulp off in one tensor of each kind, fails the comparison the
    strategy tests use (eager runs only: the comparison is what is tested)."""
    _, want = _train("exact", None)
    _, got = _train("exact", None)
    _assert_same(got, want)
    planted = got[kind][-1].view(-1)
    planted[0] = torch.nextafter(planted[0], torch.tensor(float("inf"), dtype=planted.dtype))
    with pytest.raises(AssertionError, match=kind):
        _assert_same(got, want)


@pytest.mark.gpu
def test_fused_on_cuda_takes_compiled_grads():
    """On CUDA, inductor's Triton kernels may round the grads differently from eager, so the oracle takes the
    compiled model's own grads: an eager twin on the exact strategy is given them at every step. The fused
    strategy over the compiled bf16 model must then end within the fused-vs-exact tolerances (tests/tolerances.py)
    of the twin, its bf16 params the rounded masters, with no recompile after the first step."""
    model, twin = _model(torch.bfloat16, "cuda"), _model(torch.bfloat16, "cuda")
    compiled = torch.compile(model)
    fused = halfprec.MixedPrecisionOptimizer(
        torch.optim.AdamW(model.parameters(), **HP), max_grad_norm=1.0, impl="triton"
    )
    exact = halfprec.MixedPrecisionOptimizer(
        torch.optim.AdamW(twin.parameters(), **HP), max_grad_norm=1.0, impl="torch"
    )
    assert isinstance(fused, FusedAdamW)
    for step, micro in enumerate(_batches(torch.bfloat16, "cuda")):
        with _no_recompile(True, step):
            for x, y in micro:
                fused.backward(_loss(compiled, x, y, True))
            for p, q in zip(model.parameters(), twin.parameters(), strict=True):
                q.grad = p.grad.clone()
            fused.step()
            exact.step()
            fused.zero_grad()
            exact.zero_grad()
    _assert_precisions(model, fused, torch.bfloat16)
    for m, r in zip(fused.master_params(), exact.master_params(), strict=True):
        torch.testing.assert_close(m, r, **tol("fused_master", torch.bfloat16))
    for p, m in zip(model.parameters(), fused.master_params(), strict=True):
        assert torch.equal(_bits(p), _bits(m.to(torch.bfloat16)))
    got, want = fused.state_dict()["optimizer"]["state"], exact.state_dict()["optimizer"]["state"]
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].keys() == want[k].keys(), k
        for name, value in want[k].items():
            if name == "step":  # a device tensor on the fused path, a host one in torch's AdamW
                assert float(got[k][name]) == float(value) == STEPS, (k, float(got[k][name]), float(value))
            else:
                torch.testing.assert_close(got[k][name], value, **tol("fused_state", torch.bfloat16))


# --- checkpoints: keyed by the model's own names, compiled or not ----------------------------------------------
# A compiled model's names start with ``_orig_mod.`` (a compiled submodule's hold it in the middle); checkpoints and
# state dicts are keyed by the names without it (halfprec/optim/names.py), so one written from the model compiled
# loads into it uncompiled and back. "before": written as halfprec wrote them before, ``_orig_mod.`` names and all,
# which still load into either form. Forms: None (eager), "whole" (torch.compile(model)), "nested" (the last
# layer compiled: ``2._orig_mod.weight``); every compile is aot_eager, whose grads are the eager ones (above).
ACROSS = [("whole", None), (None, "whole"), ("nested", None), ("whole", "nested")]
WRITERS = ["current", "before"]
CLEAN = ["0.bias", "0.weight", "2.bias", "2.weight"]


def _form(model: torch.nn.Module, form: str | None) -> torch.nn.Module:
    """What the user trains: the model itself, compiled whole, or with its last layer compiled."""
    if form == "nested":
        model[2] = torch.compile(model[2], backend="aot_eager")
        return model
    return _compile(model, "aot_eager" if form == "whole" else None)


@contextlib.contextmanager
def _writing(writer: str):
    """``"before"``: halfprec's writers as they were before names were cleaned (every module's ``clean_name`` the
    identity; a compiled model's optimizer must be built inside, as it takes its names then). Their files hold the
    keys the code of then wrote (checked against files written by it: ``_orig_mod.0.weight`` in model.safetensors,
    engine.pt's param_names, ``master/_orig_mod.0.weight`` items, a sharded state dict's layout names)."""
    if writer == "current":
        yield
        return
    import halfprec.checkpoint.dcp  # noqa: F401, PLC0415 - the engine imports it lazily, the patch must see it
    from halfprec.optim import names  # noqa: PLC0415

    real = names.clean_name
    with pytest.MonkeyPatch.context() as patch:
        for module in [m for n, m in sys.modules.items() if n.startswith("halfprec")]:
            if getattr(module, "clean_name", None) is real:
                patch.setattr(module, "clean_name", lambda name: name)
        yield


def _keys_written(writer: str, form: str | None, keys) -> None:
    """The premise of a round trip: ``keys`` (names as a file holds them) hold ``_orig_mod`` exactly when written
    the old way from a compiled model."""
    prefixed = any("_orig_mod" in k for k in keys)
    assert prefixed == (writer == "before" and form is not None), sorted(keys)


def _engine_run(engine, batches, compiled: bool) -> list[float]:
    losses = []
    for micro in batches:
        for x, y in micro:
            loss = _loss(engine, x, y, compiled)
            engine.backward(loss)
            losses.append(loss.item())
            engine.step()
    return losses


@pytest.mark.parametrize("writer", [*WRITERS, "legacy"])
@pytest.mark.parametrize("saved, loaded", ACROSS)
def test_engine_checkpoint_of_a_compiled_model_loads_uncompiled_and_back(saved, loaded, writer, tmp_path):
    """An engine checkpoint (the current format, the old names, or the format before DCP: optimizer.pt) written
    from one form loads into the other: params, masters and optimizer state bit for bit, and the next step
    equal."""
    from safetensors.torch import load_file  # noqa: PLC0415

    from halfprec.checkpoint.consolidate import read_checkpoint  # noqa: PLC0415

    from .engine_util import legacy_checkpoint  # noqa: PLC0415

    batches = _batches(torch.float32)

    def build(form):
        model = _model()
        forward = _form(model, form)
        opt = torch.optim.AdamW(forward.parameters(), **HP)
        engine = halfprec.initialize(
            forward, opt, precision="bf16", gradient_accumulation_steps=MICRO, max_grad_norm=1.0
        )
        return model, engine

    with _writing(writer):
        model_a, a = build(saved)
    _engine_run(a, batches[:2], saved is not None)
    with _writing(writer):
        path = legacy_checkpoint(a, tmp_path) if writer == "legacy" else a.save_checkpoint(tmp_path)
    old = (
        "before" if writer == "legacy" else writer
    )  # the legacy writer (tests) keys by the names as they are
    _keys_written(old, saved, load_file(str(path / "model.safetensors")))
    _keys_written(old, saved, torch.load(path / "engine.pt")["param_names"])
    if writer != "legacy":
        _keys_written(writer, saved, read_checkpoint(path / "optimizer"))
    model_b, b = build(loaded)
    b.load_checkpoint(tmp_path)
    assert (b.global_step, b.micro_step) == (a.global_step, a.micro_step) == (2, 4)
    _assert_same(_snapshot(model_b, b.optimizer), _snapshot(model_a, a.optimizer))
    losses_a = _engine_run(a, batches[2:], saved is not None)
    losses_b = _engine_run(b, batches[2:], loaded is not None)
    assert losses_b == losses_a
    _assert_same(_snapshot(model_b, b.optimizer), _snapshot(model_a, a.optimizer))


def _optimizer(form: str | None, stage: int):
    """``(model, forward, optimizer)``: stage 0 the exact strategy, 1 ZeRO-1 (in a world of one)."""
    model = _model(torch.bfloat16)
    forward = _form(model, form)
    options = dict(stage=stage, named_parameters=forward) if stage else {}
    mp = halfprec.MixedPrecisionOptimizer(
        torch.optim.AdamW(forward.parameters(), **HP), max_grad_norm=1.0, impl="torch", **options
    )
    return model, forward, mp


def _optimizer_run(forward, mp, batches, compiled: bool) -> list[float]:
    losses = []
    for micro in batches:
        for x, y in micro:
            loss = _loss(forward, x, y, compiled)
            mp.backward(loss)
            losses.append(loss.item())
        mp.step()
        mp.zero_grad()
    return losses


def _round_trip(save, load, saved, loaded, writer, stage) -> None:
    """Train one form two steps, ``save(optimizer, forward)`` (under ``writer``) and ``load(optimizer, forward,
    saved)`` into the other form's optimizer: the same params, masters and state, and the next step equal."""
    batches = _batches(torch.bfloat16)
    with _writing(writer):
        model_a, forward_a, a = _optimizer(saved, stage)
    _optimizer_run(forward_a, a, batches[:2], saved is not None)
    with _writing(writer):
        written = save(a, forward_a)
    model_b, forward_b, b = _optimizer(loaded, stage)
    load(b, forward_b, written)
    _assert_same(_snapshot(model_b, b), _snapshot(model_a, a))
    losses_a = _optimizer_run(forward_a, a, batches[2:], saved is not None)
    losses_b = _optimizer_run(forward_b, b, batches[2:], loaded is not None)
    assert losses_b == losses_a
    _assert_same(_snapshot(model_b, b), _snapshot(model_a, a))


@pytest.mark.parametrize("writer", WRITERS)
@pytest.mark.parametrize("saved, loaded", ACROSS)
def test_sharded_state_dict_of_a_compiled_model_loads_uncompiled_and_back(saved, loaded, writer, tmp_path):
    """ZeRO-1's rank-local state dict names its params in its layout: the model's own names."""

    def save(mp, forward):
        state = mp.state_dict()
        _keys_written(writer, saved, state["layout"]["names"])
        if writer == "current":
            assert sorted(state["layout"]["names"]) == CLEAN
        return state

    def load(mp, forward, state):
        mp.load_state_dict(state)

    with world_of_one(tmp_path / "store"):
        _round_trip(save, load, saved, loaded, writer, stage=1)


@pytest.mark.parametrize("stage", [0, 1])
@pytest.mark.parametrize("writer", WRITERS)
@pytest.mark.parametrize("saved, loaded", ACROSS)
def test_dcp_checkpoint_of_a_compiled_model_loads_uncompiled_and_back(saved, loaded, writer, stage, tmp_path):
    """``halfprec.distributed.checkpoint`` keys its items by the model's own names (``master/0.weight``), for the
    exact strategy and ZeRO-1 alike; consolidate gives them too, whatever wrote the checkpoint."""
    from halfprec.distributed import checkpoint, consolidate, read_checkpoint  # noqa: PLC0415

    def save(mp, forward):
        path = checkpoint.save(mp, tmp_path / "ckpt", named_parameters=forward)
        _keys_written(writer, saved, read_checkpoint(path))
        return path

    def load(mp, forward, path):
        assert sorted(consolidate(path)) == CLEAN
        checkpoint.load(mp, path, named_parameters=forward)

    with world_of_one(tmp_path / "store") if stage else contextlib.nullcontext():
        _round_trip(save, load, saved, loaded, writer, stage)


def test_sharded_state_dict_of_another_model_names_its_params(tmp_path):
    """A rank-local state dict of a model with other names (the same sizes) is refused, naming both lists."""
    with world_of_one(tmp_path / "store"):
        _, _, a = _optimizer(None, 1)
        other = torch.nn.Sequential(_model(torch.bfloat16)[0], torch.nn.GELU(), torch.nn.Identity())
        other.append(_model(torch.bfloat16)[2])
        b = halfprec.MixedPrecisionOptimizer(
            torch.optim.AdamW(other.parameters(), **HP), stage=1, named_parameters=other, impl="torch"
        )
        with pytest.raises(ValueError, match=r"layout: names \['2\.bias', .*\(here \['3\.bias'"):
            b.load_state_dict(a.state_dict())


@pytest.mark.parametrize("writer", [*WRITERS, "legacy"])
@pytest.mark.parametrize("form", ["whole", "nested"])
def test_export_writes_the_models_own_names(form, writer, tmp_path):
    """``halfprec export`` of a checkpoint of the compiled model (tied weights, a LayerNorm) writes the names of
    the model uncompiled, which it strict-loads: the fp32 masters under them, whatever wrote the checkpoint."""
    from safetensors.torch import load_file  # noqa: PLC0415

    from halfprec.cli.main import main  # noqa: PLC0415

    from .engine_util import TiedLM, legacy_checkpoint, train  # noqa: PLC0415

    torch.manual_seed(0)
    model = TiedLM()
    if form == "nested":
        model.mix = torch.compile(model.mix, backend="aot_eager")
    forward = model if form == "nested" else torch.compile(model, backend="aot_eager")
    with _writing(writer):
        engine = halfprec.initialize(forward, torch.optim.AdamW(forward.parameters(), **HP), precision="bf16")
    train(engine, 2)
    with _writing(writer):
        path = legacy_checkpoint(engine, tmp_path) if writer == "legacy" else engine.save_checkpoint(tmp_path)
    old = "before" if writer == "legacy" else writer
    _keys_written(old, form, load_file(str(path / "model.safetensors")))
    out = tmp_path / "model.safetensors"
    assert main(["export", str(path), "--out", str(out)]) == 0
    weights = load_file(str(out))
    plain = TiedLM()
    assert list(weights) == sorted(plain.state_dict())
    plain.load_state_dict(weights, strict=True)
    names = ["emb.weight", "mix.weight", "mix.bias", "norm.weight", "norm.bias"]
    for name, master in zip(names, engine.optimizer.master_params(), strict=True):
        assert weights[name].dtype == torch.float32 and torch.equal(weights[name], master), name
    assert torch.equal(weights["head.weight"], weights["emb.weight"])
