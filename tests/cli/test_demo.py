"""`halfprec demo`: data determinism, the model, one short end-to-end run, and the resume check's failure path."""

from __future__ import annotations

import argparse
import io
import math
import re

import pytest
import torch

from halfprec.cli import demo

pytest.importorskip("tqdm")
pytest.importorskip("matplotlib")

# Tiny sizes: the point is the plumbing, not the learning (the defaults' timings: benchmarks/RESULTS.md, section 5).
TINY = ["--steps", "6", "--batch-size", "4", "--seq-len", "32", "--n-layer", "1", "--n-embd", "32",
        "--corpus-bytes", "3000000", "--threads", "1"]  # fmt: skip


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    # train_precision() sets torch's thread count, as the demo's child processes do; not for the rest of pytest.
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    return parser.parse_args(list(argv))


def _spec(tmp_path, precision: str, **kw) -> demo.RunSpec:
    fields = dict(
        precision=precision, device="cpu", steps=6, batch_size=4, seq_len=32, n_layer=1, n_embd=32, lr=3e-3,
        seed=0, threads=1, eval_every=3, eval_batches=2, corpus_bytes=3_000_000,
        checkpoint_dir=str(tmp_path / "ckpt" / precision),
    )  # fmt: skip
    fields.update(kw)
    return demo.RunSpec(**fields)


# --- training, in process (fast) ---------------------------------------------------------------------------
def test_same_seed_same_numbers_and_resume_is_exact(tmp_path):
    a = demo.train_precision(_spec(tmp_path, "fp16", resume_at=3))
    b = demo.train_precision(_spec(tmp_path, "fp16"))
    assert a.losses == b.losses and a.val_loss == b.val_loss and a.loss_scales == b.loss_scales
    assert a.resume_ok and "OK, bit-identical (3 losses" in a.resume
    c = demo.train_precision(_spec(tmp_path, "fp16", seed=1))
    assert c.losses != a.losses


def test_resume_check_catches_a_mismatch(tmp_path):
    r = demo.train_precision(_spec(tmp_path, "bf16", resume_at=3, break_resume=True))
    assert not r.resume_ok and "MISMATCH" in r.resume


# --- the command, end to end (one child process per precision) ------------------------------------------
def _table_rows(out: str) -> dict[str, list[str]]:
    return {
        m[0]: m[1:] for line in out.splitlines() if len(m := line.split()) == 8 and m[0] in demo.PRECISIONS
    }


@pytest.mark.slow
def test_demo_end_to_end(tmp_path, capfd):
    assert demo.run(_args(*TINY, "--out", str(tmp_path))) == 0
    out, err = capfd.readouterr()
    rows = _table_rows(out)
    assert list(rows) == ["fp32", "bf16", "fp16"]
    for precision, (train, val, tok_s, mem, unit, skipped, scale) in rows.items():
        assert 0 < float(train) < 6 and 0 < float(val) < 6, out
        assert float(tok_s.replace(",", "")) > 0 and int(mem) > 0 and unit == "MiB" and int(skipped) >= 0
        assert (scale == "-") == (precision != "fp16")
    assert math.log2(float(rows["fp16"][-1])).is_integer()
    png = re.search(r"plot \(loss curves, difference to fp32, loss scale\): (\S+)", out).group(1)
    assert png.endswith("demo.png") and (tmp_path / "demo.png").stat().st_size > 10_000
    ckpt = re.search(r"checkpoint \(fp16, step 3\): (\S+)", out).group(1)
    assert (
        ckpt == str((tmp_path / "checkpoints" / "fp16").resolve()) and (tmp_path / ckpt / "latest").exists()
    )
    assert re.search(r"resume check \(fp16\): stopped at step 3, .* OK, bit-identical", out)
    assert re.search(r"expected duration: about \d+", out) and re.search(r"done in .* \(expected ", out)
    assert re.search(r"demo ETA=\d+:\d\d", err)  # in every precision's progress bar


@pytest.mark.slow
def test_demo_mismatch_is_a_nonzero_exit(tmp_path, capfd):
    argv = [*TINY, "--precisions", "fp32", "--break-resume", "--out", str(tmp_path)]
    assert demo.run(_args(*argv)) == 1
    assert re.search(r"resume check \(fp32\): .*MISMATCH", capfd.readouterr().out)


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--precisions", "fp8"], r"--precisions 'fp8': give distinct names from fp32,bf16,fp16"),
        (["--precisions", "bf16,bf16"], r"give distinct names"),
        (["--steps", "1"], r"--steps 1: the resume check needs at least 2 steps"),
        (["--batch-size", "0"], r"--batch-size must be >= 1, got 0"),
        (["--threads", "0"], r"--threads must be >= 1, got 0"),
        (["--n-embd", "130"], r"--n-embd 130: must be a multiple of 4 \(the heads\)"),
        (["--lr", "-1"], r"--lr must be a positive number, got -1.0"),
        (
            ["--corpus-bytes", "10", "--seq-len", "10000000"],
            r"--corpus-bytes 10: too few bytes for sequences of",
        ),
        (
            ["--precisions", "fp32", "--resume-check", "bf16"],
            r"--resume-check 'bf16' is not among --precisions",
        ),
    ],
)
def test_demo_bad_flags_exit_2_with_the_fix(argv, match, capsys, tmp_path):
    out = tmp_path / "out"
    assert demo.run(_args(*argv, "--out", str(out))) == 2
    err = capsys.readouterr().err
    assert re.search(match, err) and err.count("\n") == 1  # one line, no traceback
    assert not out.exists()  # checked before anything is written


def test_demo_out_must_be_a_directory(tmp_path, capsys):
    # Refused before training: a directory that cannot be made would otherwise fail at the plot, after the runs.
    existing = tmp_path / "weights.safetensors"
    existing.write_bytes(b"keep me")
    for out, match in [
        (existing, r"--out .*weights.safetensors: is a file; give a directory"),
        (
            tmp_path / "x.safetensors",
            r"--out .*x.safetensors: looks like a file name, but --out is the directory",
        ),
        (existing / "sub", r"weights.safetensors is a file, so the directory cannot be made there"),
    ]:
        assert demo.run(_args(*TINY, "--out", str(out))) == 2
        err = capsys.readouterr().err
        assert re.search(match, err) and err.count("\n") == 1
    assert existing.read_bytes() == b"keep me" and sorted(p.name for p in tmp_path.iterdir()) == [
        existing.name
    ]


@pytest.mark.parametrize(
    ("cores", "load", "threads"), [(2, 0.0, 1), (2, 1.9, 1), (1, 0.0, 1), (16, 0.2, 15), (16, 3.4, 12)]
)
def test_default_threads_leave_one_core_and_the_busy_ones(cores, load, threads, monkeypatch):
    monkeypatch.setattr(demo.os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    monkeypatch.setattr(demo.os, "getloadavg", lambda: (load, load, load), raising=False)
    assert demo._default_threads() == threads


def test_plot_panels_follow_the_precisions_run(tmp_path):
    def result(precision: str, offset: float) -> demo.RunResult:
        r = demo.RunResult(
            precision, losses=[5.0 - i / 10 + offset for i in range(30)], val_curve=[(30, 2.0)]
        )
        r.loss_scales, r.skipped = [65536.0] * 30, [i == 3 for i in range(30)]
        return r

    for names in (["bf16"], ["fp32", "bf16"], ["fp32", "bf16", "fp16"], ["fp16"]):
        png = demo._plot([result(p, 0.01 * i) for i, p in enumerate(names)], tmp_path / f"{len(names)}.png")
        assert png.stat().st_size > 10_000


def test_skip_marks_say_why_the_scale_held():
    r = demo.RunResult("fp16", loss_scales=[8.0, 8.0, 8.0, 4.0, 4.0], loss_scale=2.0)
    r.skipped = [False, True, True, False, True]  # step 2: held (hysteresis), 3: halved, 5 (the last): halved
    assert demo._skip_marks(r) == [
        ("skipped step (scale halved): 2", "rx", [3, 5]),
        ("skipped step (scale held: hysteresis): 1", "ko", [2]),
    ]
    r.skipped = [False] * 5
    assert demo._skip_marks(r) == []


class _Stream(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def test_progress_off_a_terminal_is_a_line_per_tenth():
    # tqdm writes a redraw per step: 400 steps in three runs and a resume were ~1,440 lines in a log file.
    for steps, lines in [(range(0, 400), 10), (range(200, 400), 10), (range(0, 25), 13), (range(0, 3), 3)]:
        stream = _Stream(tty=False)
        bar = demo._progress(steps, desc="fp16", file=stream)
        for step in bar:
            bar.set_postfix({"loss": f"{step:.3f}", "scale": "65536", "demo ETA": "1:00"})
        out = stream.getvalue().splitlines()
        assert len(out) == lines, out
        assert re.fullmatch(
            rf"fp16: step {len(steps)}/{len(steps)} \[\d+:\d\d\] loss=\S+, scale=65536, demo ETA=1:00",
            out[-1],
        )
    assert type(demo._progress(range(3), desc="fp16", file=_Stream(tty=True))).__name__ == "tqdm"


@pytest.mark.skipif(torch.cuda.is_available(), reason="tests the no-CUDA message")
def test_demo_cuda_without_a_gpu_says_so(capsys):
    assert demo.run(_args("--device", "cuda")) == 2
    assert "torch sees no CUDA device; run with --device cpu" in capsys.readouterr().err
