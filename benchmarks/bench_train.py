"""End-to-end training benchmark: a transformers Llama (~271M params, seq 1024) under torch autocast, halfprec and
DeepSpeed ZeRO-0, in interleaved rounds.

    python benchmarks/bench_train.py [--rounds 3] [--steps 40] [--systems autocast,halfprec,deepspeed]

Every (round, system, dtype) runs in its own process (peak memory is per process; nothing is shared between
systems), rounds interleaved because the device's speed drifts. Each run builds the same model from the same seed,
trains it with AdamW (lr 3e-4, weight decay 0.1, clipping at 1.0) on the same token batches, and reports the median
ms/step after the warm-up steps (CUDA events, from one step's start to the next's), tokens/s, the peak memory
allocated during training, the loss of the last step, and the host's time to enqueue one tiny kernel, measured
before the run (and after it, in the JSON: the step is host-paced, and the device's host speed varies). Every
system runs the model with ``use_cache=False``, as the HF Trainer does. ``--cpus`` pins the runs to cores; the
summary gives each system's tokens/s over the first system's in the same round and dtype. ``--trees
old=DIR,new=DIR`` runs each system once per source tree in every round (an A/B of a change, interleaved).
``--trace`` adds every step's loss, loss scale and grad norm to the JSON.

Systems:
  autocast   fp32 model under ``torch.autocast``, ``torch.optim.AdamW(fused=True)``; fp16 with ``GradScaler``
  halfprec   ``halfprec.initialize`` (16-bit model, fused optimizer on CUDA)
  hf         the HF ``Trainer`` with halfprec (``HalfprecTrainer``, its AdamW on halfprec's fused path, clipping
             in the kernel, constant LR, the Trainer's default logging (every 500 steps; the losses are kept on the
             device), the batches in the others' order), timed from one step's begin to the next's by a callback
             (so the batch fetch between steps counts)
  deepspeed  DeepSpeed ZeRO-0 with its FusedAdam (``gradient_clipping: 1.0``), when it is installed
  deepspeed-reset  the same, with the Adam state DeepSpeed's fp16 wrapper creates at construction (a step on zero
             grads) reset before training: a diagnostic of that construction step (fp16 only)
  halfprec-noclip, deepspeed-noclip  without clipping: diagnostics of DeepSpeed fp16's loss
  deepspeed-scaled  DeepSpeed fp16 with the loss multiplied by its loss scale before ``engine.backward``: 0.19.8's
             ZeRO-0 ``engine.backward`` does not scale the loss (it scales only for ZeRO optimizers), while its
             ``FP16_Optimizer.step`` divides the grads by the scale (upstream PR deepspeedai/DeepSpeed#8393)
  halfprec-sched  ``halfprec`` with a constant ``LambdaLR`` scheduler: the engine reads each step's skip flag to
             hold the schedule (one host sync per step): a diagnostic of that sync's cost
  hf-nosync  ``hf`` with two of the Trainer's own per-step host syncs turned off by its settings:
             Accelerate's batch transfer made non-blocking (``accelerator_config={"non_blocking": True}``, from
             pinned memory) and the nan/inf loss filter (``logging_nan_inf_filter=False``): a diagnostic of how
             much of the gap between ``hf`` and ``halfprec`` is the Trainer's syncs (halfprec's link keeps one,
             the skip flag the Trainer reads to hold the LR schedule)
  hf-nolink  ``hf`` with halfprec's Accelerate link removed once training starts: the Trainer then never reads
             the skip flag (a host sync right after every step, ``accelerator.optimizer_step_was_skipped``); it
             would advance the LR schedule over skipped steps (constant here): a diagnostic of that sync's cost
  hf-quiet  ``hf-nosync`` and ``hf-nolink`` together: the Trainer with none of those per-step host syncs
  halfprec-keep  ``MixedPrecisionOptimizer`` in a plain loop with ``zero_grad(set_to_none=False)``: the grad buffer
             kept between steps (the engine frees it before each forward): a diagnostic of that buffer's cost
  hf-paired  ``hf`` and the ``halfprec`` plain loop in one process, in alternating blocks of 5 steps (a callback
             runs the plain loop's block on a second model at the end of every 5th Trainer step, between two
             synchronizations): both see the same host at the same moments, so the host's drift, which moves
             whole runs by more than the Trainer's cost, cancels. Reports the Trainer's ms/step, the plain
             loop's, and the Trainer's tokens/s over the plain loop's (its ``paired`` figures)
  hf-nosync-paired, hf-nolink-paired  the same with ``hf-nosync``'s, ``hf-nolink``'s settings
  hf-autocast-paired  the same for the HF Trainer without halfprec (its own ``bf16=True`` / ``fp16=True`` autocast,
             ``optim="adamw_torch_fused"``) against the ``autocast`` plain loop: how much the Trainer's loop costs
             a plain loop when halfprec is not involved
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
from pathlib import Path

SYSTEMS = (
    "autocast",
    "halfprec",
    "hf",
    "deepspeed",
    "deepspeed-reset",
    "halfprec-noclip",
    "deepspeed-noclip",
    "halfprec-keep",
    "deepspeed-scaled",
    "halfprec-sched",
    "hf-nosync",
    "hf-nolink",
    "hf-quiet",
    "hf-paired",
    "hf-nosync-paired",
    "hf-nolink-paired",
    "hf-autocast-paired",
)
PAIRED_BLOCK = 5  # steps per block in the paired systems
LR, WEIGHT_DECAY, CLIP = 3e-4, 0.1, 1.0


def llama(seed: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=16, num_attention_heads=16,
        num_key_value_heads=16, max_position_embeddings=1024, tie_word_embeddings=False, attn_implementation="sdpa",
        use_cache=False,  # training builds no KV cache: the HF Trainer sets the same (TrainingArguments.use_cache)
    )  # fmt: skip
    torch.manual_seed(seed)
    with torch.device("cuda"):
        return LlamaForCausalLM(config)


def batches(batch: int, seq: int, count: int = 4):
    import torch

    g = torch.Generator(device="cuda").manual_seed(1)
    return [torch.randint(0, 32000, (batch, seq), device="cuda", generator=g) for _ in range(count)]


def autocast_runner(model, dtype):
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    scaler = torch.amp.GradScaler("cuda") if dtype == torch.float16 else None

    def step(x):
        with torch.autocast("cuda", dtype=dtype):
            loss = model(input_ids=x, labels=x).loss
        if scaler is None:
            loss.backward()
        else:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
        opt.zero_grad(set_to_none=True)
        last[:] = [norm]
        return loss.detach()

    last = [None]
    return step, lambda: (last[0], scaler.get_scale() if scaler is not None else None)


def halfprec_runner(model, dtype, clip=CLIP, scheduled=False):
    import torch

    import halfprec

    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    precision = {torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0) if scheduled else None
    engine = halfprec.initialize(model, opt, precision=precision, max_grad_norm=clip, lr_scheduler=sched)

    def step(x):
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()  # also clears the grads
        return loss.detach()

    return step, lambda: (engine.optimizer.grad_norm, engine.optimizer.step_loss_scale)


def keep_runner(model, dtype):
    import torch

    import halfprec

    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    mp = halfprec.MixedPrecisionOptimizer(opt, max_grad_norm=CLIP, param_dtype=dtype)

    def step(x):
        loss = model(input_ids=x, labels=x).loss
        mp.backward(loss)
        mp.step()
        mp.zero_grad(set_to_none=False)
        return loss.detach()

    return step, lambda: (mp.grad_norm, mp.step_loss_scale)


def deepspeed_runner(model, dtype, batch: int, *, reset: bool, clip=CLIP, scaled: bool = False):
    import deepspeed
    import torch

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(
        RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    config = {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": clip,
        "zero_optimization": {"stage": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}},
        "steps_per_print": 10**9,
        ("fp16" if dtype == torch.float16 else "bf16"): {"enabled": True},
    }
    engine, opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    inner = opt.optimizer  # the FusedAdam under DeepSpeed's fp16/bf16 wrapper
    steps_at_start = sorted({int(s["step"]) for s in inner.state.values() if "step" in s})
    info = {"inner_state_steps_after_initialize": steps_at_start}
    if reset:
        inner.state.clear()  # what a lazily initialising wrapper would hold: no state before the first update
        for group in inner.param_groups:
            group.pop("step", None)
        info["reset"] = True

    scaler = getattr(opt, "loss_scale_config", None)  # FP16_Optimizer's (0.19.8)

    def step(x):
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss.float() * scaler.cur_scale if scaled else loss)
        engine.step()
        return loss.detach()

    step.info = info
    step.skipped = lambda: engine.skipped_steps
    return step, lambda: (engine.get_global_grad_norm(), None if scaler is None else scaler.cur_scale)


def hf_run(
    model, dtype, data, args, callbacks=(), nosync=False, nolink=False, autocast=False
) -> tuple[list[float], list[float]]:
    """(ms per step, loss per step) of ``args.warmup + args.steps`` HF Trainer steps over ``data``'s rows;
    ``nosync``, ``nolink``: the ``hf-nosync``, ``hf-nolink`` settings; ``autocast``: the plain Trainer with its own
    autocast and fused AdamW instead of halfprec. A step whose ``on_step_end`` callbacks ran timed work of their
    own (a paired block) is left out of the times (its period includes that work)."""
    import tempfile

    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from halfprec.integrations.hf import HalfprecTrainer

    events: list[tuple] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, *_args, **_kwargs):
            events.append((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
            events[-1][0].record()

        def on_step_end(self, *_args, **_kwargs):
            events[-1][1].record()

        def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
            if nolink:  # the handle halfprec.integrations.accelerate keeps on the AcceleratedOptimizer
                optimizer._halfprec_skip_hook.remove()

    losses = []

    class InOrder(Trainer if autocast else HalfprecTrainer):
        # the other systems' batch order: the Trainer's default shuffle alone moves the last loss by ~0.9
        def _get_train_sampler(self, train_dataset=None):
            return torch.utils.data.SequentialSampler(train_dataset or self.train_dataset)

        def compute_loss(self, *a, **kw):
            loss = super().compute_loss(*a, **kw)
            losses.append(loss.detach())  # kept on the device: logging every step would sync every step
            return loss

    total = args.warmup + args.steps
    host = [batch.cpu() for batch in data]  # copied once, cycled as the other systems cycle ``data``
    rows = [{"input_ids": x, "labels": x} for i in range(total) for x in host[i % len(host)]]
    with tempfile.TemporaryDirectory() as out:
        precision = {}
        if autocast:
            precision = {"bf16" if dtype == torch.bfloat16 else "fp16": True, "optim": "adamw_torch_fused"}
        targs = TrainingArguments(
            out, max_steps=total, per_device_train_batch_size=args.batch, learning_rate=LR,
            weight_decay=WEIGHT_DECAY, max_grad_norm=CLIP, lr_scheduler_type="constant",
            save_strategy="no", report_to="none", disable_tqdm=True, **precision,
            **({"accelerator_config": {"non_blocking": True}, "dataloader_pin_memory": True,
                "logging_nan_inf_filter": False} if nosync else {}),
        )  # fmt: skip
        extra = {} if autocast else {"param_dtype": dtype}
        trainer = InOrder(
            model=model, args=targs, train_dataset=rows, callbacks=[Timer(), *callbacks], **extra
        )
        trainer.train()
    torch.cuda.synchronize()
    busy = {i for cb in callbacks for i in getattr(cb, "busy_steps", ())}
    ms = [t for i, t in enumerate(periods(events)) if i >= args.warmup and i not in busy]
    return ms, [float(v) for v in losses]


def paired_run(system: str, model, dtype, data, args) -> dict:
    """The ``*-paired`` systems: the HF Trainer on ``model`` and the plain loop on a second model from the same
    seed, in alternating blocks of ``PAIRED_BLOCK`` steps in this process (module docstring)."""
    import torch
    from transformers import TrainerCallback

    autocast = system == "hf-autocast-paired"
    plain_step, _ = (autocast_runner if autocast else halfprec_runner)(llama(args.seed), dtype)
    plain_ms: list[list[float]] = []  # per block
    plain_losses = []

    class Interleave(TrainerCallback):
        def __init__(self) -> None:
            # the Trainer steps (0-based) whose period includes a plain block
            self.busy_steps: set[int] = set()

        def on_step_end(self, _args, state, control, **kwargs):
            if state.global_step % PAIRED_BLOCK:
                return
            torch.cuda.synchronize()
            events = []
            for _ in range(PAIRED_BLOCK):
                i = len(plain_losses)
                events.append((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
                events[-1][0].record()
                plain_losses.append(plain_step(data[i % len(data)]))
                events[-1][1].record()
            torch.cuda.synchronize()
            plain_ms.append(periods(events))
            self.busy_steps.add(state.global_step - 1)

    interleave = Interleave()
    trainer_ms, losses = hf_run(
        model,
        dtype,
        data,
        args,
        callbacks=[interleave],
        nosync=system == "hf-nosync-paired",
        nolink=system == "hf-nolink-paired",
        autocast=autocast,
    )
    plain = [t for block in plain_ms[1:] for t in block]  # the first block warms the plain loop up
    trainer, ref = statistics.median(trainer_ms), statistics.median(plain)
    return {
        "ms_per_step": trainer, "plain_ms_per_step": ref, "paired_tokens_ratio": ref / trainer,
        "final_loss": losses[-1], "plain_final_loss": float(plain_losses[-1]), "plain_steps": len(plain),
        "trainer_steps": len(trainer_ms),
    }  # fmt: skip


def periods(events: list[tuple]) -> list[float]:
    """ms from each step's begin event to the next step's (to its own end event for the last step): a step's
    time with whatever the host does between steps (the Trainer fetches the next batch there)."""
    ends = [b for b, _ in events[1:]] + [events[-1][1]]
    return [begin.elapsed_time(end) for (begin, _), end in zip(events, ends, strict=True)]


def launch_us(count: int = 2000, reps: int = 5) -> float:
    """The host's time to enqueue one tiny kernel (median of ``reps`` bursts of ``count``), in us: the resource
    that paces a step this short. The host's speed differs between machines and drifts within one invocation
    (RESULTS.md), so each run reports it next to its step time."""
    import time

    import torch

    x = torch.zeros(1, device="cuda")
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(count):
            x.add_(1)
        times.append((time.perf_counter() - start) / count * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def core_speeds(cores: list[int]) -> dict[int, float]:
    """``launch_us`` with this process pinned to each of ``cores`` in turn (the launching thread is the one
    pinned): whether the device's host has fast and slow cores."""
    speeds = {}
    for core in cores:
        os.sched_setaffinity(0, {core})
        speeds[core] = launch_us(count=1000, reps=5)
    return speeds


def child(system: str, dtype_name: str, args) -> dict:
    import torch

    if args.cpus:
        os.sched_setaffinity(0, args.cpus)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    launch = launch_us()
    model = llama(args.seed)

    def fresh_batches() -> list:
        """The run's batches, made before the timed steps: the peak memory counts from here."""
        data = batches(args.batch, args.seq)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return data

    def row(ms_per_step: float, final_loss: float, **extra) -> dict:
        return {
            "system": system, "dtype": dtype_name, "ms_per_step": ms_per_step,
            "tokens_per_s": args.batch * args.seq / (ms_per_step * 1e-3),
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30, "final_loss": final_loss,
            "params": sum(p.numel() for p in model.parameters()), "torch": torch.__version__,
            "launch_us": launch, "launch_us_after": launch_us(), **extra,
        }  # fmt: skip

    if system.endswith("-paired"):  # peak_gib: both models, not comparable to the other systems'
        return row(**paired_run(system, model, dtype, fresh_batches(), args))
    if system.startswith("hf"):
        nosync, nolink = system in ("hf-nosync", "hf-quiet"), system in ("hf-nolink", "hf-quiet")
        ms, losses = hf_run(model, dtype, fresh_batches(), args, nosync=nosync, nolink=nolink)
        return row(statistics.median(ms), losses[-1])
    if system == "autocast":
        step, probe = autocast_runner(model, dtype)
    elif system == "halfprec-keep":
        step, probe = keep_runner(model, dtype)
    elif system.startswith("halfprec"):
        clip = None if system.endswith("-noclip") else CLIP
        step, probe = halfprec_runner(model, dtype, clip, scheduled=system == "halfprec-sched")
    else:
        clip = 0.0 if system.endswith("-noclip") else CLIP
        step, probe = deepspeed_runner(
            model,
            dtype,
            args.batch,
            reset=system == "deepspeed-reset",
            clip=clip,
            scaled=system == "deepspeed-scaled",
        )
    data = fresh_batches()
    total = args.warmup + args.steps
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(total)
    ]
    losses, probes = [], []  # probe() syncs: only with --trace, which is not for timing
    for i in range(total):
        events[i][0].record()
        losses.append(step(data[i % len(data)]))
        events[i][1].record()
        if args.trace:
            probes.append(probe())
    torch.cuda.synchronize()

    def num(v):
        return None if v is None else float(v)

    result = row(
        statistics.median(periods(events[args.warmup :])), float(losses[-1]), **getattr(step, "info", {})
    )
    if hasattr(step, "skipped"):
        result["skipped_steps"] = int(step.skipped())
    if args.trace:
        result["trace"] = [
            {"loss": float(lo), "grad_norm": num(n), "scale": num(s)}
            for lo, (n, s) in zip(losses, probes, strict=True)
        ]
    return result


def available(system: str) -> bool:
    if not system.startswith("deepspeed"):
        return True
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        return False
    return True


def pick_cpus(spec: str) -> set[int]:
    """The cores ``--cpus`` names; for 'auto', the two where a probe process enqueues fastest."""
    if not spec:
        return set()
    if spec != "auto":
        return {int(c) for c in spec.split(",")}
    proc = subprocess.run(
        [sys.executable, __file__, "--cpus", "probe"], capture_output=True, text=True, check=True
    )
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    speeds = {int(k): v for k, v in json.loads(line[len("RESULT ") :]).items()}
    print("host us/launch per core: " + ", ".join(f"{c}: {v:.1f}" for c, v in sorted(speeds.items())))
    chosen = set(sorted(speeds, key=speeds.get)[:2])
    print(f"pinning every run to cores {sorted(chosen)}", flush=True)
    return chosen


def trees_of(spec: str) -> dict[str | None, Path | None]:
    """``--trees name=DIR,...``: the ``src`` folders the runs import halfprec from, by name; {None: None}: the
    installed or ``PYTHONPATH`` one."""
    if not spec:
        return {None: None}
    trees = {}
    for item in spec.split(","):
        name, _, path = item.partition("=")
        src = Path(path) / "src"
        if not name or not (src / "halfprec" / "__init__.py").is_file():
            raise SystemExit(f"--trees: {item!r} is not NAME=DIR with DIR/src/halfprec in it")
        trees[name] = src.resolve()
    return trees


def paired(rows: list[dict], base: str) -> dict[tuple[str, str], list[float]]:
    """Each system's tokens/s over ``base``'s in the same round and dtype, per round: runs next to each other in
    time, so the host's drift over an invocation cancels more than between best rounds."""
    ref = {(r["round"], r["dtype"]): r["tokens_per_s"] for r in rows if r["system"] == base}
    out: dict[tuple[str, str], list[float]] = {}
    for r in rows:
        b = ref.get((r["round"], r["dtype"]))
        if b and r["system"] != base:
            out.setdefault((r["system"], r["dtype"]), []).append(r["tokens_per_s"] / b)
    return out


def table(rows: list[dict]) -> str:
    lines = [
        "| round | system | dtype | ms/step | tokens/s | peak GiB | loss after N steps | host us/launch |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.get('round', 'best')} | {r['system']} | {r['dtype']} | {r['ms_per_step']:.1f} | "
            f"{r['tokens_per_s']:,.0f} | {r['peak_gib']:.2f} | {r['final_loss']:.3f} | "
            f"{r.get('launch_us', float('nan')):.1f} |"
        )
    return "\n".join(lines)


def paired_table(rows: list[dict]) -> str:
    """The paired systems' runs: the Trainer against the plain loop it alternated with."""
    lines = [
        "| round | system | dtype | Trainer ms/step | plain loop ms/step | Trainer tokens/s over plain | losses |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "paired_tokens_ratio" in r:
            lines.append(
                f"| {r.get('round', '')} | {r['system']} | {r['dtype']} | {r['ms_per_step']:.1f} | "
                f"{r['plain_ms_per_step']:.1f} | {r['paired_tokens_ratio']:.3f} | "
                f"{r['final_loss']:.3f} / {r['plain_final_loss']:.3f} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--systems", default="autocast,halfprec,deepspeed")
    parser.add_argument("--dtypes", default="bf16,fp16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--trace", action="store_true", help="every step's loss, scale and grad norm in the JSON"
    )
    parser.add_argument(
        "--cpus", default="", help="pin every run to these cores (e.g. 2,3), or 'auto': the two cores where a "
        "probe enqueues fastest (the step is host-paced; pinning also stops the launching thread migrating)",
    )  # fmt: skip
    parser.add_argument(
        "--trees", default="", help="A/B of source trees: NAME=DIR,NAME=DIR (each DIR holds src/halfprec); every "
        "system runs once per tree in each round, as SYSTEM@NAME, and the ratios are against the first tree's",
    )  # fmt: skip
    parser.add_argument("--json", type=Path, default=None, help="write every run's result here")
    parser.add_argument("--child", nargs=2, metavar=("SYSTEM", "DTYPE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.cpus == "probe":  # internal: the 'auto' probe's child
        print("RESULT " + json.dumps(core_speeds(sorted(os.sched_getaffinity(0)))), flush=True)
        return
    args.cpus = pick_cpus(args.cpus)
    if args.child:
        print("RESULT " + json.dumps(child(*args.child, args)), flush=True)
        return
    systems = [s for s in args.systems.split(",") if s]
    for s in systems:
        if s not in SYSTEMS:
            parser.error(f"unknown system {s!r}; choose from {', '.join(SYSTEMS)}")
    missing = [s for s in systems if not available(s)]
    if missing:
        print(f"skipping {', '.join(missing)}: deepspeed is not installed", file=sys.stderr)
    systems = [s for s in systems if s not in missing]
    dtypes = [d for d in args.dtypes.split(",") if d]
    rows, failures = [], []
    passthrough = [f"--{k}={getattr(args, k)}" for k in ("steps", "warmup", "batch", "seq", "seed")]
    passthrough += [f"--cpus={','.join(map(str, sorted(args.cpus)))}"] if args.cpus else []
    trees = trees_of(args.trees)
    for rnd in range(1, args.rounds + 1):
        for system in systems:
            for tree, src in trees.items():
                label = system if tree is None else f"{system}@{tree}"
                env = dict(os.environ)
                if src is not None:  # in front of the PYTHONPATH the other packages come from
                    env["PYTHONPATH"] = os.pathsep.join(
                        filter(None, [str(src), os.environ.get("PYTHONPATH")])
                    )
                for dtype in dtypes:
                    if system == "deepspeed-reset" and dtype != "fp16":
                        continue
                    cmd = [sys.executable, __file__, "--child", system, dtype, *passthrough]
                    cmd += ["--trace"] if args.trace else []
                    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
                    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
                    if proc.returncode != 0 or line is None:
                        failures.append((rnd, label, dtype, proc.stderr[-2000:]))
                        print(f"round {rnd} {label} {dtype}: FAILED\n{proc.stderr[-2000:]}", file=sys.stderr)
                        continue
                    row = json.loads(line[len("RESULT ") :]) | {"round": rnd, "system": label}
                    rows.append(row)
                    print(table([row]).splitlines()[-1], flush=True)
                    if "paired_tokens_ratio" in row:
                        print(paired_table([row]).splitlines()[-1], flush=True)
    best = {}
    for r in rows:
        key = (r["system"], r["dtype"])
        if key not in best or r["ms_per_step"] < best[key]["ms_per_step"]:
            best[key] = r
    print("\nEvery round:\n" + table(rows))
    print(
        "\nBest round of each:\n"
        + table([{k: v for k, v in r.items() if k != "round"} for r in best.values()])
    )
    if any("paired_tokens_ratio" in r for r in rows):
        print(
            "\nPaired runs (the Trainer and the plain loop alternating in one process):\n"
            + paired_table(rows)
        )
    first = next(iter(trees))
    base = systems[0] if first is None else f"{systems[0]}@{first}"
    ratios = paired(rows, base)
    if ratios:
        print(
            f"\nTokens/s against {base}'s run of the same round and dtype (median over rounds; each round):"
        )
        for (system, dtype), values in ratios.items():
            each = " ".join(f"{v:.3f}" for v in values)
            print(f"| {system} | {dtype} | {statistics.median(values):.3f} | {each} |")
    if args.json:
        args.json.write_text(
            json.dumps({"runs": rows, "failures": failures, "cpus": sorted(args.cpus)}, indent=1)
        )
    if failures:
        sys.exit(1)


if __name__ == "__main__":
    main()
