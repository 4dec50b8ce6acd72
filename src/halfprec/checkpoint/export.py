"""Consolidated weights from a checkpoint: the fp32 masters under the model's own state-dict names."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from . import checkpoint as ckpt

__all__ = ["consolidated_weights", "export", "inspect"]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def consolidated_weights(path: str | os.PathLike, *, dtype: str = "fp32") -> dict[str, torch.Tensor]:
    """Every key of the model's state dict; trained params from their fp32 masters, cast to ``dtype``.

    Tied weights appear under each of their names as separate tensors, so a strict ``load_state_dict`` works.
    """
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    target = _DTYPES[dtype]
    path = Path(path)
    if (path / ".metadata").exists():
        from .distributed import consolidate  # noqa: PLC0415 - sharded (DCP) checkpoints

        weights = consolidate(path)
        return {k: (v.to(target) if v.is_floating_point() else v) for k, v in weights.items()}
    manifest = ckpt.read_manifest(path)
    weights = ckpt.load_weights(path, manifest)
    masters = _named_masters(path)
    out = {}
    for key, tensor in weights.items():
        value = masters.get(key, tensor)
        out[key] = (value.to(target) if value.is_floating_point() else value).clone().contiguous()
    for alias, name in manifest.get("ties", {}).items():
        out[alias] = out[name].clone()
    return out


def _named_masters(path: Path) -> dict[str, torch.Tensor]:
    """The fp32 masters of an engine checkpoint by parameter name (sharded: from its DCP optimizer files)."""
    if (path / "optimizer" / ".metadata").exists():
        from .distributed import consolidate  # noqa: PLC0415 - written by a ZeRO-1/2 engine

        return consolidate(path / "optimizer")
    names = ckpt.load_pt(path, "engine")["param_names"]
    optim = ckpt.load_pt(path, "optimizer")
    return {names[int(i)]: m for i, m in optim["masters"].items() if names[int(i)] is not None}


def export(path: str | os.PathLike, out: str | os.PathLike, *, dtype: str = "fp32") -> Path:
    """Write :func:`consolidated_weights` to a safetensors file loadable with ``safetensors.torch.load_file``."""
    from safetensors.torch import save_file

    weights = consolidated_weights(path, dtype=dtype)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    save_file(weights, str(tmp), metadata={"format": "pt", "source": str(path), "dtype": dtype})
    os.replace(tmp, out)
    return out


def inspect(path: str | os.PathLike) -> list[tuple[str, Any]]:
    """Rows (field, value) describing a checkpoint: counters, scale, dtypes, sizes."""
    path = Path(path)
    manifest = ckpt.read_manifest(path)
    weights = ckpt.load_weights(path, manifest)
    dtypes: dict[str, int] = {}
    for tensor in weights.values():
        name = str(tensor.dtype).replace("torch.", "")
        dtypes[name] = dtypes.get(name, 0) + tensor.numel()
    sharded = (path / "optimizer" / ".metadata").exists()
    scaler = None if sharded else ckpt.load_pt(path, "optimizer")["scaler"]["type"]
    rows: list[tuple[str, Any]] = [
        ("path", str(path)),
        ("tag", manifest["tag"]),
        ("global_step", manifest["global_step"]),
        ("skipped_steps", manifest["skipped_steps"]),
        ("precision", manifest["precision"]),
        ("optimizer", "sharded (DCP, reshardable)" if sharded else f"MixedPrecisionOptimizer, {scaler}"),
        ("loss scale", f"{manifest['loss_scale']:g}"),
        ("tensors", len(weights)),
        ("tied names", len(manifest.get("ties", {}))),
        ("elements by dtype", ", ".join(f"{k}: {v:,}" for k, v in sorted(dtypes.items()))),
        ("master params", len(_named_masters(path))),
    ]
    for name, entry in sorted(manifest["files"].items()):
        rows.append((f"file {name}", f"{entry['size']:,} bytes"))
    return rows
