"""Time one mixed-precision optimizer step on the GPU and print a table (same as ``halfprec bench``).

Usage: PYTHONPATH=src python benchmarks/bench_step.py [--workload 268M|1B] [--optimizers adamw,sgd,adagrad]
       [--dtypes float16,bfloat16] [--json out.json]
"""

from __future__ import annotations

import argparse
import sys

from halfprec.cli.bench import add_arguments, run

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
