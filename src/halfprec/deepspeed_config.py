"""DeepSpeed JSON configs -> ``Config``: the per-key table and its reader.

``DEEPSPEED_KEYS`` says, for every DeepSpeed key inside the blocks halfprec owns, whether it is mapped,
accepted with a warning, or an error (rendered in ``docs/deepspeed-config.md`` by ``render_deepspeed_table``).
Nothing is silently dropped.

``read_deepspeed`` is handed the Config class (by ``Config.from_deepspeed``) and builds it by keyword:
importing ``Config`` here would make an import cycle.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from ._checks import did_you_mean, is_int, is_number

__all__ = [
    "DEEPSPEED_KEYS",
    "DeepSpeedConfigWarning",
    "DeepSpeedKey",
    "read_deepspeed",
    "render_deepspeed_table",
]


class DeepSpeedConfigWarning(UserWarning):
    """Keys of a DeepSpeed config that ``Config.from_deepspeed`` accepted without applying them."""


@dataclass(frozen=True)
class DeepSpeedKey:
    """One row of the DeepSpeed key table."""

    key: str
    """Dotted path inside the DeepSpeed config (``fp16.loss_scale``)."""
    action: Literal["mapped", "warn", "error"]
    """mapped: sets a Config field; warn: accepted, not applied, reported; error: refused."""
    target: str
    """The Config field it sets, or why it is not applied / refused."""
    quiet: Callable[[Any], bool] | None = None
    """For warn/error rows: values for which halfprec already does what the key asks (no warning, no error)."""
    quiet_text: str = ""
    field: str = ""
    """Mapped rows: the Config field set from the value (fp16/bf16.enabled: none, read together as precision)."""
    convert: Callable[[Any, str, list[str]], Any] | None = None
    """Mapped rows: (value, precision, notes) -> the field's value; None: the value as it is."""


def _off(value: Any) -> bool:
    return value is False or value is None


def _no_offload(value: Any) -> bool:
    return value is None or (isinstance(value, Mapping) and value.get("device", "none") in ("none", None))


# the Config field that fp16.initial_scale_power sets, under the name docs/deepspeed-config.md still uses (Config
# accepts it as the old name of init_scale); switch to "init_scale" together with the docs' table
_INIT_SCALE = "initial_scale"
_PERF = "performance knob without effect in halfprec"
_Z3 = "ZeRO-3 only: tunes DeepSpeed's partitioner; stage 3 applies torch FSDP2, which has no such setting"
_NO_OFFLOAD = "halfprec does not offload"
_DTYPES = "('fp32' -> 'fp32'; the 16-bit precision -> 'param')"
_K = DeepSpeedKey


def _finite(key: str, value: Any, must: str, *, zero_ok: bool) -> None:
    if not is_number(value) or not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
        raise ValueError(f"{key} must be {must}, got {value!r}")


def _loss_scale(value: Any, precision: str, notes: list[str]) -> float | None:
    _finite("fp16.loss_scale", value, "0 (dynamic) or a power of two > 0", zero_ok=True)
    return None if value == 0 else float(value)


def _initial_scale(power: Any, precision: str, notes: list[str]) -> float:
    if not is_int(power) or not -126 <= power <= 127:
        raise ValueError(f"fp16.initial_scale_power must be an integer in [-126, 127], got {power!r}")
    return 2.0**power


def _min_scale(value: Any, precision: str, notes: list[str]) -> float:
    _finite("fp16.min_loss_scale", value, "a finite number > 0", zero_ok=False)
    rounded = 2.0 ** math.ceil(math.log2(value))
    if rounded < value:  # log2 rounding at the edge
        rounded *= 2.0
    if rounded != value:
        notes.append(f"fp16.min_loss_scale={value!r} is not a power of two; rounded up to {rounded!r}")
    return rounded


def _clipping(value: Any, precision: str, notes: list[str]) -> float | None:
    _finite("gradient_clipping", value, "a finite number >= 0 (0 = no clipping)", zero_ok=True)
    return None if value == 0 else float(value)


def _dtype_choice(key: str, what: str, value: Any, precision: str) -> str:
    """A DeepSpeed dtype name -> ``"fp32"`` or ``"param"`` (the configured 16-bit precision)."""
    if value in ("fp32", "float32"):
        return "fp32"
    if value in ("fp16", "bf16") and value == precision:
        return "param"
    raise ValueError(
        f"{key}={value!r} with precision={precision!r}: halfprec {what} in fp32 or in the params' dtype; use "
        "'fp32'" + (f" or {precision!r}" if precision != "fp32" else "")
    )


def _reduce_dtype(value: Any, precision: str, notes: list[str]) -> str:
    return "fp32" if value is None else _dtype_choice("communication_data_type", "reduces", value, precision)


def _grad_accum_dtype(value: Any, precision: str, notes: list[str]) -> str:
    if value is None:  # DeepSpeed's "not set": halfprec's default
        return "auto"
    return _dtype_choice("data_types.grad_accum_dtype", "accumulates micro-batch grads", value, precision)


def _map(key: str, field: str, detail: str = "", convert: Callable | None = None) -> DeepSpeedKey:
    """A row that sets ``field`` (the docs' table shows it followed by ``detail``)."""
    return DeepSpeedKey(key, "mapped", field + detail, field=field, convert=convert)


def _flag(key: str, action: Literal["warn", "error"], why: str) -> DeepSpeedKey:
    """A row for a DeepSpeed switch that halfprec honours when it is off."""
    return DeepSpeedKey(key, action, why, _off, "false")


# word lists (SIM905): one name a line would take 40 lines
_PERF_KNOBS = """overlap_comm contiguous_gradients reduce_scatter reduce_bucket_size allgather_partitions
    allgather_bucket_size use_multi_rank_bucket_allreduce round_robin_gradients sub_group_size
    ignore_unused_parameters elastic_checkpoint legacy_stage1 compute_grad_norm parameter_alignment
    zero_hpz_partition_size zero_quantized_weights zero_quantized_nontrainable_weights zero_quantized_gradients
    zeropp_loco_param mics_shard_size mics_hierarchical_params_gather log_trace_cache_warnings
    enable_sanity_checks""".split()  # noqa: SIM905
# ZeRO-3 keys that DeepSpeed also reads with a stage3_ prefix
_Z3_KNOBS = """prefetch_bucket_size param_persistence_threshold model_persistence_threshold max_live_parameters
    max_reuse_distance gather_16bit_weights_on_model_save module_granularity_threshold
    use_all_reduce_for_fetch_params allgather_sequential partition_stream_chunk_size""".split()  # noqa: SIM905
_Z3_ONLY = """stage3_gather_fp16_weights_on_model_save memory_efficient_linear pipeline_loading_checkpoint
    override_module_apply save_muon_momentum_buffer_in_memory leaf_module""".split()  # noqa: SIM905

DEEPSPEED_KEYS: tuple[DeepSpeedKey, ...] = (
    _map("gradient_clipping", "max_grad_norm", " (0 = no clipping = None)", _clipping),
    _map("gradient_accumulation_steps", "gradient_accumulation_steps"),
    _map("communication_data_type", "reduce_dtype", f" {_DTYPES}", _reduce_dtype),
    _map("data_types.grad_accum_dtype", "grad_accum_dtype", f" {_DTYPES}", _grad_accum_dtype),
    _K("fp16.enabled", "mapped", "precision='fp16'"),
    _map("fp16.loss_scale", "static_loss_scale", " (0 = dynamic = None; else a power of two)", _loss_scale),
    _map("fp16.initial_scale_power", _INIT_SCALE, " = 2**p", _initial_scale),
    _map("fp16.loss_scale_window", "growth_interval"),
    _map(
        "fp16.hysteresis", "hysteresis", " (budget refilled on growth and on backoff; DeepSpeed: growth only)"
    ),
    _map("fp16.min_loss_scale", "min_scale", " (rounded up to a power of two, with a warning)", _min_scale),
    _flag("fp16.consecutive_hysteresis", "warn", "halfprec refills hysteresis only on growth and backoff"),
    _K(
        "fp16.auto_cast",
        "warn",
        "the engine casts floating inputs to the model dtype either way (16-bit inputs, which a DeepSpeed run "
        "with auto_cast=false passes, stay as they are)",
        lambda value: isinstance(value, bool),
        "true or false",
    ),
    _flag(
        "fp16.fp16_master_weights_and_grads",
        "error",
        "halfprec always keeps fp32 masters and does not offload",
    ),
    _K("bf16.enabled", "mapped", "precision='bf16' (legacy block name 'bfloat16' too)"),
    _map("bf16.check_grad_overflow", "skip_nonfinite"),
    _flag("bf16.immediate_grad_update", "warn", "halfprec accumulates grads in .grad until the step"),
    _flag("bf16.bf16_master_weights_and_grads", "error", "halfprec always keeps fp32 masters"),
    _flag("bf16.bf16_optimizer_states", "error", "halfprec keeps optimizer state on fp32 masters"),
    _map(
        "zero_optimization.stage",
        "zero_stage",
        " (3: fully_shard inside initialize, the policy in Config.zero_stage)",
    ),
    _K("zero_optimization.offload_optimizer", "error", _NO_OFFLOAD, _no_offload, "device 'none'"),
    _K("zero_optimization.offload_param", "error", _NO_OFFLOAD, _no_offload, "device 'none'"),
    _flag("zero_optimization.cpu_offload", "error", f"{_NO_OFFLOAD} (deprecated key)"),
    _flag("zero_optimization.cpu_offload_param", "error", f"{_NO_OFFLOAD} (deprecated key)"),
    _K("zero_optimization.zenflow", "error", f"ZenFlow is CPU-offload based; {_NO_OFFLOAD}", _off, "null"),
    _K("zero_optimization.cpu_offload_use_pin_memory", "warn", "no offload, so nothing to pin"),
    _flag("zero_optimization.load_from_fp32_weights", "warn", "halfprec always restores fp32 masters"),
    *(_K(f"zero_optimization.{k}", "warn", _PERF) for k in _PERF_KNOBS),
    *(_K(f"zero_optimization.{k}", "warn", _Z3) for name in _Z3_KNOBS for k in (name, f"stage3_{name}")),
    *(_K(f"zero_optimization.{k}", "warn", _Z3) for k in _Z3_ONLY),
)


def render_deepspeed_table() -> str:
    """``DEEPSPEED_KEYS`` as a Markdown table (the one in docs/deepspeed-config.md)."""
    action = {"mapped": "mapped", "warn": "accepted, warning", "error": "error"}
    lines = ["| DeepSpeed key | action | halfprec | no warning/error when |", "|---|---|---|---|"]
    for row in DEEPSPEED_KEYS:
        lines.append(f"| `{row.key}` | {action[row.action]} | {row.target} | {row.quiet_text} |")
    return "\n".join(lines) + "\n"


_ROWS = {row.key: row for row in DEEPSPEED_KEYS}
_TOP_KEYS = tuple(key for key in _ROWS if "." not in key)
_BLOCKS = ("fp16", "bf16", "bfloat16", "zero_optimization", "data_types")
_OWNED_TOP = (*_BLOCKS, *_TOP_KEYS)
_C = TypeVar("_C")


def read_deepspeed(cls: type[_C], cfg: Mapping[str, Any] | str | os.PathLike) -> _C:
    """``cls(**fields)`` from a DeepSpeed config; ``cls`` is ``halfprec.Config`` (see ``Config.from_deepspeed``)."""
    defaults = cls()  # halfprec's defaults, named in the notes about 'auto'
    if isinstance(cfg, (str, os.PathLike)):
        path = os.fspath(cfg)
        if not os.path.isfile(path):
            text = isinstance(cfg, str) and cfg.lstrip().startswith("{")
            raise ValueError(
                f"DeepSpeed config {path!r} {'is not a file' if os.path.exists(path) else 'does not exist'}"
                + (
                    ": it looks like JSON text; pass json.loads(text), a dict, or the path of the JSON file"
                    if text
                    else f"{' (it is a directory)' if os.path.isdir(path) else ''}: pass the path of the JSON "
                    "file, or the config as a dict"
                )
            )
        with open(path, encoding="utf-8") as f:
            try:
                cfg = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"DeepSpeed config {path} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}; fix "
                    "the file there (JSON has no comments and no trailing commas)"
                ) from None
    if not isinstance(cfg, Mapping):
        raise ValueError(f"a DeepSpeed config is a dict (or a JSON file path), got {type(cfg).__name__}")
    _check_keys(cfg, "the DeepSpeed config")
    notes: list[str] = []
    if "bf16" in cfg and "bfloat16" in cfg:
        raise ValueError(
            "the DeepSpeed config has both 'bf16' and its legacy name 'bfloat16'; keep only 'bf16'"
        )
    flat: dict[str, Any] = {}  # dotted key -> value, for every key inside the blocks halfprec owns
    for name in _BLOCKS:
        if name not in cfg:
            continue
        block = cfg[name]
        if name == "zero_optimization" and isinstance(block, bool):
            notes.append(
                f"zero_optimization={block!r} is DeepSpeed's deprecated form; read as stage {int(block)}"
            )
            block = {"stage": int(block)}
        if not isinstance(block, Mapping):
            raise ValueError(f"DeepSpeed '{name}' must be a dict, got {block!r}")
        _check_keys(block, f"DeepSpeed '{name}'")
        prefix = "bf16" if name == "bfloat16" else name
        flat.update({f"{prefix}.{k}": v for k, v in block.items()})
    flat.update({k: cfg[k] for k in _TOP_KEYS if k in cfg})

    unknown = [k for k in flat if k not in _ROWS]
    if unknown:
        listed = "; ".join(k + did_you_mean(k, _ROWS) for k in unknown)
        raise ValueError(
            f"unknown DeepSpeed config key(s) inside blocks halfprec owns: {listed}. Remove them or fix the "
            "spelling; docs/deepspeed-config.md lists every key halfprec knows"
        )
    refused = []
    for key, value in flat.items():
        row = _ROWS[key]
        if row.action == "mapped" or (row.quiet is not None and row.quiet(value)):
            continue
        if value == "auto":
            notes.append(f"{key}='auto': halfprec's default (not applied: {row.target})")
        elif row.action == "warn":
            notes.append(f"{key}={value!r}: accepted, not applied ({row.target})")
        else:
            refused.append(f"{key}={value!r} ({row.target}; remove it or set it to {row.quiet_text})")
    if refused:
        raise ValueError("DeepSpeed config asks for what halfprec does not do: " + "; ".join(refused))

    precision = _precision(flat, notes)
    fields: dict[str, Any] = {"precision": precision}
    sources = {"precision": "fp16.enabled/bf16.enabled"}  # field -> DeepSpeed key, for Config's errors
    off = {"fp16", "bf16"} - {precision}  # the block of the precision not chosen: validated, not applied
    unused = [k for k in flat if k.split(".")[0] in off and _ROWS[k].field]
    if unused:
        notes.append(f"precision is {precision!r}, so these were not applied: {', '.join(unused)}")
    for row in DEEPSPEED_KEYS:
        key, field = row.key, row.field
        if not field or key.partition(".")[0] in off or key not in flat:
            continue
        if flat[key] == "auto":
            notes.append(f"{key}='auto': halfprec's default {field}={getattr(defaults, field)!r}")
            continue
        fields[field] = flat[key] if row.convert is None else row.convert(flat[key], precision, notes)
        sources[field] = key

    ignored = [k for k in cfg if k not in _OWNED_TOP]
    if ignored:
        notes.append(f"top-level keys halfprec does not own, not applied: {', '.join(ignored)}")
    try:
        config = cls(**fields)
    except ValueError as e:
        keys = [key for field, key in sources.items() if field in str(e)]
        raise ValueError(f"{e} (from DeepSpeed {', '.join(keys) or 'config'})") from None
    if notes:
        warnings.warn(
            "Config.from_deepspeed:\n  - " + "\n  - ".join(notes), DeepSpeedConfigWarning, stacklevel=3
        )
    return config


def _check_keys(mapping: Mapping[Any, Any], where: str) -> None:
    """Keys are strings, as JSON's are: a dict built in Python may hold others."""
    odd = next((key for key in mapping if not isinstance(key, str)), None)
    if odd is not None:
        raise ValueError(
            f"{where} has the {type(odd).__name__} key {odd!r}; DeepSpeed config keys are strings, as in JSON: "
            f"write it as {str(odd)!r} or remove it"
        )


def _precision(flat: dict[str, Any], notes: list[str]) -> str:
    """fp16/bf16 ``enabled``: explicit true wins; 'auto' means halfprec's default (bf16); neither means fp32."""
    enabled = {}
    for name in ("fp16", "bf16"):
        value = flat.get(f"{name}.enabled", False)
        if not isinstance(value, bool) and value != "auto":
            raise ValueError(f"{name}.enabled must be true, false or 'auto', got {value!r}")
        enabled[name] = value
    if enabled["fp16"] is True and enabled["bf16"] is True:
        raise ValueError("both fp16.enabled and bf16.enabled are true; enable one of them")
    for name, other in (("fp16", "bf16"), ("bf16", "fp16")):
        if enabled[name] is True:
            if enabled[other] == "auto":
                notes.append(
                    f"{other}.enabled='auto' with {name}.enabled=true: {name} is used, {other} stays off"
                )
            return name
    autos = [f"{name}.enabled" for name in ("fp16", "bf16") if enabled[name] == "auto"]
    if not autos:
        return "fp32"
    if enabled["bf16"] is False and "bf16.enabled" in flat:
        raise ValueError(
            "fp16.enabled is 'auto' and bf16.enabled is false: 'auto' means halfprec's default (bf16), which the "
            "config disables; set fp16.enabled to true or false"
        )
    notes.append(f"{' and '.join(autos)} = 'auto': halfprec's default precision='bf16'")
    return "bf16"
