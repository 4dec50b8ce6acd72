"""The names that key checkpoints and state dicts: a param's (or buffer's) name in its model, as written.

``torch.compile(model)`` returns a wrapper (``OptimizedModule``) that holds the model as its ``_orig_mod``, so every
name of the compiled model starts with ``_orig_mod.`` (``_orig_mod.0.weight``), and a compiled submodule puts the
component in the middle (``layers.0._orig_mod.attn.weight``). Checkpoints are keyed by :func:`clean_name`, the name
without those components, as ``torch.distributed.checkpoint.state_dict`` keys them (its ``_get_fqns`` drops the
``_orig_mod`` step of each compiled module on the path): a checkpoint written from the model compiled then loads
into it uncompiled, and back. Readers compare clean names on both sides, so checkpoints written before the names
were cleaned (``_orig_mod.`` in them) load into either too. What the component is dropped from is the path, not
the text (torch's optimizer-state helper ``str.replace``s ``"_orig_mod."``, which would also cut
``my_orig_mod.w`` to ``myw``). Two names that clean to one name are refused, never merged.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

import torch

__all__ = ["clean_keys", "clean_name", "named_trainable", "uncompiled"]

_COMPILED = "_orig_mod"  # the attribute of torch.compile's OptimizedModule that holds the model

V = TypeVar("V")


def uncompiled(module: torch.nn.Module) -> torch.nn.Module:
    """The model a ``torch.compile``d module wraps (through every wrapper); any other module as it is."""
    while isinstance(inner := getattr(module, _COMPILED, None), torch.nn.Module):
        module = inner
    return module


def clean_name(name: str) -> str:
    """``name`` without the ``_orig_mod`` components of compiled modules: ``_orig_mod.0.weight`` -> ``0.weight``."""
    return ".".join(part for part in name.split(".") if part != _COMPILED)


def clean_keys(named: Mapping[str, V], *, what: str = "tensors") -> dict[str, V]:
    """``named`` (a state dict, a checkpoint's weights) keyed by :func:`clean_name`, in its order; ValueError when
    two keys clean to one (``what`` names them in the message)."""
    out: dict[str, V] = {}
    first: dict[str, str] = {}
    for name, value in named.items():
        key = clean_name(name)
        if first.setdefault(key, name) != name:
            raise ValueError(
                f"the {what} {first[key]!r} and {name!r} are both named {key!r} without torch.compile's "
                f"{_COMPILED!r} components, which checkpoints are keyed by; rename one of them"
            )
        out[key] = value
    return out


def named_trainable(
    optimizer: torch.optim.Optimizer, named_parameters: Any
) -> tuple[list[str], list[torch.nn.Parameter], list[int]]:
    """Clean names, params and group indices of the optimizer's trainable params, in optimizer order."""
    pairs: Iterable = named_parameters
    if isinstance(named_parameters, torch.nn.Module):
        pairs = named_parameters.named_parameters()
    name_of: dict[int, str] = {}
    for item in pairs:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
            raise ValueError(
                "named_parameters must be an nn.Module or an iterable of (name, param) pairs, e.g. "
                "model.named_parameters()"
            )
        name_of.setdefault(id(item[1]), item[0])
    names, params, groups, seen = [], [], [], set()
    for gi, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) in seen:
                raise ValueError(f"param of shape {tuple(p.shape)} appears twice in the optimizer's groups")
            seen.add(id(p))
            if not p.requires_grad:
                continue
            name = name_of.get(id(p))
            if name is None:
                raise ValueError(
                    f"a trainable param of shape {tuple(p.shape)} in group {gi} has no name in named_parameters; "
                    "pass the model whose parameters the optimizer holds"
                )
            names.append(name)
            params.append(p)
            groups.append(gi)
    clean_keys(dict.fromkeys(names), what="params")  # two params under one clean name: refused
    return [clean_name(n) for n in names], params, groups
