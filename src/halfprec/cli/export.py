"""`halfprec export CKPT --out FILE` and `halfprec inspect CKPT`."""

from __future__ import annotations

import argparse

from .. import checkpoint as ckpt
from ..export import export, inspect

__all__ = ["add_export_arguments", "add_inspect_arguments", "run_export", "run_inspect"]


def add_export_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "checkpoint", help="a checkpoint directory (a tag, or its parent with a 'latest' pointer)"
    )
    parser.add_argument("--out", required=True, help="output .safetensors file")
    parser.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    parser.add_argument(
        "--tag", default=None, help="tag inside the directory (default: the 'latest' pointer)"
    )


def add_inspect_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "checkpoint", help="a checkpoint directory (a tag, or its parent with a 'latest' pointer)"
    )
    parser.add_argument("--tag", default=None)


def _path(args: argparse.Namespace):
    from pathlib import Path

    path = Path(args.checkpoint)
    if args.tag is None and (path / ".metadata").exists():
        return path
    return ckpt.resolve(path, args.tag)


def run_export(args: argparse.Namespace) -> int:
    out = export(_path(args), args.out, dtype=args.dtype)
    print(f"wrote {out}")
    return 0


def run_inspect(args: argparse.Namespace) -> int:
    rows = inspect(_path(args))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 0
