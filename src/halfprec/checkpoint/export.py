"""Consolidated weights from a checkpoint of any layout (the fp32 masters under the model's state-dict names),
for ``halfprec export`` and ``halfprec inspect`` (:func:`describe`: ``inspect`` would shadow the stdlib's)."""

from __future__ import annotations

import os
import re
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from ..optim.names import clean_keys, clean_name
from ..precision import DTYPES
from .atomic import fsync_path, remove_leftovers, tmp_dir, unique_suffix
from .directory import reading, save_safetensors
from .manifest import DCP, ENGINE_SHARDED, layout_of
from .read import load_pt, load_weights, verify

__all__ = ["consolidated_weights", "export", "describe"]


def consolidated_weights(path: str | os.PathLike, *, dtype: str = "fp32") -> dict[str, torch.Tensor]:
    """Every key of the model's state dict, by clean name (``optim/names.py``: a model saved compiled as the model
    itself); trained params from their fp32 masters, cast to ``dtype``.

    Tied weights appear under each of their names as separate tensors, so a strict ``load_state_dict`` works.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    path = Path(path)
    if layout_of(path) == DCP:
        from .consolidate import consolidate  # noqa: PLC0415 - imports torch.distributed.checkpoint

        weights, masters, ties = consolidate(path), {}, {}
    else:
        manifest, weights, masters, _ = _read_engine(path)
        ties = manifest.get("ties", {})
    out = {}
    for key, tensor in weights.items():
        value = masters.get(clean_name(key), tensor)
        out[key] = (value.to(DTYPES[dtype]) if value.is_floating_point() else value).clone().contiguous()
    for alias, name in ties.items():
        out[alias] = out[name].clone()
    # the model's own names: a checkpoint from before names were cleaned holds torch.compile's `_orig_mod.`
    return clean_keys(out)


def _read_engine(path: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, torch.Tensor], str]:
    """``(manifest, weights, masters, optimizer)`` of an engine checkpoint, read under its directory's lock and
    verified as a load verifies it (:func:`read.verify`: the counters in its manifest are those its files hold,
    so what ``inspect`` shows is what a load restores); the fp32 masters by clean parameter name."""
    with reading(path.parent):
        manifest = verify(path)
        weights = load_weights(path, manifest)
        if layout_of(path, manifest) == ENGINE_SHARDED:
            from .consolidate import masters_of, read_checkpoint  # noqa: PLC0415 - written by a ZeRO-1/2 engine

            items = read_checkpoint(path / "optimizer")
            # kind/optimizer/<name> sorts before kind/scaler/<name>
            kinds = [k.rpartition("/")[2] for k in sorted(items) if k.startswith("kind/")]
            masters, optimizer = masters_of(items), f"{', '.join(kinds)} (reshardable)"
        else:
            names, optim = load_pt(path, "engine")["param_names"], load_pt(path, "optimizer")
            masters = {
                clean_name(names[int(i)]): m for i, m in optim["masters"].items() if names[int(i)] is not None
            }
            optimizer = f"MixedPrecisionOptimizer, {optim['scaler']['type']}"
    return manifest, weights, masters, optimizer


def export(path: str | os.PathLike, out: str | os.PathLike, *, dtype: str = "fp32") -> Path:
    """Write :func:`consolidated_weights` to the safetensors file ``out``, whole or not at all (renamed from a
    hidden temporary directory next to it, which the next export removes if this one is killed)."""
    out = Path(out)
    if out.is_dir():
        raise IsADirectoryError(
            f"cannot write the weights to {out}: it is a directory; pass the path of the file to write, e.g. "
            f"{out / 'model.safetensors'}"
        )
    weights = consolidated_weights(path, dtype=dtype)
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_leftovers(out.parent, re.compile(rf"\.{re.escape(out.name)}\.tmp-[0-9a-f]{{8}}"))
    with tmp_dir(out.parent / f".{out.name}.tmp-{unique_suffix()}") as tmp:
        file = tmp / out.name
        save_safetensors(weights, file, {"format": "pt", "source": str(path), "dtype": dtype})
        fsync_path(file)
        os.replace(file, out)
    return out


def describe(path: str | os.PathLike) -> list[tuple[str, Any]]:
    """Rows (field, value) describing a checkpoint: counters, scale, dtypes, sizes."""
    path = Path(path)
    if layout_of(path) == DCP:
        return _describe_dcp(path)
    manifest, weights, masters, optimizer = _read_engine(path)
    scale = manifest.get("loss_scale")
    rows: list[tuple[str, Any]] = [
        ("path", str(path)),
        ("tag", manifest["tag"]),
        ("global_step", manifest.get("global_step")),
        ("skipped_steps", manifest.get("skipped_steps")),
        ("precision", manifest.get("precision")),
        ("optimizer", optimizer),
        ("loss scale", f"{scale:g}" if isinstance(scale, (int, float)) else scale),
        ("tensors", len(weights)),
        ("tied names", len(manifest.get("ties", {}))),
        ("elements by dtype", _by_dtype(weights.values())),
        ("master params", len(masters)),
    ]
    for name, entry in sorted(manifest["files"].items()):
        rows.append((f"file {name}", f"{entry['size']:,} bytes"))
    return rows


def _by_dtype(tensors) -> str:
    counts: Counter[str] = Counter()
    for tensor in tensors:
        counts[str(tensor.dtype).replace("torch.", "")] += tensor.numel()
    return ", ".join(f"{k}: {v:,}" for k, v in sorted(counts.items()))


def _describe_dcp(path: Path) -> list[tuple[str, Any]]:
    """Rows for a bare DCP optimizer checkpoint (``halfprec.distributed.checkpoint.save``), from its items."""
    from .consolidate import hparam_groups, read_checkpoint  # noqa: PLC0415 - imports torch.distributed.checkpoint

    items = read_checkpoint(path)
    masters = {k: v for k, v in items.items() if k.startswith("master/")}
    version = int(items["format/version"])
    rows: list[tuple[str, Any]] = [
        ("path", str(path)),
        ("format", f"halfprec DCP optimizer checkpoint, version {version} (reshardable)"),
        ("skipped_steps", int(items["counters/skipped_steps"])),
    ]
    if "scaler/scale" in items:
        rows.append(("loss scale", f"{float(items['scaler/scale']):g}"))
    for gi in sorted(hparam_groups(items)):
        if f"hparam/{gi}/lr" in items:
            rows.append((f"group {gi} lr", f"{float(items[f'hparam/{gi}/lr']):g}"))
    rows += [
        ("master params", len(masters)),
        ("elements by dtype", _by_dtype(masters.values())),
        ("state items", sum(k.startswith("state/") for k in items)),
    ]
    for file in sorted(p for p in path.iterdir() if p.is_file()):
        rows.append((f"file {file.name}", f"{file.stat().st_size:,} bytes"))
    return rows
