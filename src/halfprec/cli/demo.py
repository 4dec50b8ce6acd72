"""``halfprec demo``: train one small GPT in FP32, BF16 and FP16 and compare; then prove resume is bit-exact.

Each precision trains in a fresh child process (so its peak memory is its own) from the same fp32 init and
batches, through ``halfprec.initialize``; the resume check runs in one precision's child (``_resume_check``),
and a mismatch makes the exit status non-zero.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from multiprocessing import get_context
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.nn.functional as F

import halfprec

from .demo_data import Corpus, load_corpus, stdlib_files
from .demo_model import GPT, GPTConfig

__all__ = ["add_arguments", "run"]

PRECISIONS = ("fp32", "bf16", "fp16")


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    """One precision's run: everything a child process needs (picklable)."""

    precision: str
    device: str
    steps: int
    batch_size: int
    seq_len: int
    n_layer: int
    n_embd: int
    lr: float
    seed: int
    threads: int
    eval_every: int
    eval_batches: int
    corpus_bytes: int | None
    checkpoint_dir: str
    resume_at: int | None = None
    """Save at this step and run the resume check (one precision only)."""
    later_seconds: float = 0.0
    """The estimated seconds of the runs after this one: the progress bar's ETA is for the whole demo."""
    break_resume: bool = False
    """Test hook: perturb one weight after loading, so the check must fail."""


@dataclass
class RunResult:
    precision: str
    losses: list[float] = field(default_factory=list)
    loss_scales: list[float] = field(default_factory=list)
    skipped: list[bool] = field(default_factory=list)
    val_curve: list[tuple[int, float]] = field(default_factory=list)
    val_loss: float = math.nan
    train_loss: float = math.nan
    tokens_per_s: float = math.nan
    peak_memory: str = "n/a"
    skipped_steps: int = 0
    loss_scale: float = 1.0
    resume: str | None = None
    """The resume check's verdict, one line; ``None`` when this run did not do the check."""
    resume_ok: bool = True


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--device", choices=("cpu", "cuda"), default="cpu", help="where to train (default: cpu)")
    add("--steps", type=int, default=200, help="optimizer steps per precision (default: 200)")
    add("--precisions", default=",".join(PRECISIONS), help="comma-separated subset of fp32,bf16,fp16")
    add("--out", type=Path, default="halfprec-demo", help="plot and checkpoint folder (default: %(default)s)")
    add("--seed", type=int, default=0, help="seeds the model's init and the batches (default: 0)")
    add("--batch-size", type=int, default=16, help="sequences per step (default: 16)")
    add("--seq-len", type=int, default=128, help="bytes per sequence (default: 128)")
    add("--n-layer", type=int, default=3, help="transformer blocks (default: 3)")
    add("--n-embd", type=int, default=128, help="model width, a multiple of 4 (default: 128)")
    add("--lr", type=float, default=3e-3, help="peak AdamW learning rate (default: 3e-3)")
    add("--threads", type=int, help="torch threads (default: idle cores it may use, minus one; at least 1)")
    add("--corpus-bytes", type=int, default=None, help="read at most this many stdlib bytes (default: all)")
    add("--resume-check", default="auto", help="precision to resume-check, or 'none' (default: fp16 if run)")
    add("--break-resume", action="store_true", help=argparse.SUPPRESS)  # test hook: the check must then fail


def run(args: argparse.Namespace) -> int:
    # Every flag is checked here, before a minute of training, and nothing is written until they pass.
    try:
        specs = _specs(args)
        _check_out(args.out)
        _check_extras()
    except (ValueError, ImportError) as e:
        print(f"halfprec demo: {e}", file=sys.stderr)
        return 2
    model = GPT(GPTConfig(seq_len=args.seq_len, n_layer=args.n_layer, n_embd=args.n_embd))
    print(
        f"halfprec demo: a {model.num_params() / 1e6:.2f}M-param byte-level GPT ({args.n_layer}-layer, "
        f"width {args.n_embd}) on the {len(stdlib_files())} source files of Python {sys.version.split()[0]}'s "
        "standard library\n"
        f"{args.steps} steps x {args.batch_size} x {args.seq_len} bytes per precision, AdamW, clip 1.0; "
        f"device {args.device}, {specs[0].threads} torch thread(s), seed {args.seed}",
        flush=True,
    )
    seconds = _estimate_seconds(specs)
    specs = [replace(s, later_seconds=sum(seconds[i + 1 :])) for i, s in enumerate(specs)]
    print(
        f"expected duration: about {_minutes(sum(seconds))} at this machine's current load "
        "(3 steps per precision timed just now; the progress bars update it)",
        flush=True,
    )
    start = time.perf_counter()
    # One child per precision, one after another: each starts from a clean process, so its peak RSS is its
    # own, and the runs never compete for the cores. "spawn" because forking a process that has used
    # torch's thread pool (or CUDA) is unsafe.
    results = []
    for spec in specs:
        with ProcessPoolExecutor(max_workers=1, mp_context=get_context("spawn")) as pool:
            results.append(pool.submit(train_precision, spec).result())

    print(f"\n{_table(results, args.device)}")
    png = _plot(results, args.out / "demo.png")
    print(f"\nplot (loss curves, difference to fp32, loss scale): {png}")
    for spec, r in zip(specs, results, strict=True):
        if r.resume is not None:  # one precision at most
            where = Path(spec.checkpoint_dir).resolve()
            print(f"checkpoint ({spec.precision}, step {spec.resume_at}): {where}\n{r.resume}")
    print(f"done in {_minutes(time.perf_counter() - start)} (expected {_minutes(sum(seconds))})")
    return 0 if all(r.resume_ok for r in results) else 1


# --- one precision, in its own process -------------------------------------------------------------------
def train_precision(spec: RunSpec) -> RunResult:
    torch.set_num_threads(spec.threads)
    corpus = load_corpus(max_bytes=spec.corpus_bytes)
    engine = _build_engine(spec, init_seed=spec.seed)
    if spec.device == "cuda":
        torch.cuda.reset_peak_memory_stats()

    result = RunResult(spec.precision)
    train_seconds = _train(engine, corpus, spec, result, start=0)

    result.train_loss = sum(result.losses[-10:]) / len(result.losses[-10:])
    result.val_loss = _evaluate(engine, corpus, spec)
    # The first step is left out: it pays one-off costs (kernel selection, allocator warm-up).
    result.tokens_per_s = (spec.steps - 1) * spec.batch_size * spec.seq_len / train_seconds
    result.peak_memory = _peak_memory(spec.device)
    result.skipped_steps = engine.skipped_steps
    result.loss_scale = engine.optimizer.loss_scale
    if spec.resume_at is not None:
        result.resume_ok, result.resume = _resume_check(engine, corpus, spec, result.losses)
    return result


def _build_engine(spec: RunSpec, *, init_seed: int) -> halfprec.Engine:
    torch.manual_seed(init_seed)
    # Built in fp32: halfprec casts it to the run's precision and keeps these fp32 values as the masters, so
    # the three runs start from the same weights (not from three different roundings of them).
    model = GPT(GPTConfig(seq_len=spec.seq_len, n_layer=spec.n_layer, n_embd=spec.n_embd)).to(spec.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(optimizer, _Schedule(spec.steps))
    # growth_interval: the default (1000 clean steps before the scale doubles) is for long runs; a short demo
    # grows it sooner, so the FP16 plot shows the scaler probing upwards and backing off when grads overflow.
    return halfprec.initialize(
        model, optimizer, precision=spec.precision, max_grad_norm=1.0, growth_interval=50, lr_scheduler=sched
    )


class _Schedule:
    """Linear warmup over the first 10% of steps, then cosine decay to 10% of the peak LR."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.warmup = max(1, steps // 10)

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        progress = min(1.0, (step - self.warmup) / max(1, self.steps - self.warmup))
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))


def _train(engine: halfprec.Engine, corpus: Corpus, spec: RunSpec, result: RunResult, *, start: int) -> float:
    """Train steps ``start .. spec.steps-1``, appending to ``result``; returns the seconds spent training,
    evaluation and the first step excluded. ``start > 0`` is the resumed run: it does not evaluate."""
    engine.train()
    seconds = 0.0
    desc = f"{spec.precision} resumed" if start else spec.precision
    bar = _progress(range(start, spec.steps), desc=desc, file=sys.stderr)
    # The bar's own [elapsed<left] is this run's; "demo ETA" adds the runs still to come (the resume
    # check's second half when this run does it, then the parent's estimate of the later precisions).
    resumed_steps = spec.steps - spec.resume_at if not start and spec.resume_at is not None else 0
    t_start = time.perf_counter()
    for step in bar:
        t0 = time.perf_counter()
        # Batch `step` is a pure function of (seed, step): a resumed run sees the same batches.
        x, y = corpus.batch(
            "train", step=step, batch_size=spec.batch_size, seq_len=spec.seq_len, seed=spec.seed
        )
        loss = _loss(engine, x.to(spec.device), y.to(spec.device))
        engine.backward(loss)  # scales the loss (FP16) before autograd
        engine.step()  # unscale, check for inf/nan, clip, AdamW on the fp32 masters, round into the model
        # (engine.step() also zeroes the grads and steps the LR schedule -- unless the step was skipped.)
        record = engine.last_record
        result.losses.append(loss.item())
        result.loss_scales.append(record.loss_scale)
        result.skipped.append(record.skipped)
        if step > start:
            seconds += time.perf_counter() - t0

        if step + 1 == spec.resume_at:
            # client_state carries what the engine cannot know: where the data stream is.
            engine.save_checkpoint(spec.checkpoint_dir, client_state={"next_step": step + 1}, overwrite=True)
        if not start and ((step + 1) % spec.eval_every == 0 or step + 1 == spec.steps):
            result.val_curve.append((step + 1, _evaluate(engine, corpus, spec)))
            engine.train()
        per_step = (time.perf_counter() - t_start) / (step + 1 - start)
        eta = _minutes((spec.steps - step - 1 + resumed_steps) * per_step + spec.later_seconds, short=True)
        postfix = {"loss": f"{result.losses[-1]:.3f}", "scale": f"{record.loss_scale:g}", "demo ETA": eta}
        bar.set_postfix(postfix)  # a dict keeps this order (keyword arguments would be sorted)
    return seconds


class _Lines:
    """The progress bar's text where the stream is not a terminal (a file, a pipe, CI's log): one line per tenth
    of the run and one at its end, instead of the redraw per step that a terminal folds into one line."""

    def __init__(self, steps: range, *, desc: str, file: TextIO) -> None:
        self.steps, self.desc, self.file = steps, desc, file
        self.every = max(1, len(steps) // 10)
        self.done = 0
        self.t0 = time.perf_counter()

    def __iter__(self) -> Iterator[int]:
        return iter(self.steps)

    def set_postfix(self, postfix: dict[str, str]) -> None:
        """Called once per step, after it: prints every ``every`` steps and after the last."""
        self.done += 1
        if self.done % self.every and self.done != len(self.steps):
            return
        elapsed = _minutes(time.perf_counter() - self.t0, short=True)
        values = ", ".join(f"{k}={v}" for k, v in postfix.items())  # tqdm's postfix format
        print(
            f"{self.desc}: step {self.done}/{len(self.steps)} [{elapsed}] {values}",
            file=self.file,
            flush=True,
        )


def _progress(steps: range, *, desc: str, file: TextIO) -> Any:
    """A tqdm bar on a terminal; elsewhere :class:`_Lines` (tqdm would write one redraw per step)."""
    if not file.isatty():
        return _Lines(steps, desc=desc, file=file)
    from tqdm import tqdm  # noqa: PLC0415 - the [demo] extra

    return tqdm(steps, desc=desc, unit="step", file=file)


def _loss(engine: halfprec.Engine, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = engine(x)  # (B, T, 256), in the run's precision
    # The loss in fp32: the log-softmax of 16-bit logits loses the small probabilities it is made of.
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))


@torch.no_grad()
def _evaluate(engine: halfprec.Engine, corpus: Corpus, spec: RunSpec) -> float:
    """Mean loss over the same ``eval_batches`` validation batches every time, so points are comparable."""
    engine.eval()
    total = 0.0
    for i in range(spec.eval_batches):
        x, y = corpus.batch("val", step=i, batch_size=spec.batch_size, seq_len=spec.seq_len, seed=spec.seed)
        total += _loss(engine, x.to(spec.device), y.to(spec.device)).item()
    return total / spec.eval_batches


def _peak_memory(device: str) -> str:
    if device == "cuda":
        return f"{torch.cuda.max_memory_allocated() / 2**20:.0f} MiB"
    try:
        import resource  # noqa: PLC0415 - POSIX only
    except ImportError:
        return "n/a"
    # ru_maxrss is KiB on Linux, bytes on macOS. It includes torch itself and the corpus, not just training.
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return f"{rss / (2**20 if sys.platform == 'darwin' else 2**10):.0f} MiB"


def _resume_check(
    done: halfprec.Engine, corpus: Corpus, spec: RunSpec, losses: list[float]
) -> tuple[bool, str]:
    """Load the mid-run checkpoint into a fresh engine, finish the run, compare with the uninterrupted one."""
    # A different init seed, so that only the checkpoint can make the fresh model equal to the saved one.
    fresh = _build_engine(spec, init_seed=spec.seed + 1)
    client_state = fresh.load_checkpoint(spec.checkpoint_dir)
    if spec.break_resume:  # test hook: a resume that is not exact must be caught
        with torch.no_grad():
            next(fresh.module.parameters()).view(-1)[0] += 1.0
    resumed = RunResult(spec.precision)
    start = client_state["next_step"]
    _train(fresh, corpus, spec, resumed, start=start)

    what = f"resume check ({spec.precision}): stopped at step {start}, saved, reloaded into a fresh engine, "
    what += f"continued to {spec.steps}: "
    n_same, n = sum(a == b for a, b in zip(losses[start:], resumed.losses, strict=True)), len(resumed.losses)
    diff = f"{n - n_same} of {n} losses differ" if n_same < n else None
    diff = diff or _first_difference(done.module.state_dict(), fresh.module.state_dict(), "weights")
    diff = diff or _first_difference(done.optimizer.state_dict(), fresh.optimizer.state_dict(), "optimizer")
    if diff is None and (done.global_step, done.skipped_steps) != (fresh.global_step, fresh.skipped_steps):
        diff = "counters differ"
    if diff is not None:
        return False, what + f"MISMATCH: {diff}"
    n_tensors = len(done.module.state_dict())
    return True, what + (
        f"OK, bit-identical ({n_same} losses, {n_tensors} weight tensors, fp32 masters, AdamW state, "
        f"loss scale {fresh.optimizer.loss_scale:g})"
    )


def _first_difference(a: Any, b: Any, where: str) -> str | None:
    """Where two nested state dicts first differ (tensors compared bit for bit, dtype included), else None."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
        return None if same and torch.equal(a, b) else f"{where} differs"
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        a, b = dict(enumerate(a)), dict(enumerate(b))  # a different length: different keys
    if not (isinstance(a, dict) and isinstance(b, dict)):
        return None if a == b else f"{where}: {a!r} != {b!r}"
    if a.keys() != b.keys():
        return f"{where} has different keys"
    for k in a:
        if (diff := _first_difference(a[k], b[k], f"{where}[{k!r}]")) is not None:
            return diff
    return None


# --- the CLI's edge: flags -> specs; results -> table and PNG --------------------------------------------
def _specs(args: argparse.Namespace) -> list[RunSpec]:
    precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    if not precisions or not set(precisions) <= set(PRECISIONS) or len(set(precisions)) != len(precisions):
        raise ValueError(f"--precisions {args.precisions!r}: give distinct names from {','.join(PRECISIONS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda, but torch sees no CUDA device; run with --device cpu")
    for name in ("steps", "batch_size", "seq_len", "n_layer", "n_embd", "threads"):
        if (value := getattr(args, name)) is not None and value < 1:  # --threads None: the default
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.steps < 2:
        raise ValueError(f"--steps {args.steps}: the resume check needs at least 2 steps")
    resume = args.resume_check
    if resume == "auto":
        # fp16 when it runs: its checkpoint also carries the dynamic loss scaler, the hardest state to restore.
        resume = "fp16" if "fp16" in precisions else precisions[-1]
    if resume != "none" and resume not in precisions:
        raise ValueError(f"--resume-check {resume!r} is not among --precisions {','.join(precisions)}")
    if not (math.isfinite(args.lr) and args.lr > 0):
        raise ValueError(f"--lr must be a positive number, got {args.lr}")
    try:  # the model's own checks (n_head must divide n_embd), here rather than in a child's traceback
        GPTConfig(seq_len=args.seq_len, n_layer=args.n_layer, n_embd=args.n_embd)
    except ValueError as e:
        raise ValueError(
            f"--n-embd {args.n_embd}: must be a multiple of {GPTConfig().n_head} (the heads)"
        ) from e
    if args.corpus_bytes is not None:
        corpus = load_corpus(max_bytes=args.corpus_bytes)
        if min(corpus.train.numel(), corpus.val.numel()) <= args.seq_len + 1:
            raise ValueError(
                f"--corpus-bytes {args.corpus_bytes}: too few bytes for sequences of {args.seq_len} in both "
                "splits (every tenth file is held out); give more (or leave it out: all of it)"
            )
    common = dict(
        device=args.device, steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
        n_layer=args.n_layer, n_embd=args.n_embd, lr=args.lr, seed=args.seed,
        threads=args.threads or _default_threads(), eval_every=max(1, args.steps // 5), eval_batches=8,
        corpus_bytes=args.corpus_bytes, break_resume=args.break_resume,
    )  # fmt: skip
    return [
        RunSpec(
            precision=p,
            checkpoint_dir=str(args.out / "checkpoints" / p),
            resume_at=args.steps // 2 if p == resume else None,
            **common,
        )
        for p in precisions
    ]


# Names that say "a file": --out is the folder for the plot and the checkpoints, never the weights file itself.
_FILE_SUFFIXES = {".safetensors", ".pt", ".pth", ".bin", ".ckpt", ".png", ".json", ".txt"}


def _check_out(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out}: is a file; give a directory for the plot and the checkpoints")
    if not out.exists() and out.suffix.lower() in _FILE_SUFFIXES:
        raise ValueError(
            f"--out {out}: looks like a file name, but --out is the directory for the plot and the checkpoints "
            "(halfprec export turns a checkpoint into a .safetensors file afterwards)"
        )
    parent = next(p for p in (out, *out.parents) if p.exists())  # "." or "/" at the latest
    if not parent.is_dir():
        raise ValueError(f"--out {out}: {parent} is a file, so the directory cannot be made there")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(
            f"--out {out}: cannot write in {parent.resolve()}; pick a directory you can write to"
        )


def _check_extras() -> None:
    # Checked before training, not found missing at the plot two minutes later.
    for name in ("tqdm", "matplotlib"):
        try:
            __import__(name)
        except ImportError as e:
            raise ImportError(
                f"the demo needs {name}: pip install -e '.[demo]' from the repository's root"
            ) from e


def _default_threads() -> int:
    """Idle cores this process may use (the 1-minute load average counts the busy ones), minus one, at least 1.

    torch's intra-op threads run in lock-step and spin while they wait, so one other busy process on a core
    slows every op to that core's share (2-core VM, the demo's fp32 step: 2 threads 68 ms idle, 1,326 ms beside
    a busy loop; 1 thread 113 ms and 118 ms).
    """
    # The cores this process may run on (a container's or taskset's limit), not the machine's total.
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    busy = round(os.getloadavg()[0]) if hasattr(os, "getloadavg") else 0
    return max(1, min(cores, cores - busy) - 1)


def _estimate_seconds(specs: list[RunSpec]) -> list[float]:
    """Seconds each run should take: three steps per precision timed now, in this process, plus startup."""
    # Each child pays this process's startup again (interpreter, torch, halfprec): from its start until now.
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        startup = max(1.0, uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        startup = 5.0  # no /proc (macOS, Windows): about what a 2-core Linux VM takes
    threads = torch.get_num_threads()
    torch.set_num_threads(specs[0].threads)
    try:
        out = []
        for spec in specs:
            engine = _build_engine(spec, init_seed=spec.seed)
            x = torch.randint(256, (spec.batch_size, spec.seq_len), device=spec.device)
            times = []
            for _ in range(4):  # the first pays one-off costs (allocator, kernel selection) and is dropped
                t0 = time.perf_counter()
                engine.backward(_loss(engine, x, x))
                engine.step()
                if spec.device == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            step = sorted(times[1:])[1]  # the median of three: one burst of other work does not set it
            steps = spec.steps + (spec.steps - spec.resume_at if spec.resume_at is not None else 0)
            # evaluation: forward only (about a third of a step), eval_batches per point, 5 points plus the end
            evals = (spec.steps // spec.eval_every + 1) * spec.eval_batches * step / 3
            out.append(startup + steps * step + evals)
        return out
    finally:
        torch.set_num_threads(threads)


def _minutes(seconds: float, *, short: bool = False) -> str:
    m, s = divmod(round(seconds), 60)
    if short:
        return f"{m}:{s:02d}"
    return f"{m} min {s:02d} s" if m else f"{s} s"


def _table(results: list[RunResult], device: str) -> str:
    mem = "peak alloc" if device == "cuda" else "peak RSS"
    rows = [("precision", "train loss", "val loss", "tokens/s", mem, "skipped", "loss scale")]
    for r in results:
        scale = f"{r.loss_scale:g}" if r.precision == "fp16" else "-"  # bf16/fp32 need no scaling
        rows.append((r.precision, f"{r.train_loss:.3f}", f"{r.val_loss:.3f}", f"{r.tokens_per_s:,.0f}",
                     r.peak_memory, str(r.skipped_steps), scale))  # fmt: skip
    widths = [max(map(len, column)) for column in zip(*rows, strict=True)]
    # names left-aligned, numbers right-aligned
    lines = ["  ".join([row[0].ljust(widths[0]), *map(str.rjust, row[1:], widths[1:])]) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    notes = ["train loss: mean of the last 10 steps; val loss: 8 fixed held-out batches"]
    if device == "cpu":
        notes.append("peak RSS: the whole child process (torch and the corpus included)")
        if any(r.precision in ("fp16", "bf16") for r in results):
            notes.append(
                "on CPU, 16-bit matmuls take 16-bit inputs, accumulate in fp32 and round to 16 bits, as GPUs do"
            )
    return "\n".join(lines + [""] + notes)


def _plot(results: list[RunResult], path: Path) -> Path:
    """Three panels: the loss curves; each 16-bit run's loss minus fp32's on the same batch (the curves lie on
    top of each other at the first panel's scale); the fp16 loss scale with its skipped steps."""
    import matplotlib  # noqa: PLC0415 - the [demo] extra

    matplotlib.use("Agg")  # files only: no display needed, none opened
    import matplotlib.pyplot as plt  # noqa: PLC0415

    path.parent.mkdir(parents=True, exist_ok=True)
    colors = {p: f"C{i}" for i, p in enumerate(PRECISIONS)}  # the same colour for a precision in every panel
    fp32 = next((r for r in results if r.precision == "fp32"), None)
    fp16 = next((r for r in results if r.precision == "fp16"), None)
    diffs = [r for r in results if fp32 is not None and r is not fp32]
    heights = {"loss": 3.2} | ({"diff": 2.6} if diffs else {}) | ({"scale": 2.0} if fp16 else {})  # inches
    fig, axes = plt.subplots(
        len(heights), 1, figsize=(8, sum(heights.values()) + 0.6), sharex=True, squeeze=False,
        gridspec_kw={"height_ratios": list(heights.values())},
    )  # fmt: skip
    ax = dict(zip(heights, axes[:, 0], strict=True))
    steps = range(1, len(results[0].losses) + 1)  # every run takes the same steps

    a = ax["loss"]
    for r in results:
        c = colors[r.precision]
        a.plot(steps, r.losses, color=c, lw=0.8, alpha=0.6, label=f"{r.precision} train")
        a.plot(*zip(*r.val_curve, strict=True), "o-", color=c, ms=4, label=f"{r.precision} val")
    a.axhline(math.log(256), color="grey", ls=":", lw=0.8, label="uniform bytes (5.55)")
    a.set_ylabel("loss (nats/byte)")
    a.legend(ncol=2, fontsize=8)
    a.set_title("halfprec demo: same model, seed and data in each precision")

    if diffs:
        a = ax["diff"]
        # Same batch at every step in every run, so the per-step difference isolates the precision; a
        # 10-step mean shows the trend through the batch-to-batch noise.
        trends = []  # past the first tenth of the steps: the y-axis follows these, not the first steps' spikes
        for r in diffs:
            c = colors[r.precision]
            d = [x - y for x, y in zip(r.losses, fp32.losses, strict=True)]
            trend = [sum(d[i - 10 : i]) / 10 for i in range(10, len(d) + 1)]
            trends += trend[len(d) // 10 :] or [0.05]
            a.plot(steps, d, color=c, lw=0.5, alpha=0.3)
            a.plot(steps[9:], trend, color=c, lw=1.5, label=f"{r.precision} - fp32")
            vd = [(s, v - v32) for (s, v), (_, v32) in zip(r.val_curve, fp32.val_curve, strict=True)]
            a.plot(*zip(*vd, strict=True), "o", color=c, ms=4, label=f"{r.precision} - fp32, val")
        a.axhline(0.0, color="grey", lw=0.8)
        lim = max(abs(v) for v in trends)
        a.set_ylim(-3 * lim - 0.01, 3 * lim + 0.01)
        a.set_ylabel("loss - fp32 loss")
        a.legend(ncol=2, fontsize=8)

    if fp16:
        a = ax["scale"]
        a.step(steps, fp16.loss_scales, where="post", color=colors["fp16"], label="fp16 loss scale")
        for label, style, skips in _skip_marks(fp16):
            a.plot(skips, [fp16.loss_scales[i - 1] for i in skips], style, label=label)
        a.set_yscale("log", base=2)
        a.set_ylabel("loss scale")
        a.legend(fontsize=8)
    axes[-1, 0].set_xlabel("optimizer step")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path.resolve()


def _skip_marks(r: RunResult) -> list[tuple[str, str, list[int]]]:
    """(legend label, marker style, 1-based steps) for each kind of skipped step that ``r`` has: one that halved
    the loss scale, and one that kept it: with hysteresis (the demo keeps the default of 2) the scale backs off
    at the second overflow since its last growth or backoff, so the first one skips the step at the same scale."""
    after = [*r.loss_scales[1:], r.loss_scale]  # the scale after each step: the next step's, or the final one
    halved = [i + 1 for i, s in enumerate(r.skipped) if s and after[i] < r.loss_scales[i]]
    held = [i + 1 for i, s in enumerate(r.skipped) if s and after[i] >= r.loss_scales[i]]
    marks = [
        (f"skipped step (scale halved): {len(halved)}", "rx", halved),
        (f"skipped step (scale held: hysteresis): {len(held)}", "ko", held),
    ]
    return [(label, style, steps) for label, style, steps in marks if steps]
