"""`halfprec export CKPT --out FILE` and `halfprec inspect CKPT`. A bad checkpoint is the user's input, not a bug:
its message goes to stderr without a traceback, and the exit status is 2 (as argparse's for bad arguments)."""

from __future__ import annotations

import argparse
import os
import pickle
import sys
from collections.abc import Callable
from pathlib import Path

from ..checkpoint.export import describe, export
from ..checkpoint.manifest import CheckpointError
from ..checkpoint.read import resolve

__all__ = ["add_export_arguments", "add_inspect_arguments", "run_export", "run_inspect"]


def add_export_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--out",
        required=True,
        help="output .safetensors file (a file name, not a directory: e.g. newdir/model.safetensors; missing "
        "parent directories are made)",
    )
    parser.add_argument(
        "--dtype",
        choices=["fp32", "bf16", "fp16"],
        default="fp32",
        help="dtype of the written floating-point tensors, cast from the fp32 masters (default: fp32)",
    )
    add_inspect_arguments(parser)


def add_inspect_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("checkpoint", help="a checkpoint directory (a tag, or its parent with a 'latest' pointer)")
    add("--tag", default=None, help="tag inside the directory (default: the 'latest' pointer)")


def _run(command: str, args: argparse.Namespace, lines: Callable[[Path], list[str]]) -> int:
    """Print ``lines(checkpoint path)``, or the error of a bad checkpoint on one line."""
    from safetensors import SafetensorError
    from torch.distributed.checkpoint.api import CheckpointException

    # What a bad checkpoint raises: halfprec's errors, and those of the readers under them (a damaged safetensors
    # file, DCP metadata that is not DCP's, DCP data files that do not match their metadata).
    bad = (CheckpointError, ValueError, OSError, EOFError, pickle.UnpicklingError, SafetensorError,
           CheckpointException)  # fmt: skip
    try:
        text = lines(resolve(Path(args.checkpoint), args.tag, tag_option="--tag"))
    except bad as e:
        message = " ".join(str(e).split())  # one line, whatever the exception's text holds
        print(f"halfprec {command}: error: {message}", file=sys.stderr)
        return 2
    print(*text, sep="\n")
    return 0


def run_export(args: argparse.Namespace) -> int:
    # Path("newdir/") is Path("newdir"): without this check the weights would become a file named newdir.
    # An existing directory is refused by export() itself, before the checkpoint is read.
    out = str(args.out)
    if out.endswith(tuple(sep for sep in (os.sep, os.altsep) if sep)):
        fix = Path(out) / "model.safetensors"
        print(
            f"halfprec export: error: --out {out}: ends in a path separator, so it names a directory; "
            f"--out is the file to write: give a file name, e.g. --out {fix}",
            file=sys.stderr,
        )
        return 2
    return _run("export", args, lambda path: [f"wrote {export(path, out, dtype=args.dtype)}"])


def run_inspect(args: argparse.Namespace) -> int:
    def lines(path: Path) -> list[str]:
        rows = describe(path)
        width = max(len(k) for k, _ in rows)
        return [f"{key:<{width}}  {value}" for key, value in rows]

    return _run("inspect", args, lines)
