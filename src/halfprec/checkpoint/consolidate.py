"""Read a verified halfprec DCP optimizer checkpoint (any world size) into whole tensors, without a process group."""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..optim.names import clean_keys
from .safe_dcp import SafeFileSystemReader, open_checkpoint

__all__ = ["consolidate", "read_checkpoint", "read_items", "masters_of", "hparam_groups"]


def read_checkpoint(checkpoint_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every item of the checkpoint as a whole CPU tensor (masters and elementwise state stay 1-D)."""
    checkpoint_dir, metadata = open_checkpoint(checkpoint_dir)
    return _read(checkpoint_dir, metadata.state_dict_metadata)


def read_items(checkpoint_dir: str | os.PathLike, keys: Iterable[str]) -> dict[str, torch.Tensor]:
    """Those of the items ``keys`` that the checkpoint holds as tensors, for a caller that has verified its files
    (an engine checkpoint's manifest covers its ``optimizer/``): nothing else is read."""
    saved = SafeFileSystemReader(str(checkpoint_dir)).read_metadata().state_dict_metadata
    return _read(
        checkpoint_dir, {k: saved[k] for k in keys if isinstance(saved.get(k), TensorStorageMetadata)}
    )


def _read(
    checkpoint_dir: str | os.PathLike, saved: dict[str, TensorStorageMetadata]
) -> dict[str, torch.Tensor]:
    out = {key: torch.empty(tuple(md.size), dtype=md.properties.dtype) for key, md in saved.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: loading single-process" is what we want
        dcp.load(out, storage_reader=SafeFileSystemReader(str(checkpoint_dir)), no_dist=True)
    return out


def consolidate(checkpoint_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The FP32 master weights of a checkpoint, in their params' shapes, keyed by parameter name (clean: without
    torch.compile's ``_orig_mod.``)."""
    return masters_of(read_checkpoint(checkpoint_dir))


def masters_of(items: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The masters among a checkpoint's items (:func:`read_checkpoint`), in their params' shapes, by clean name
    (``optim/names.py``; a checkpoint from before names were cleaned may hold torch.compile's ``_orig_mod.``)."""
    out = {}
    for key, value in items.items():
        if key.startswith("master/"):
            name = key.removeprefix("master/")
            out[name] = value.view(tuple(items[f"shape/{name}"].tolist())).contiguous()
    return clean_keys(out, what="params")


def hparam_groups(items: Iterable[str]) -> dict[int, list[str]]:
    """``{group: [key, ...]}`` of a checkpoint's numeric hyper-parameter items (``hparam/{group}/{key}``)."""
    groups: dict[int, list[str]] = {}
    for _, gi, key in (item.split("/", 2) for item in items if item.startswith("hparam/")):
        groups.setdefault(int(gi), []).append(key)
    return groups
