"""MixedPrecisionOptimizer: the contract every halfprec optimizer keeps. Abstract: it holds no algorithm.

Calling ``MixedPrecisionOptimizer(optimizer, ...)`` runs the one factory, ``optim/select.build``, which validates
every option and returns a strategy, a subclass of this class: exact (``exact.py``: the torch step on fp32
masters), fused (``fused/``: Triton kernels over flat buffers) or sharded (``sharded/``: ZeRO-1/2). The factory
registers itself here when ``halfprec.optim`` is imported, so the contract does not import its strategies.

What the contract holds, for every strategy: the options, the default loss scaler, the ``param_dtype`` cast, loss
scaling and the backward guards, the step's results and skip log, torch's hook registries, and the state-dict
envelope (format, algorithm, scaler, counters) around one payload per strategy. A strategy implements the step
(``_step``, ``unscale_``, ``zero_grad``), its params (``model_params``, ``master_params``, ``refresh_masters``)
and its payload (``_payload``, ``_check_payload``, ``_load_payload``, ``_load_torch_state``).
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Callable
from itertools import chain
from typing import Any

import torch
import torch.optim.optimizer as torch_optimizer

from .._checks import is_int
from ..precision import LOW_PRECISION
from ..scaler import DynamicLossScaler, LossScaler, StaticLossScaler
from .checks import ELEMENTWISE, check_options, check_torch_optimizer, set_data
from .mesh import check_rows, local
from .results import ScaleGuard, SkipLog, StepState, refuse_backward_after_unscale, warn_caller
from .state import check_has_state, laid_out_like_params, state_record

__all__ = ["FORMAT", "MixedPrecisionOptimizer", "check_wrappable", "register_factory"]

FORMAT = "halfprec.MixedPrecisionOptimizer/1"  # the model-space state dict of the exact and fused strategies

# torch's hook registries (``_optimizer_step_pre_hooks``, ...), which ``Optimizer.__init__`` would create
_HOOK_REGISTRIES = tuple(
    f"_optimizer_{kind}_{when}_hooks"
    for kind in ("step", "state_dict", "load_state_dict")
    for when in ("pre", "post")
)


class _Delegated:
    """``param_groups``/``state``/``defaults``: the wrapped torch optimizer's (exact, sharded), so LR schedulers
    write where the inner step reads; or this object's own (fused, ``optimizer`` is None)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type) -> Any:
        if obj is None:
            return self
        return obj.__dict__["_" + self.name] if obj.optimizer is None else getattr(obj.optimizer, self.name)

    def __set__(self, obj: Any, value: Any) -> None:
        if obj.optimizer is None:
            obj.__dict__["_" + self.name] = value
        else:
            setattr(obj.optimizer, self.name, value)


class _Built(type(torch.optim.Optimizer)):
    """Calling ``MixedPrecisionOptimizer`` itself builds a strategy through the registered factory; calling a
    strategy class builds that class."""

    factory: Callable[..., Any] | None = None

    def __call__(cls, *args: Any, **kwargs: Any):
        if cls is MixedPrecisionOptimizer:
            return _Built.factory(*args, **kwargs)
        return super().__call__(*args, **kwargs)


def register_factory(factory: Callable[..., Any]) -> None:
    """Make ``MixedPrecisionOptimizer(...)`` call ``factory`` (``optim/select.build``)."""
    _Built.factory = factory


class MixedPrecisionOptimizer(torch.optim.Optimizer, metaclass=_Built):
    """Give ``optimizer`` FP32 master weights for a model held in FP16/BF16.

    ``MixedPrecisionOptimizer(optimizer, **options)`` returns the strategy that ``halfprec.optim.select.build``
    picks for them (every option and its validation: that function's docstring). The common options:

    Args:
        optimizer: a ``torch.optim.Optimizer`` over the model's params (16-bit, or fp32 with ``param_dtype``).
        loss_scaler: a ``StaticLossScaler`` or ``DynamicLossScaler``. ``None`` means ``DynamicLossScaler()``
            when any trainable param is fp16, else no scaling (``StaticLossScaler(1.0)``).
        max_grad_norm: clip the global L2 norm of the unscaled grads to this value; ``None`` = no clipping.
        skip_nonfinite: skip steps with non-finite bf16/fp32 grads. With any fp16 param every grad is
            loss-scaled, so every grad is checked (an overflow anywhere is the scale's), whatever this says.
        param_dtype: ``torch.bfloat16`` or ``torch.float16`` to cast the optimizer's trainable params to that
            dtype in place (same ``Parameter`` objects), keeping their fp32 values as the masters;
            ``torch.float32`` casts nothing and says an all-fp32 model is meant (``None`` warns then).
        impl, stage, masters, grad_accum_dtype, process_group, named_parameters, reduce_dtype, bucket_size:
            the strategy and its options (``select.build``).

    Capabilities callers read instead of the strategy's type: ``unscales_in_place`` (``unscale_()`` leaves
    unscaled fp32 grads in ``master_params()``' ``.grad`` for the caller to read or edit before ``step()``).
    """

    optimizer: torch.optim.Optimizer | None = None  # wrapped (exact, sharded); None: fused owns its groups
    impl = (
        "torch"  # the step's implementation: "torch" (a torch optimizer's step) or "triton" (fused kernels)
    )
    grad_accum_dtype = "param"  # where micro-batch grads are summed: "param" (16-bit .grad) or "fp32"
    process_group: Any = None  # the data-parallel group the grads are reduced over; None: no reduction
    unscales_in_place = True  # unscale_() fills the masters' fp32 .grad with unscaled values
    _FORMAT = FORMAT

    def __init__(
        self,
        *,
        loss_scaler: LossScaler | None,
        max_grad_norm: float | None,
        skip_nonfinite: bool,
        param_dtype: torch.dtype | None,
        wrapped: torch.optim.Optimizer | None = None,
    ) -> None:
        """The contract's state. ``wrapped``: the torch optimizer whose groups this one keeps (exact, sharded);
        None for a strategy that owns its groups (fused), which then runs ``torch.optim.Optimizer.__init__``."""
        check_options(
            loss_scaler=loss_scaler,
            max_grad_norm=max_grad_norm,
            param_dtype=param_dtype,
            skip_nonfinite=skip_nonfinite,
        )
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.skip_nonfinite = bool(skip_nonfinite)
        self.param_dtype = param_dtype
        self._s = StepState()
        self._skip_log = SkipLog()
        self._scale_guard = ScaleGuard()
        self._model_params: list[torch.nn.Parameter] = []  # what the caller's model holds, group order
        if (
            wrapped is not None
        ):  # Optimizer.__init__ would make new groups: its registries and step patch only
            self.optimizer = wrapped
            for name in _HOOK_REGISTRIES:
                setattr(self, name, OrderedDict())
            self._patch_step_function()

    def _init_scaler(self, loss_scaler: LossScaler | None, *, dtypes: set, device: torch.device) -> None:
        """The default scaler: dynamic when any trained param (of ``dtypes``) is fp16, else none."""
        self._has_fp16 = torch.float16 in dtypes
        if dtypes and not dtypes & set(LOW_PRECISION) and self.param_dtype is None:
            warn_caller(
                f"halfprec: every trained param is {'/'.join(sorted(map(str, dtypes)))} and param_dtype is None, so "
                "this trains in full precision. Pass param_dtype=torch.bfloat16 (or torch.float16) to train the "
                "model in 16 bits with fp32 masters, or param_dtype=torch.float32 to say fp32 is meant.",
                UserWarning,
            )
        if loss_scaler is None:
            loss_scaler = DynamicLossScaler() if self._has_fp16 else StaticLossScaler(1.0)
        self.loss_scaler = loss_scaler.to(device)

    def _cast_to_param_dtype(self, p: torch.nn.Parameter, originals: dict) -> None:
        """``param_dtype``: cast an fp32 param in place (same ``Parameter``), keeping its fp32 value as the master."""
        if self.param_dtype in LOW_PRECISION and p.dtype == torch.float64:
            raise ValueError(
                f"param of shape {tuple(p.shape)} is torch.float64 and param_dtype={self.param_dtype}: halfprec's "
                "masters are fp32, so an fp64 model would lose precision silently; cast the model to fp32 first "
                "(model.float())"
            )
        if self.param_dtype in LOW_PRECISION and p.dtype == torch.float32:
            originals[p] = p.data
            set_data(p, p.data.to(self.param_dtype))

    @property
    def collective(self) -> bool:
        """Whether the ranks of ``process_group`` save and load this optimizer together (its state is reduced
        among them, ZeRO-0, or spread over them, ZeRO-1/2); False: this process alone."""
        return self.process_group is not None

    @property
    def _checks_grads(self) -> bool:
        """Whether a step checks its grads for non-finite values: always with fp16 (all grads are loss-scaled)."""
        return self._has_fp16 or self.skip_nonfinite

    # --- where groups, state and defaults live; the params ------------------------------------------------
    param_groups = _Delegated("param_groups")
    state = _Delegated("state")
    defaults = _Delegated("defaults")

    def model_params(self) -> list[torch.nn.Parameter]:
        """The model's params in param-group order, frozen ones included (what state dicts index)."""
        return list(self._model_params)

    def master_params(self) -> list[torch.Tensor]:
        """The fp32 tensors the update writes (masters, and fp32 params that are their own), in group order."""
        raise NotImplementedError

    def refresh_masters(self) -> None:
        """Copy the model's current weights into the masters (after an external weights-only load)."""
        raise NotImplementedError

    def _index_params(self) -> list[torch.Tensor]:
        """The tensors the groups hold, in order: what the torch-format ``"optimizer"`` state indexes."""
        return [p for g in self.param_groups for p in g["params"]]

    def _backward_params(self) -> list[torch.Tensor]:
        """The tensors whose ``.grad`` a backward fills (the scale guard's view)."""
        return self._model_params

    # --- read-only results --------------------------------------------------------------------------------
    @property
    def step_was_skipped(self) -> bool:
        """True when the last ``step()`` skipped the update (non-finite grads)."""
        return self._s.step_was_skipped

    @property
    def skipped_steps(self) -> int:
        return self._s.skipped_steps

    @property
    def grad_norm(self) -> float | None:
        """Global L2 norm of the last step's unscaled grads, before clipping (None: neither checked nor clipped)."""
        return self._s.grad_norm

    @property
    def step_loss_scale(self) -> float | None:
        """The loss scale the last step's gradients were scaled with (before the scaler's update)."""
        return self._s.step_loss_scale

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.loss_scale

    def step_results(self):
        """The last step's ``step_was_skipped``, ``grad_norm`` and ``step_loss_scale``, kept for reading later:
        taking them does not wait for the step (on the fused strategy they stay on the device until read)."""
        return self._s.snapshot()

    def _record_step(
        self, values: list[float], norm: float | None, *, where: str = "", log: bool = True
    ) -> None:
        """Keep a step's results; ``values`` is ``LossScaler.step_update``'s (skipped, at min, before, after)."""
        skipped, at_min, before, after = values[:4]
        self._s.grad_norm = norm
        self._s.step_loss_scale = before
        self._s.step_was_skipped = bool(skipped)
        if skipped:
            self._s.skipped_steps += 1
            if log:
                self._skip_log.report(
                    before=before,
                    after=after,
                    skipped_so_far=self._s.skipped_steps,
                    at_min_scale=bool(at_min) and self.loss_scaler.is_dynamic,
                    where=where,
                )

    # --- loss scaling and the step ------------------------------------------------------------------------
    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` multiplied by the current loss scale (the same tensor when no scaling is configured)."""
        self._scale_guard.mark()
        if self.loss_scaler.is_unit:
            return loss
        return loss * self.loss_scaler.scale.to(loss.device)

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Scale ``loss`` and run autograd backward; ``kwargs`` go to ``Tensor.backward``."""
        if self._s.unscaled:
            refuse_backward_after_unscale("the new grads would be mixed with unscaled ones")
        self.scale_loss(loss).backward(**kwargs)

    def step(self, *args: Any, **kwargs: Any):
        """``step(closure=None)``: run ``closure`` (with grad enabled) if given, then the strategy's ``_step()``;
        return the closure's loss. torch's step pre- and post-hooks (this optimizer's and the global ones) run
        around it as around any torch optimizer's ``step()``, seeing the arguments as given with ``self`` first,
        and the profiler range ``Optimizer.step#<class>.step`` opens while a profiler records (torch.profiler or
        the autograd profiler; an ``ExecutionTraceObserver`` alone does not count). torch's own wrapper, put
        around a ``step`` not marked ``hooked``, opens that range on every step, profiler or not: two dispatcher
        calls of host time that a synchronized device waits for (benchmarks/RESULTS.md, section 1). A subclass
        that overrides ``step`` calls ``super().step(...)``, which runs the hooks once (``__init_subclass__``)."""
        if not torch.autograd._profiler_enabled():
            return self._step_with_hooks(self, *args, **kwargs)
        with torch.autograd.profiler.record_function(f"Optimizer.step#{type(self).__name__}.step"):
            return self._step_with_hooks(self, *args, **kwargs)

    step.hooked = True  # type: ignore[attr-defined]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "step" in cls.__dict__:  # its super().step() runs the hooks: torch's wrapper would run them again
            cls.step.hooked = True

    def _step_with_hooks(self, *args: Any, **kwargs: Any):
        """torch's step protocol: pre-hooks (which may replace the arguments, ``self`` first), the step, then
        post-hooks (torch.optim.optimizer's global dicts are read at each step, as torch reads them)."""
        pre = chain(
            torch_optimizer._global_optimizer_pre_hooks.values(), self._optimizer_step_pre_hooks.values()
        )
        for pre_hook in pre:
            result = pre_hook(self, args, kwargs)
            if result is not None:
                if not (isinstance(result, tuple) and len(result) == 2):
                    raise RuntimeError(
                        f"a step pre-hook of {type(self).__name__} returned {result!r}: it must return None or a "
                        "tuple (new_args, new_kwargs)"
                    )
                args, kwargs = result
        out = MixedPrecisionOptimizer._closure_then_step(*args, **kwargs)
        self._optimizer_step_code()
        post = chain(
            self._optimizer_step_post_hooks.values(), torch_optimizer._global_optimizer_post_hooks.values()
        )
        for post_hook in post:
            post_hook(self, args, kwargs)
        return out

    def _closure_then_step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._scale_guard.check(self._backward_params, self.loss_scaler)
        self._step()
        return loss

    def _step(self) -> None:
        raise NotImplementedError

    def unscale_(self) -> None:
        """Unscale this step's grads into the masters' fp32 ``.grad`` (``unscales_in_place``). Idempotent."""
        raise NotImplementedError

    def zero_grad(self, set_to_none: bool = True) -> None:
        raise NotImplementedError

    def _run_hooks(self, registry: str, state_dict: dict[str, Any] | None = None) -> dict[str, Any] | None:
        """Run one of torch's state-dict hook registries; hooks given a state dict may return a new one."""
        for hook in getattr(self, registry).values():
            if state_dict is None:
                hook(self)
            else:
                state_dict = hook(self, state_dict) or state_dict
        return state_dict

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    # --- the state-dict envelope --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """``{"format", "algorithm", <the strategy's payload>, "scaler", "skipped_steps"}``."""
        self._run_hooks("_optimizer_state_dict_pre_hooks")
        out = {"format": self._FORMAT, "algorithm": self.algorithm(), **self._payload()}
        out |= {"scaler": self.loss_scaler.state_dict(), "skipped_steps": self.skipped_steps}
        return self._run_hooks("_optimizer_state_dict_post_hooks", out)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load ``state_dict()`` of this strategy's format, or a plain torch optimizer state dict (its state and
        groups; the masters stay as they are: ``refresh_masters()`` takes them from the model's weights)."""
        state_dict = self._run_hooks("_optimizer_load_state_dict_pre_hooks", state_dict)
        if _is_torch_state_dict(state_dict):
            self.check_torch_state_dict(state_dict)
            self._load_torch_state(state_dict)
        else:
            self.check_state_dict(state_dict)
            self._load_payload(state_dict)
            self.loss_scaler.load_state_dict(state_dict["scaler"])
            self._s.skipped_steps = int(state_dict["skipped_steps"])
        self._s.unscaled = False
        self._run_hooks("_optimizer_load_state_dict_post_hooks")

    def check_state_dict(self, state_dict: Any) -> None:
        """Raise ValueError unless ``state_dict`` is this optimizer's kind and of this model (changes nothing)."""
        if not isinstance(state_dict, dict) or state_dict.get("format") != self._FORMAT:
            found = state_dict.get("format") if isinstance(state_dict, dict) else type(state_dict).__name__
            plain = " (a plain torch optimizer state dict, with 'state' and 'param_groups', loads too)"
            raise ValueError(
                f"not a {type(self).__name__} state dict: format {found!r}, expected {self._FORMAT!r}"
                f"{plain if self._TORCH_STATE_REFUSED is None else ''}"
            )
        inner = state_dict.get("optimizer")
        if not (isinstance(inner, dict) and isinstance(inner.get("param_groups"), list) and "state" in inner):
            raise ValueError(
                f"state dict's 'optimizer' must be a torch optimizer state dict ('state', 'param_groups'), got "
                f"{type(inner).__name__ if not isinstance(inner, dict) else sorted(inner)}: the file is damaged or "
                "was not written by halfprec"
            )
        self._check_payload(state_dict)
        self.check_algorithm(state_dict.get("algorithm"), inner["param_groups"])
        skipped_steps = state_dict.get("skipped_steps")
        if not is_int(skipped_steps) or skipped_steps < 0:
            raise ValueError(f"state dict's skipped_steps must be a non-negative int, got {skipped_steps!r}")
        try:
            copy.deepcopy(self.loss_scaler).load_state_dict(state_dict.get("scaler"))
        except ValueError as e:
            raise ValueError(f"state dict's loss-scaler state: {e}") from e

    def _payload(self) -> dict[str, Any]:
        """The strategy's part of ``state_dict()``: ``"optimizer"`` (torch format) and what else it keeps."""
        raise NotImplementedError

    def _load_payload(self, state_dict: dict[str, Any]) -> None:
        """Put a checked state dict's payload in place (masters, optimizer state, groups)."""
        raise NotImplementedError

    def _load_torch_state(self, state_dict: dict[str, Any]) -> None:
        """Load a checked plain torch optimizer state dict (groups and state; masters untouched)."""
        raise NotImplementedError

    # why a strategy refuses every plain torch optimizer state dict (None: it loads one that fits)
    _TORCH_STATE_REFUSED: str | None = None

    def check_torch_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Raise ValueError, changing nothing, unless a plain torch optimizer state dict fits this optimizer: as
        many groups and params per group, this algorithm's hyper-parameters, state of the params' sizes."""
        if self._TORCH_STATE_REFUSED is not None:
            raise ValueError(self._TORCH_STATE_REFUSED)
        groups, state = state_dict["param_groups"], state_dict["state"]
        if not (
            isinstance(state, dict) and isinstance(groups, list) and all(isinstance(g, dict) for g in groups)
        ):
            raise ValueError(
                "a torch optimizer state dict has a dict 'state' and a list of dicts 'param_groups', got "
                f"{type(state).__name__} and {type(groups).__name__}: the file is damaged or was not written by torch"
            )
        self._check_group_sizes(groups, "the torch optimizer state dict")
        self.check_algorithm(None, groups, where="torch optimizer state dict")
        self._check_state_sizes(state)

    def _check_state_sizes(self, state: dict) -> None:
        """ValueError for a state tensor whose size is not its param's (this rank's rows of an FSDP2 shard): for
        the elementwise algorithms (``checks.ELEMENTWISE``, the fused ones), whose state is one value per element
        or a scalar; another algorithm's state (factored moments) is its own to check."""
        if self.optimizer is not None and not isinstance(self.optimizer, ELEMENTWISE):
            return
        for k, p in enumerate(self._model_params):
            entry = state.get(k, state.get(str(k)))
            for name, value in (entry or {}).items():
                if not torch.is_tensor(value) or value.dim() == 0:
                    continue  # counters, flags and scalar state
                check_rows(f"{name} of param {k}", value, p, plain_ok=True)
                want, held = local(p).numel(), local(value).numel()
                if held != want:
                    rows = " (this rank's rows of an FSDP2 shard)" if want != p.numel() else ""
                    raise ValueError(
                        f"state dict's {name} of param {k} has {held} elements and the param {want}{rows}, shape "
                        f"{tuple(p.shape)}: load a state dict of this model and layout, or use "
                        "halfprec.distributed.checkpoint, which reshards"
                    )

    def _check_group_sizes(self, saved: list[dict[str, Any]], where: str) -> None:
        sizes, mine = [len(g.get("params", ())) for g in saved], [len(g["params"]) for g in self.param_groups]
        if sizes != mine:
            raise ValueError(
                f"{where} has param groups of sizes {sizes}, this optimizer {mine}: build the optimizer with the "
                "same param groups as the one that was saved"
            )

    def _check_payload(self, state_dict: dict[str, Any]) -> None:
        """The model-space payload's checks (exact and fused): the params, groups and masters fit this model."""
        self._check_compatible(state_dict.get("params"))
        self._check_group_sizes(state_dict["optimizer"]["param_groups"], "state dict")
        entries = self._param_entries()
        want = [i for i, entry in enumerate(entries) if entry["master"]]
        masters = state_dict.get("masters")
        found = sorted(int(k) for k in masters) if isinstance(masters, dict) else type(masters).__name__
        if found != want:
            raise ValueError(
                f"state dict holds masters of params {found}, this optimizer has masters of {want}"
            )
        for k, value in masters.items():
            expected = entries[int(k)]["shape"]
            if not (torch.is_tensor(value) and value.is_floating_point() and list(value.shape) == expected):
                shape = list(value.shape) if torch.is_tensor(value) else type(value).__name__
                raise ValueError(
                    f"state dict's master of param {k} is {shape}, expected a floating tensor of shape {expected}"
                )
            check_rows(f"master of param {k}", value, self._model_params[int(k)])
        self._check_state_sizes(state_dict["optimizer"]["state"])
        check_has_state(state_dict, len(self._model_params))

    def _param_entries(self) -> list[dict[str, Any]]:
        """Per model param, in group order: shape (an FSDP2 shard's: the whole param's), model dtype and whether
        it has an fp32 master."""
        raise NotImplementedError

    def _model_space_payload(self, inner: dict[str, Any], masters: dict[int, torch.Tensor]) -> dict[str, Any]:
        """The exact and fused strategies' payload: ``inner`` (torch's format) and ``masters`` keyed by param
        index, the params' entries, and ``has_state``, which params ``inner`` holds state for (a load that finds
        state missing was filled in place by a loader that kept only what its destination held); FSDP2 shards'
        masters and state as DTensors (``state.laid_out_like_params``)."""
        held = state_record(inner["state"], len(self._model_params))
        payload = {"optimizer": inner, "masters": masters, "params": self._param_entries(), "has_state": held}
        return laid_out_like_params(payload, self._model_params)

    def _check_compatible(self, saved: Any) -> None:
        mine = self._param_entries()
        if not isinstance(saved, list):
            raise ValueError(f"state dict's params must be a list of entries, got {type(saved).__name__}")
        if any(isinstance(entry, dict) and "rows" in entry for entry in saved):
            raise ValueError(
                "state dict holds one rank's rows of FSDP2 shards as plain tensors (state dicts written before "
                "they held DTensors): load it into the release that wrote it, or resume from a "
                "halfprec.distributed.checkpoint save"
            )
        for i, (entry, here) in enumerate(zip(saved, mine, strict=False)):
            if entry != here:
                raise ValueError(
                    f"state dict does not match this model at param {i}: saved {_describe(entry)}, "
                    f"this model {_describe(here)}"
                )
        if len(saved) != len(mine):
            i = min(len(saved), len(mine))
            extra = saved[i] if len(saved) > len(mine) else mine[i]
            where = "the state dict" if len(saved) > len(mine) else "this model"
            raise ValueError(
                f"state dict holds {len(saved)} params, this optimizer {len(mine)}: param {i} (shape "
                f"{extra['shape']} dtype {extra['dtype']}) is only in {where}"
            )

    # --- which optimizer a state belongs to ---------------------------------------------------------------
    def algorithm(self) -> str:
        """The torch optimizer whose update this one runs (``"AdamW"``, ``"SGD"``; ``FusedAdamW`` runs
        ``"AdamW"``): what checkpoints record, so that a load refuses another optimizer's state."""
        return type(self if self.optimizer is None else self.optimizer).__name__.removeprefix("Fused")

    def check_algorithm(
        self, saved: str | None, groups: list[dict[str, Any]], where: str = "state dict"
    ) -> None:
        """Raise ValueError when a checkpoint's state is another optimizer's: ``saved`` is the algorithm it
        recorded (None in checkpoints that predate the record: then its param groups must hold every
        hyper-parameter of this optimizer's ``defaults``, which another algorithm's groups do not)."""
        mine = self.algorithm()
        if saved is None:
            # flags torch added over its versions (its __setstate__ fills them in): not an algorithm's own
            keys = set(self.defaults) - {"foreach", "fused", "capturable", "differentiable", "maximize",
                                         "decoupled_weight_decay"}  # fmt: skip
            missing = sorted({k for g in groups for k in keys if k not in g})
            if not missing:
                return
            saved = f"an optimizer without {missing}"
        if saved != mine:
            raise ValueError(
                f"the {where} was saved by {saved}, this optimizer is {mine}: another optimizer's state cannot be "
                "loaded (its moments would be misread); build the optimizer it was saved with, or load only the "
                "weights"
            )


def _is_torch_state_dict(state_dict: Any) -> bool:
    """A plain ``torch.optim.Optimizer.state_dict()``: its two keys and no halfprec format."""
    return (
        isinstance(state_dict, dict)
        and "format" not in state_dict
        and {"state", "param_groups"} <= set(state_dict)
    )


def _describe(entry: Any) -> str:
    if not isinstance(entry, dict):
        return repr(entry)
    role = " (trained, fp32 master)" if entry.get("master") else ""
    return f"shape {entry.get('shape')} dtype {entry.get('dtype')}{role}"


def check_wrappable(optimizer: Any) -> None:
    """What every strategy that wraps a torch optimizer refuses: a halfprec optimizer (wrapping one again would
    scale its grads twice and hand its step fp32 masters of masters), a non-optimizer, LBFGS."""
    if isinstance(optimizer, MixedPrecisionOptimizer):
        raise ValueError(
            f"optimizer is already a MixedPrecisionOptimizer ({type(optimizer).__name__}); use it as it is, or "
            "wrap the plain torch optimizer once"
        )
    check_torch_optimizer(optimizer)
