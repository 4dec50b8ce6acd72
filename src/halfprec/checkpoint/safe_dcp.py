"""DCP plumbing: a metadata reader that runs no code from the file, and planners for 1-D chunks of tensors.

DCP's ``FileSystemReader.read_metadata`` is a plain ``pickle.load`` of ``.metadata``, and its byte items are
read with ``torch.load(weights_only=False)``: either can run arbitrary code. Here ``.metadata`` is unpickled
through an allow-list, and byte items are refused before they are read.

A sharded optimizer owns a contiguous range ``[lo, hi)`` of each flattened param: the planners write and read
such a range as a chunk of the 1-D global tensor, so DCP reshards between any two world sizes.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    create_default_local_load_plan,
    create_default_local_save_plan,
)
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from .atomic import located
from .manifest import read_dcp_manifest

__all__ = ["SafeFileSystemReader", "ChunkSavePlanner", "ChunkLoadPlanner", "open_checkpoint"]

_METADATA_CLASSES = """Metadata TensorStorageMetadata BytesStorageMetadata ChunkStorageMetadata TensorProperties
    MetadataIndex StorageMeta _MEM_FORMAT_ENCODING"""
_ALLOWED = {
    *(("torch.distributed.checkpoint.metadata", name) for name in _METADATA_CLASSES.split()),
    *(("pathlib", name) for name in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # maps a layout's name ("torch.strided") to the layout object
    ("collections", "OrderedDict"),
}


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(
            f"refusing to load {module}.{name} from a checkpoint's .metadata: only DCP's metadata classes are "
            "allowed (the file may have been tampered with)"
        )


def _read_metadata(path: str | os.PathLike) -> Metadata:
    """Unpickle ``path/.metadata`` allowing only DCP's metadata classes."""
    with open(Path(path) / ".metadata", "rb") as f:
        metadata = _RestrictedUnpickler(f).load()
    if not isinstance(metadata, Metadata):
        raise pickle.UnpicklingError(f"{path}/.metadata holds a {type(metadata).__name__}, not DCP Metadata")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose ``read_metadata`` runs no code from the file."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = _read_metadata(self.path)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def open_checkpoint(path: str | os.PathLike) -> tuple[Path, Metadata]:
    """``(where, metadata)`` of the DCP checkpoint at ``path`` (``atomic.located``), checked before any item is
    read: complete (a ``.metadata``), every file as its manifest records it (``manifest.read_dcp_manifest``), no
    item a pickled object (a byte item) that loading would unpickle, and a halfprec optimizer checkpoint's items."""
    path = located(Path(path))  # a replace that died midway left the previous checkpoint aside
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(
            f"{path} is not a complete DCP checkpoint (no .metadata); was the save interrupted?"
        )
    read_dcp_manifest(path)
    metadata = _read_metadata(path)
    for key, md in metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            raise ValueError(
                f"checkpoint item {key!r} is a pickled Python object; halfprec checkpoints hold tensors only and "
                "never unpickle items (that could run code from the file)"
            )
    if "format/version" not in metadata.state_dict_metadata:
        raise ValueError(f"{path} is not a halfprec optimizer checkpoint (no format/version item)")
    return path, metadata


class ChunkSavePlanner(DefaultSavePlanner):
    """Writes ``state_dict[fqn]`` for ``fqn`` in ``chunks`` as elements ``[offset, offset + n)`` of a 1-D tensor
    of ``total`` elements; every other entry as ``DefaultSavePlanner`` does."""

    def __init__(self, chunks: dict[str, tuple[int, int]]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.chunks = chunks

    def create_local_plan(self):
        plain = {k: v for k, v in self.state_dict.items() if k not in self.chunks}
        plan = create_default_local_save_plan(plain, self.is_coordinator)
        items = list(plan.items)
        for fqn, (offset, total) in self.chunks.items():
            tensor = self.state_dict[fqn]
            items.append(
                WriteItem(
                    index=MetadataIndex(fqn, torch.Size([offset])),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(offsets=torch.Size([offset]), sizes=tensor.size()),
                        properties=TensorProperties.create_from_tensor(tensor),
                        size=torch.Size([total]),
                    ),
                )
            )
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        if index.fqn in self.chunks:
            return self.state_dict[index.fqn]
        return super().lookup_object(index)


class ChunkLoadPlanner(DefaultLoadPlanner):
    """Reads ``state_dict[fqn]`` for ``fqn`` in ``chunks`` (``fqn -> offset``) from a 1-D saved tensor."""

    def __init__(self, chunks: dict[str, int]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.chunks = chunks

    def create_local_plan(self):
        plain = {k: v for k, v in self.state_dict.items() if k not in self.chunks}
        plan = create_default_local_load_plan(plain, self.metadata, True)
        items = list(plan.items)
        for fqn, offset in self.chunks.items():
            tensor = self.state_dict[fqn]
            local = ChunkStorageMetadata(offsets=torch.Size([offset]), sizes=tensor.size())
            items.extend(
                create_read_items_for_chunk_list(fqn, self.metadata.state_dict_metadata[fqn], [local])
            )
        return dataclasses.replace(plan, items=items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        if index.fqn in self.chunks:
            return self.state_dict[index.fqn]
        return super().lookup_tensor(index)
