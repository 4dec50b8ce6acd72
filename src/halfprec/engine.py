"""``halfprec.initialize(...) -> Engine``: accumulation, LR-schedule holding, counters and checkpoints; no math.

``global_step`` counts optimizer-step boundaries, skipped ones included, as DeepSpeed and Megatron do.
"""

from __future__ import annotations

import contextlib
import copy
import os
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from ._checks import is_int
from .checkpoint.directory import check_directory, check_tag, reading, save_pt, stage
from .checkpoint.directory import saving as saving_into
from .checkpoint.manifest import ENGINE_SHARDED, CheckpointError, layout_of, reraised, seal
from .checkpoint.plain import check_plain, rng_state, set_rng_state
from .checkpoint.read import load_pt, load_weights, resolve, verify
from .config import Config, check_fields
from .optim.base import MixedPrecisionOptimizer
from .optim.checks import world_size
from .optim.names import clean_keys, clean_name
from .optim.select import build
from .precision import DTYPES
from .prepare import (
    cast_rest,
    cast_shards,
    check_shards,
    float8_scale_precompute,
    fully_shard_model,
    laid_out_like,
    start_masters_from,
    whole_state,
)
from .resume import keep_scaler_settings, scaler_kind_error

__all__ = ["Engine", "StepRecord", "initialize"]


class StepRecord:
    """What happened at one optimizer-step boundary (for logging).

    ``engine.step()`` returns it without waiting for the step: the fused step's results stay on the device until
    a value of the record is first read (one host sync then), so a loop that does not read them every step keeps
    the GPU's queue full. ``step``: ``global_step`` after this boundary; ``loss_scale``: the scale this step's
    gradients were scaled with; ``grad_norm``: the global L2 norm of the unscaled gradients, before clipping
    (None when neither checked nor clipped); ``skipped``: the update was skipped (non-finite gradients).
    """

    def __init__(
        self, step: int, loss_scale: float | None = None, grad_norm: float | None = None, skipped: bool = False,
        *, results=None,
    ) -> None:  # fmt: skip
        """``results``: an optimizer's ``step_results()``, read at the first access instead of the values."""
        self.step = step
        self._results = results
        self._values = None if results is not None else (loss_scale, grad_norm, bool(skipped))

    def _read(self) -> tuple:
        if self._values is None:
            r, self._results = self._results, None
            self._values = (r.step_loss_scale, r.grad_norm, bool(r.step_was_skipped))
        return self._values

    loss_scale = property(lambda self: self._read()[0])
    grad_norm = property(lambda self: self._read()[1])
    skipped = property(lambda self: self._read()[2])

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StepRecord):
            return NotImplemented
        return (self.step, *self._read()) == (other.step, other.loss_scale, other.grad_norm, other.skipped)

    __hash__ = None

    def __repr__(self) -> str:
        return (
            f"StepRecord(step={self.step}, loss_scale={self.loss_scale}, grad_norm={self.grad_norm}, "
            f"skipped={self.skipped})"
        )


def initialize(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    config: Config | None = None,
    *,
    lr_scheduler: Any = None,
    **overrides: Any,
) -> Engine:
    """Wrap ``model`` (fp32, or already in the target dtype) and a plain torch ``optimizer`` over its params.

    ``overrides`` replace fields of ``config`` (e.g. ``precision="fp16", max_grad_norm=1.0``). An fp32 model is
    cast to the configured precision here, and the masters start from its original fp32 weights. A model sharded
    by ``fully_shard`` (FSDP2) trains at ``zero_stage=0``: fp32 shards are cast by ``model.to()`` (FSDP2 lays
    them out again), their masters starting from each rank's fp32 rows; at ``zero_stage=3`` the engine shards the
    model itself (``Config.zero_stage``'s policy).
    ``lr_scheduler`` is stepped after every step that was not skipped; on the fused path, telling which were is one
    host wait per step, for the step's norm pass (without a scheduler ``engine.step()`` does not wait for the GPU).
    """
    if config is None:
        config = Config()
    elif not isinstance(config, Config):
        raise TypeError(
            f"config must be a halfprec.config.Config, got {type(config).__name__}; build one with Config(...) "
            "or Config.from_deepspeed(...), or pass the fields as keyword arguments"
        )
    if overrides:
        check_fields(overrides, "config override")
        config = config.replace(**overrides)
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    _check_inputs(model, optimizer, lr_scheduler)
    dtype = DTYPES[config.precision]
    trained = {p for g in optimizer.param_groups for p in g["params"] if p.requires_grad}
    for name, p in model.named_parameters():
        if p in trained and p.is_floating_point() and p.dtype not in (torch.float32, dtype):
            raise ValueError(
                f"param {name!r} is {p.dtype} but precision={config.precision!r}; pass the model in fp32 (halfprec "
                f"casts it) or set precision to match"
            )
    accum = config.grad_accum()
    _check_not_ddp(model, accum, config.zero_stage)
    fp32_rows = (
        fully_shard_model(model, optimizer, dtype, config.reduce_dtype) if config.zero_stage == 3 else {}
    )
    trained = {p for g in optimizer.param_groups for p in g["params"] if p.requires_grad}
    sharded = check_shards(model, dtype)
    if (
        sharded and config.zero_stage == 0
    ):  # fp32 shards the user made: cast here, masters from their fp32 rows
        fp32_rows = cast_shards(model, dtype)
    options = dict(
        loss_scaler=config.loss_scaler(),
        max_grad_norm=config.max_grad_norm,
        skip_nonfinite=config.skip_nonfinite,
        param_dtype=dtype,  # fp32 too: a model trained in fp32 on purpose (precision="fp32")
        impl=config.impl,
        grad_accum_dtype=accum,
    )
    if config.zero_stage == 0 and accum == "fp32" and world_size() > 1 and not sharded:
        # ZeRO-0 with fp32 sums: the optimizer all-reduces them (optim/accumulate.py), not DDP; FSDP2 has
        # reduce-scattered a sharded model's grads already
        options["process_group"] = torch.distributed.group.WORLD
    if config.zero_stage in (1, 2):
        options.update(named_parameters=model, reduce_dtype=config.reduce_dtype)
    # FSDP2 shards: the exact strategy over each rank's rows (optim/mesh.py) is stage 0's
    stage = 0 if config.zero_stage == 3 else config.zero_stage
    mp = build(optimizer, stage=stage, masters=config.masters, **options)
    start_masters_from(mp, fp32_rows)
    if dtype != torch.float32:
        cast_rest(model, dtype, trained)
    return Engine(model, mp, config, lr_scheduler)


def _check_not_ddp(model: torch.nn.Module, accum: str, zero_stage: int) -> None:
    """Refuse a DDP-wrapped model where the optimizer reduces the grads itself: fp32 accumulation releases the
    16-bit ``.grad`` that DDP would all-reduce, and ZeRO-1/2 reduce-scatter them."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel) and (zero_stage or accum == "fp32"):
        sharded = f"zero_stage={zero_stage} reduces the grads"
        why = sharded if zero_stage else "grad_accum_dtype resolves to 'fp32'"
        raise ValueError(
            f"the model is wrapped in DistributedDataParallel and {why}: halfprec then reduces the grads itself "
            "(fp32 sums at zero_stage 0), and DDP would all-reduce 16-bit grads besides. Pass the unwrapped "
            "model (ddp.module), or keep DDP with zero_stage=0 and grad_accum_dtype='param'"
        )


def _check_inputs(model: torch.nn.Module, optimizer: Any, lr_scheduler: Any) -> None:
    if isinstance(optimizer, MixedPrecisionOptimizer) or not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(
            f"optimizer must be a plain torch.optim.Optimizer over the model's params, got "
            f"{type(optimizer).__name__}; initialize() wraps it itself"
        )
    own = set(model.parameters())
    foreign = [p for g in optimizer.param_groups for p in g["params"] if p not in own]
    if foreign:
        raise ValueError(
            f"the optimizer holds {len(foreign)} tensors that are not this model's parameters (first of shape "
            f"{tuple(foreign[0].shape)}); was it already wrapped by MixedPrecisionOptimizer? Pass a fresh torch "
            "optimizer built over model.parameters()"
        )
    # duck-typed: HF's and other libraries' schedulers need only a step() the engine can call
    a_class = isinstance(lr_scheduler, type)
    if lr_scheduler is not None and (a_class or not callable(getattr(lr_scheduler, "step", None))):
        shown = f"{lr_scheduler!r:.60}"
        given = f"the class {lr_scheduler.__name__}" if a_class else f"{type(lr_scheduler).__name__} {shown}"
        raise ValueError(
            f"lr_scheduler must be a scheduler object with a step() method, got {given}; pass one built on the "
            "optimizer you pass, e.g. torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_steps) "
            "(a function of the step: LambdaLR(optimizer, fn))"
        )
    scheduled = getattr(lr_scheduler, "optimizer", None)
    if scheduled is not None and scheduled is not optimizer:
        raise ValueError(
            f"lr_scheduler {type(lr_scheduler).__name__} was built on another optimizer ({type(scheduled).__name__} "
            "object at a different address) than the one passed to initialize(): its steps would never reach the "
            "trained params. Build the scheduler on the optimizer you pass"
        )
    if isinstance(lr_scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise ValueError(
            "ReduceLROnPlateau needs a metric, so the engine cannot step it: leave lr_scheduler=None and call "
            "sched.step(val_loss) yourself after engine.step() when engine.last_record.skipped is False"
        )


class Engine:
    """A model, its ``MixedPrecisionOptimizer`` and an optional LR scheduler, stepped at accumulation boundaries.

    ``backward(loss)`` divides the loss by ``gradient_accumulation_steps`` and scales it; ``step()`` acts only at
    an accumulation boundary: the optimizer step (or skip), the LR scheduler step unless skipped, grads zeroed.
    ``zero_grad()`` does nothing in the middle of an accumulation, so a loop that calls it every micro-batch
    still accumulates.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        optimizer: MixedPrecisionOptimizer,
        config: Config,
        lr_scheduler: Any = None,
    ) -> None:
        self.module = module
        self.optimizer = optimizer
        self.config = config
        self.lr_scheduler = lr_scheduler
        self.global_step = 0
        self.micro_step = 0
        self.last_record: StepRecord | None = None
        self._stepped_micro = 0
        self._sharded = config.zero_stage in (1, 2)
        # FSDP2's float8 all-gather: the weights' scales, recomputed whenever the weights change
        self._after_update = float8_scale_precompute(module)

    # --- the loop --------------------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the model with the floating-point tensors of ``args``/``kwargs`` (nested ones too) cast to the
        training dtype, as Lightning's half-precision plugins and DeepSpeed's ``fp16.auto_cast`` do: an fp32 batch
        would otherwise meet 16-bit weights. ``engine.module(...)`` runs uncast."""
        dtype = DTYPES[self.config.precision]
        if dtype != torch.float32:
            args, kwargs = self._cast_floating(args, dtype), self._cast_floating(kwargs, dtype)
        return self.module(*args, **kwargs)

    @staticmethod
    def _cast_floating(value: Any, dtype: torch.dtype) -> Any:
        if isinstance(value, torch.Tensor):
            return value.to(dtype) if value.is_floating_point() else value
        if isinstance(value, dict):
            out = copy.copy(value)  # keeps a dict subclass's type and extras (an OrderedDict, a defaultdict)
            out.update((k, Engine._cast_floating(v, dtype)) for k, v in value.items())
            return out
        if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple: positional constructor
            return type(value)(*(Engine._cast_floating(v, dtype) for v in value))
        if isinstance(value, (list, tuple)):
            return type(value)(Engine._cast_floating(v, dtype) for v in value)
        return value

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def is_gradient_accumulation_boundary(self) -> bool:
        """True from the ``gradient_accumulation_steps``-th backward of an accumulation until ``step()`` takes
        its optimizer step."""
        return (
            self.micro_step > self._stepped_micro and self.micro_step % self.gradient_accumulation_steps == 0
        )

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        n = self.gradient_accumulation_steps
        pending = self.micro_step - self._stepped_micro
        # past the boundary one step would apply more than n micro-batches, each divided by n: a multiple of the
        # mean gradient, which trains on without any sign of it
        if pending >= n:
            raise RuntimeError(
                f"engine.backward() number {pending + 1} since the last optimizer step, with "
                f"gradient_accumulation_steps={n}: the accumulation of the last {n} was never stepped. Call "
                "engine.step() after every engine.backward(), as in DeepSpeed's loop (it steps only at accumulation "
                "boundaries), or raise gradient_accumulation_steps"
            )
        if self.gradient_accumulation_steps > 1:
            loss = loss / self.gradient_accumulation_steps
        last = (self.micro_step + 1) % self.gradient_accumulation_steps == 0
        # whole grads kept (stage 1, or fp32 accumulation): reduce only the last micro-batch's sum (stage 2 with
        # 16-bit grads must reduce each)
        hold = self._sharded and self.optimizer.reducer.whole_grads and not last
        with self.optimizer.no_sync() if hold else contextlib.nullcontext():
            self.optimizer.backward(loss, **kwargs)
        self.micro_step += 1

    def step(self) -> StepRecord | None:
        """Step at an accumulation boundary (returns its record); elsewhere do nothing (returns None)."""
        if not self.is_gradient_accumulation_boundary():
            return None
        self.optimizer.step()
        if self._after_update is not None:
            self._after_update()
        self._stepped_micro = self.micro_step
        self.global_step += 1
        # read only for a scheduler, which must not advance on a skipped step (on CUDA: a wait for the norm pass)
        if self.lr_scheduler is not None and not self.optimizer.step_was_skipped:
            self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.last_record = StepRecord(self.global_step, results=self.optimizer.step_results())
        return self.last_record

    def zero_grad(self) -> None:
        if self.micro_step % self.gradient_accumulation_steps == 0:
            self.optimizer.zero_grad(set_to_none=True)

    def train(self, mode: bool = True) -> Engine:
        self.module.train(mode)
        return self

    def eval(self) -> Engine:
        return self.train(False)

    @property
    def skipped_steps(self) -> int:
        return self.optimizer.skipped_steps

    @property
    def loss_scale(self) -> float:
        """The current loss scale (after the last step's update; reading it syncs on CUDA)."""
        return self.optimizer.loss_scale

    # --- checkpoints -----------------------------------------------------------------------------------
    def save_checkpoint(
        self,
        directory: str | os.PathLike,
        *,
        tag: str | None = None,
        client_state: dict[str, Any] | None = None,
        overwrite: bool = False,
        keep_last: int | None = None,
    ) -> Path:
        """Save at an optimizer-step boundary into ``<directory>/<tag>`` (default ``step-<global_step>``); tags
        and what ``overwrite`` may replace: docs/checkpoints.md. A model sharded by FSDP2 is saved whole, gathered
        tensor by tensor (every rank calls this): each rank's device holds one whole tensor at a time, rank 0's
        host memory the whole 16-bit state dict while it writes it (2 B/param, as for an unsharded model)."""
        if not isinstance(directory, (str, os.PathLike)):
            raise ValueError(
                f"save_checkpoint(directory={directory!r}): pass the directory to save into, a str or Path such as "
                "'checkpoints'"
            )
        root = check_directory(directory)
        file = next((p for p in (root, *root.parents) if p.is_file()), None)
        if file is not None:
            raise ValueError(
                f"save_checkpoint({os.fspath(directory)!r}): {file} is a file, not a directory; pass a directory "
                "(it holds one subdirectory per tag), or move the file away"
            )
        n, k = self.gradient_accumulation_steps, self.micro_step % self.gradient_accumulation_steps
        if k or self.micro_step != self._stepped_micro:
            where = f"in the middle of a gradient accumulation, at micro-step {k} of {n}"
            todo = f"run the {n - k} remaining micro-step(s) (engine.backward(), then engine.step())"
            if not k:
                where, todo = f"at micro-step {n} of {n}, before its optimizer step", "call engine.step()"
            raise RuntimeError(
                f"save_checkpoint() {where}: checkpoints are saved at optimizer-step boundaries, after the "
                f"engine.step() that follows backward {n} of {n} (engine.is_gradient_accumulation_boundary() is "
                f"True just before it; the engine.step() calls before it do nothing and return None); {todo}, then "
                "save"
            )
        tag = f"step-{self.global_step}" if tag is None else check_tag(tag)
        client_state = client_state or {}
        check_plain(client_state)
        names = {p: clean_name(n) for n, p in self.module.named_parameters()}  # first name of a tied param
        engine_state = {
            "global_step": self.global_step,
            "micro_step": self.micro_step,
            "param_names": [names.get(p) for p in self.optimizer.model_params()],
            "config": asdict(self.config),
            "lr_scheduler": None if self.lr_scheduler is None else self.lr_scheduler.state_dict(),
            "client_state": client_state,
        }
        check_plain(engine_state["lr_scheduler"], "lr_scheduler.state_dict()")
        info = {
            "global_step": self.global_step,
            "skipped_steps": self.skipped_steps,
            "precision": self.config.precision,
            "loss_scale": self.optimizer.loss_scale,
            "layout": ENGINE_SHARDED,
        }
        return self._write(root, tag, engine_state, info, overwrite=overwrite, keep_last=keep_last)

    def _write(
        self, root: Path, tag: str, engine_state, info, *, overwrite: bool, keep_last: int | None
    ) -> Path:
        """One protocol for every strategy: the optimizer in ``halfprec.distributed.checkpoint``'s format (model
        space, reshardable), written by every rank that holds a part of it (``optimizer.collective``: all ranks of
        its group, into one temporary directory on a filesystem they all see; else this process alone), each
        rank's RNG state beside it; rank 0 adds the weights and counters, seals and publishes the directory."""
        from .checkpoint import dcp  # noqa: PLC0415 - torch.distributed.checkpoint: 0.8 s of `import halfprec`

        mp = self.optimizer
        group, collective = mp.process_group, mp.collective
        rank = torch.distributed.get_rank(group) if collective else 0
        final, tmp = root / tag, root / f".{tag}.tmp-sharded"
        with contextlib.ExitStack() as saving:
            outcome: list[Any] = [None]
            # one rank checks and cleans; the others raise the same error, so none is left waiting. Rank 0
            # commits and publishes when the block ends (directory.saving)
            if rank == 0:
                try:
                    saving.enter_context(
                        saving_into(root, tag, overwrite=overwrite, keep_last=keep_last, tmp_name=tmp.name)
                    )
                except (OSError, ValueError) as e:
                    if not collective:
                        raise
                    outcome = [f"{type(e).__name__}: {e}"]
            if collective:
                src = torch.distributed.get_global_rank(group, 0) if group else 0
                torch.distributed.broadcast_object_list(outcome, src=src, group=group)
                if outcome[0] is not None:
                    raise RuntimeError(f"save_checkpoint failed on rank 0: {outcome[0]}")
            dcp.save(mp, tmp / "optimizer", named_parameters=self.module, local=not collective)
            save_pt(rng_state(), tmp / f"rng-{rank}.pt")
            weights = whole_state(self.module, keep=rank == 0)  # FSDP2 shards: collective
            if weights is not None:  # a compiled model's names as the model's own (optim/names.py)
                weights = clean_keys(weights)
            if collective:
                torch.distributed.barrier(group)
            if rank == 0:
                stage(tmp, weights=weights, files={"engine": engine_state})
                seal(tmp, tag, info)
        if collective:
            torch.distributed.barrier(group)
        return final

    def load_checkpoint(
        self,
        directory: str | os.PathLike,
        *,
        tag: str | None = None,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_rng_states: bool = True,
    ) -> dict[str, Any]:
        """Restore weights, masters, optimizer and scaler state, counters, scheduler and RNG; return client_state.
        A failed load changes nothing; ``load_optimizer_states=False`` loads the weights and refreshes the masters
        from them; what a resume keeps and drops: docs/checkpoints.md. A model sharded by FSDP2 (at any world size
        and mesh) takes its rows of the whole weights, which every rank reads: the whole 16-bit state dict in each
        rank's host memory while it loads."""
        if not isinstance(directory, (str, os.PathLike)):
            raise ValueError(
                f"load_checkpoint(directory={directory!r}): pass the directory that save_checkpoint() wrote to, "
                "or one of its tag directories"
            )
        root = resolve(directory, tag).parent
        # a collective optimizer's ranks load together (the lock would deadlock them); resolved again under the
        # lock: 'latest' or an interrupted replace may have moved on meanwhile
        with contextlib.nullcontext() if self.optimizer.collective else reading(root):
            path = resolve(directory, tag)
            manifest = verify(path)
            weights = load_weights(path, manifest)
            weights = laid_out_like(self.module, _check_weights(self.module, weights, path))
            engine_state = load_pt(path, "engine")
            counters = _check_engine_state(path, engine_state)
            if load_optimizer_states:
                load_optimizer = self._staged_optimizer_load(path, engine_state, layout_of(path, manifest))
            rng = self._staged_rng(path, engine_state) if load_rng_states else None
        configured = self.optimizer.loss_scaler.state_dict() if load_optimizer_states else {}
        # nothing has changed so far; from here on every step is a write
        self.optimizer.zero_grad(set_to_none=True)
        self.module.load_state_dict(weights, strict=True)
        if load_optimizer_states:
            load_optimizer()
            keep_scaler_settings(path, self.optimizer.loss_scaler, configured)
        else:
            self.optimizer.refresh_masters()
        if self._after_update is not None:
            self._after_update()
        self.global_step, self.micro_step = counters
        self._stepped_micro = self.micro_step
        scheduler_state = engine_state["lr_scheduler"]
        if load_lr_scheduler_states and self.lr_scheduler is not None and scheduler_state is not None:
            self.lr_scheduler.load_state_dict(scheduler_state)
        if rng is not None:
            set_rng_state(rng)
        return engine_state["client_state"]

    def _staged_optimizer_load(self, path: Path, engine_state: dict[str, Any], layout: str):
        """Read and check the checkpoint's optimizer part; return the function that loads it. Every strategy
        loads the reshardable format (``optimizer/``); ``optimizer.pt``, of checkpoints from before it, through
        the optimizer's ``load_state_dict``."""
        try:
            if layout == ENGINE_SHARDED:
                from .checkpoint.dcp import staged_load  # noqa: PLC0415 - as in _write

                return staged_load(
                    self.optimizer, path / "optimizer", named_parameters=self.module,
                    local=not self.optimizer.collective,
                )  # fmt: skip
            optim_state = load_pt(path, "optimizer")
            self.optimizer.check_state_dict(optim_state)
        except ValueError as e:
            kind_error = scaler_kind_error(path, e, engine_state, self.config)
            if kind_error is not None:
                raise kind_error from e
            where = "" if layout == ENGINE_SHARDED else f"{path / 'optimizer.pt'}: "  # DCP's names its path
            raise CheckpointError(f"{where}{e}") from e
        return lambda: self.optimizer.load_state_dict(optim_state)

    def _staged_rng(self, path: Path, engine_state: dict[str, Any]) -> Any:
        """The RNG states to restore (None, with a warning, when the checkpoint has none for this rank)."""
        if "rng" in engine_state:
            return engine_state["rng"]
        rank = 0
        if self.optimizer.collective:
            rank = torch.distributed.get_rank(self.optimizer.process_group)
        if (path / f"rng-{rank}.pt").exists():
            return load_pt(path, f"rng-{rank}")
        warnings.warn(
            f"{path} has no RNG state for rank {rank} (saved at a smaller world size); RNG states not restored",
            RuntimeWarning,
            stacklevel=3,
        )
        return None


def _check_engine_state(path: Path, engine_state: Any) -> tuple[int, int]:
    """``(global_step, micro_step)`` of a checkpoint's ``engine.pt``, checked."""
    if not isinstance(engine_state, dict):
        raise CheckpointError(f"{path / 'engine.pt'} holds a {type(engine_state).__name__}, not a dict")
    for key in ("global_step", "micro_step"):
        value = engine_state.get(key)
        if not is_int(value) or value < 0:
            raise CheckpointError(f"{path / 'engine.pt'}: {key} must be a non-negative int, got {value!r}")
    if not isinstance(engine_state.get("client_state"), dict):
        raise CheckpointError(f"{path / 'engine.pt'}: client_state is not a dict")
    return engine_state["global_step"], engine_state["micro_step"]


def _check_weights(
    module: torch.nn.Module, weights: dict[str, torch.Tensor], path: Path
) -> dict[str, torch.Tensor]:
    """Name the first parameter or buffer whose name, shape or dtype differs from the checkpoint's; return the
    weights under the module's own state-dict names. Names compare clean (``optim/names.py``) on both sides: a
    model saved compiled loads uncompiled and back, checkpoints saved with ``_orig_mod.`` names too."""
    state = module.state_dict()
    own = clean_keys(state)
    with reraised(ValueError, f"checkpoint {path}"):
        weights = clean_keys(weights)
    for name, tensor in own.items():
        saved = weights.get(name)
        if saved is None:
            raise CheckpointError(
                f"checkpoint {path} has no tensor {name!r} (shape {list(tensor.shape)}, "
                f"{tensor.dtype}): it is of another model"
            )
        if saved.shape != tensor.shape or saved.dtype != tensor.dtype:
            raise CheckpointError(
                f"checkpoint {path} does not match this model at {name!r}: saved shape {list(saved.shape)} "
                f"{saved.dtype}, model shape {list(tensor.shape)} {tensor.dtype}"
            )
    extra = sorted(set(weights) - set(own))
    if extra:
        raise CheckpointError(f"checkpoint {path} has tensors this model lacks: {extra[:5]}")
    return {name: weights[clean_name(name)] for name in state}
