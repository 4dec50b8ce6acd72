"""`halfprec` command: argparse at the edge, each subcommand a small module with add_arguments() and run()
(``add_<command>_arguments()`` and ``run_<command>()`` when one module serves several commands)."""

from __future__ import annotations

import argparse
import importlib
import sys

# __version__ from the package itself (not importlib.metadata): also right in a source checkout on PYTHONPATH.
from .. import __version__

__all__ = ["main"]

# subcommand -> (module, one-line help)
_COMMANDS = {
    "demo": ("halfprec.cli.demo", "train a small byte-level GPT in FP32, BF16 and FP16 and compare them"),
    "bench": ("halfprec.cli.bench", "time the optimizer step against the memory-bandwidth floor (GPU)"),
    "export": ("halfprec.cli.export", "write a checkpoint's consolidated FP32 weights to safetensors"),
    "inspect": ("halfprec.cli.export", "print a checkpoint's counters, loss scale, dtypes and sizes"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="halfprec", description="Exact, fast mixed-precision training.")
    parser.add_argument("--version", action="version", version=f"halfprec {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(_COMMANDS) + "}")
    wanted = argv[0] if argv and argv[0] in _COMMANDS else None
    for name, (module_name, help_text) in _COMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        if name == wanted:  # import only the module of the command that runs
            module = importlib.import_module(module_name)
            (getattr(module, f"add_{name}_arguments", None) or module.add_arguments)(sub_parser)
    args = parser.parse_args(argv)
    module = importlib.import_module(_COMMANDS[args.command][0])
    return int((getattr(module, f"run_{args.command}", None) or module.run)(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
