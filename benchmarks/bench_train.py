"""End-to-end training benchmark: a transformers Llama (``--shape``: ~271M params by default, ~1.2B, or a tiny one
for CPU smoke tests) under torch autocast, halfprec, FSDP2 and DeepSpeed ZeRO-0, in interleaved rounds.

    python benchmarks/bench_train.py [--rounds 3] [--steps 40] [--systems autocast,halfprec,deepspeed]
        [--shape 271m|1.2b|tiny] [--smoke]

Every (round, system, dtype) runs in its own process (peak memory is per process; nothing is shared between
systems), rounds interleaved because the device's speed drifts. Each run builds the same model from the same seed,
trains it with AdamW (lr 3e-4, weight decay 0.1, clipping at 1.0) on the same token batches, and reports the median
ms/step after the warm-up steps (CUDA events, from one step's start to the next's), tokens/s, the peak memory
allocated during training, the loss of the last step, and the host's time to enqueue one tiny kernel, measured
before the run (and after it, in the JSON: the step is host-paced, and the device's host speed varies). Every
system runs the model with ``use_cache=False``, as the HF Trainer does. ``--cpus`` pins the runs to cores; the
summary gives each system's tokens/s over the first system's in the same round and dtype. ``--trees
old=DIR,new=DIR`` runs each system once per source tree in every round (an A/B of a change, interleaved).
``--trace`` adds every step's loss, loss scale and grad norm to the JSON. ``--memory`` (CUDA; not for ``hf*`` or
``*-paired``) records the allocator's history (``torch.cuda.memory._record_memory_history``, Python stacks) from
the run's start and adds ``peak_sites`` to the JSON: the blocks live at the peak of ``peak_gib``'s window (warm-up
and timed steps), summed by the innermost frame outside torch's own files that allocated them (``live_at_peak``),
beside that peak in requested bytes, traced (``peak_traced_gib``) and torch's count (``peak_requested_gib``), which
should agree; ``peak_gib`` counts the allocator's rounded blocks. Its ms/step are then not timings (the row says so).

Shapes (``SHAPES``; batches of ``--batch`` 8 rows of the shape's sequence length unless ``--seq`` says otherwise):
``271m`` hidden 1024, 16 layers, MLP 2816, 16 heads, vocab 32000, seq 1024 (the default); ``1.2b`` hidden 2048, 20
layers, MLP 5632, 16 heads, vocab 32000, seq 1024 (1.16B params); ``tiny`` hidden 64, 2 layers, MLP 128, 4 heads,
vocab 512, seq 32: CPU smoke tests only.

MFU: model FLOPs per trained token ``6 * N + 12 * layers * hidden * seq`` (forward and backward: 6 per weight of a
matmul, 12 per layer for the attention scores and their weighted sum over the sequence, not halved for the causal
mask: PaLM's appendix B, torchtitan's count), N the params of the matmuls: every param but the input embedding's
(a lookup; the untied ``lm_head`` counts), times tokens/s, over ``PEAK_FLOPS``, the H200's dense bf16 (and fp16)
peak. The JSON has ``params`` (all of them) and ``flops_per_token``.

``--smoke``: every system that can run on the CPU (or those ``--systems`` names) for 3 steps on the ``tiny`` shape
on the CPU, bf16, one round (``--shape tiny --device cpu --dtypes bf16 --rounds 1 --warmup 1 --steps 2``); it fails
unless every run gives a finite loss. On the CPU the steps are timed by the host clock and no peak memory is
reported; the ``hf*``, ``deepspeed*`` and ``*-paired`` systems need CUDA.

Systems:
  autocast   fp32 model under ``torch.autocast``, ``torch.optim.AdamW(fused=True)``; fp16 with ``GradScaler``
  halfprec   ``halfprec.initialize`` (16-bit model, fused optimizer on CUDA)
  halfprec-split  the same with ``masters="split"`` (``impl="triton"``: CUDA, or the Triton interpreter; bf16 only)
  hf         the HF ``Trainer`` with halfprec (``HalfprecTrainer``, its AdamW on halfprec's fused path, clipping
             in the kernel, constant LR, the Trainer's default logging (every 500 steps; the losses are kept on the
             device), the batches in the others' order), timed from one step's begin to the next's by a callback
             (so the batch fetch between steps counts)
  deepspeed  DeepSpeed ZeRO-0 with its FusedAdam (``gradient_clipping: 1.0``), when it is installed
  deepspeed-reset  the same, with the Adam state DeepSpeed's wrapper creates at construction (a step on zero
             grads: ``inner_state_steps_after_initialize`` is ``[1]`` for fp16 and bf16 in 0.19.8) reset before
             training: a diagnostic of that construction step
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
  fsdp2      FSDP2's own recipe on a one-rank process group (the run makes it: nccl on CUDA, gloo on the CPU, over a
             file store): the fp32 model, ``fully_shard`` on each decoder layer then the root (halfprec's
             ``zero_stage=3`` policy: the children of the model's first ``nn.ModuleList``) with
             ``MixedPrecisionPolicy(param_dtype=bf16 or fp16, reduce_dtype=fp32)``, ``torch.optim.AdamW(fused=True)``
             (unfused on the CPU), ``clip_grad_norm_``; fp16 with ``torch.amp.GradScaler``, which takes FSDP2's
             DTensor grads (torch's documented way since 2.5; ``ShardedGradScaler`` is FSDP1's)
  fsdp2-halfprec  the 16-bit model (``model.to(dtype)``: FSDP2 fixes its shards' dtype) sharded the same way with
             no param cast and fp32 reduce-scatters (``MixedPrecisionPolicy(reduce_dtype=fp32)``, as halfprec's
             ``zero_stage=3``), ``MixedPrecisionOptimizer(AdamW, impl="triton", max_grad_norm=1.0)`` over the shards
             in a plain loop (``backward``, ``step``, ``zero_grad``); its masters start from the 16-bit weights (a
             plain loop's; the engine's ``zero_stage=3`` starts them from the fp32 ones). On the CPU without
             ``TRITON_INTERPRET=1`` it runs ``impl="torch"``, and its row says so
  fsdp2-halfprec-split  the same with ``masters="split"`` (bf16 only; CUDA, or the Triton interpreter)
  fsdp2-halfprec-exact  the same with ``impl="torch"``, the exact strategy: a diagnostic
  halfprec-float8  ``halfprec`` on the model after ``torchao.float8.convert_to_float8_training`` (every Linear but
             the ``lm_head`` whose dims are multiples of 16), converted in fp32 and cast to 16 bits by the engine (a
             ``Float8Linear`` keeps its weight a plain param), so the masters start from the fp32 weights as in
             ``halfprec`` (bf16 only; when torchao imports)
  torchao-float8  torchao's recipe: the fp32 model converted the same way, under ``torch.autocast(bf16)``, with
             ``torch.optim.AdamW(fused=True)`` (``autocast``'s loop; bf16 only; when torchao imports)
  SYSTEM-compiled  SYSTEM with ``torch.compile`` (inductor, default settings) applied before its setup: the whole
             model for ``autocast``, ``halfprec*`` and the float8 systems; for ``fsdp2*`` each decoder layer
             (``torch.compile(layer, fullgraph=True)`` put back in its place, then ``fully_shard``), as torchtitan
             compiles under FSDP2; for ``deepspeed*`` DeepSpeed's own ``engine.compile()`` after its
             ``initialize`` (the module it wraps, inductor, default settings). Not for ``hf*`` or ``*-paired``. The
             compile runs in the warm-up steps (``--warmup``), which are not timed
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

SYSTEMS = (
    "autocast",
    "halfprec",
    "halfprec-split",
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
    "fsdp2",
    "fsdp2-halfprec",
    "fsdp2-halfprec-split",
    "fsdp2-halfprec-exact",
    "halfprec-float8",
    "torchao-float8",
)
COMPILED = "-compiled"  # SYSTEM-compiled: SYSTEM under torch.compile (module docstring)
NOT_COMPILED = ("hf",)  # prefixes of the systems with no compiled variant (nor the *-paired ones)
ONLY_DTYPE = {  # the systems that run in one dtype
    "halfprec-split": "bf16",  # split masters are bf16's
    "fsdp2-halfprec-split": "bf16",
    "halfprec-float8": "bf16",  # torchao's float8 recipe is bf16's
    "torchao-float8": "bf16",
}
PAIRED_BLOCK = 5  # steps per block in the paired systems
LR, WEIGHT_DECAY, CLIP = 3e-4, 0.1, 1.0
# the H200 SXM's dense BF16 Tensor Core peak, FP16's the same: NVIDIA H200 datasheet (1,979 TFLOP/s with 2:4
# sparsity, twice the dense rate)
PEAK_FLOPS = 989e12


@dataclass(frozen=True, kw_only=True)
class Shape:
    """A Llama's size (``LlamaConfig``'s fields) and the sequence length of its batches."""

    hidden: int
    """``hidden_size``"""
    layers: int
    """``num_hidden_layers``"""
    intermediate: int
    """``intermediate_size``, the MLP's"""
    heads: int
    """``num_attention_heads``, and as many key/value heads"""
    vocab: int
    """``vocab_size``"""
    seq: int
    """tokens per row, unless ``--seq`` says otherwise; also ``max_position_embeddings``"""


SHAPES = {
    "271m": Shape(hidden=1024, layers=16, intermediate=2816, heads=16, vocab=32000, seq=1024),
    "1.2b": Shape(hidden=2048, layers=20, intermediate=5632, heads=16, vocab=32000, seq=1024),
    "tiny": Shape(hidden=64, layers=2, intermediate=128, heads=4, vocab=512, seq=32),  # CPU smoke tests
}


def llama(seed: int, shape: Shape = SHAPES["271m"], device: str = "cuda"):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.heads,
        max_position_embeddings=shape.seq, tie_word_embeddings=False, attn_implementation="sdpa",
        use_cache=False,  # training builds no KV cache: the HF Trainer sets the same (TrainingArguments.use_cache)
    )  # fmt: skip
    torch.manual_seed(seed)
    with torch.device(device):
        return LlamaForCausalLM(config)


def batches(batch: int, seq: int, count: int = 4, *, vocab: int = 32000, device: str = "cuda"):
    import torch

    g = torch.Generator(device=device).manual_seed(1)
    return [torch.randint(0, vocab, (batch, seq), device=device, generator=g) for _ in range(count)]


def flops_per_token(model, shape: Shape, seq: int) -> int:
    """Model FLOPs of one trained token, forward and backward (the module docstring's MFU formula)."""
    import torch

    lookups = {p for m in model.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters()}
    matmuls = sum(p.numel() for p in model.parameters() if p not in lookups)
    return 6 * matmuls + 12 * shape.layers * shape.hidden * seq


class HostEvent:
    """``torch.cuda.Event``'s ``record()`` and ``elapsed_time()`` on the host clock, for runs on the CPU."""

    def record(self) -> None:
        self.t = time.perf_counter()

    def elapsed_time(self, end: HostEvent) -> float:
        return (end.t - self.t) * 1e3


def timing_event(device: str):
    import torch

    return torch.cuda.Event(enable_timing=True) if device == "cuda" else HostEvent()


def synchronize(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def autocast_runner(model, dtype, *, device: str = "cuda", autocast: bool = True):
    """``autocast`` (and ``torchao-float8``); ``autocast=False``: ``fsdp2``'s loop, the 16-bit compute being
    FSDP2's ``MixedPrecisionPolicy``'s. Fused AdamW on CUDA only (the smoke test's CPU runs take the default)."""
    import torch

    fused = True if device == "cuda" else None
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=fused)
    scaler = torch.amp.GradScaler(device) if dtype == torch.float16 else None

    def step(x):
        with torch.autocast(device, dtype=dtype, enabled=autocast):
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


def halfprec_runner(model, dtype, clip=CLIP, scheduled=False, masters="fp32"):
    import torch

    import halfprec

    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    precision = {torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0) if scheduled else None
    split = (
        dict(masters="split", impl="triton") if masters == "split" else {}
    )  # the interpreter needs "triton"
    engine = halfprec.initialize(
        model, opt, precision=precision, max_grad_norm=clip, lr_scheduler=sched, **split
    )

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


@contextlib.contextmanager
def one_rank_group(device: str):
    """The default process group of one rank that FSDP2 shards over (nccl on CUDA, gloo on the CPU), made over a
    file store in a fresh temporary folder (no port to pick) and destroyed on the way out."""
    import tempfile

    import torch
    import torch.distributed as dist

    with tempfile.TemporaryDirectory() as folder:
        if device == "cuda":
            torch.cuda.set_device(0)
        backend = "nccl" if device == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"file://{folder}/store", rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def shard(model, policy, *, device: str, compiled: bool) -> None:
    """``fully_shard`` over a one-rank mesh by halfprec's ``zero_stage=3`` policy (``prepare.fully_shard_model``):
    each child with params of the model's first ``nn.ModuleList`` (the decoder layers), then the root.
    ``compiled``: each such layer ``torch.compile``d first and put back in its place, as torchtitan compiles a
    model it shards (``apply_compile`` before ``apply_fsdp``: FSDP2's hooks stay outside the compiled layers)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device, (1,))
    layers = next(m for m in model.modules() if isinstance(m, torch.nn.ModuleList))
    for name, block in list(layers.named_children()):
        if next(block.parameters(), None) is None:
            continue
        if compiled:
            block = torch.compile(block, fullgraph=True)
            layers.register_module(name, block)
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)


def fsdp2_runner(model, dtype, *, device: str, compiled: bool):
    """``fsdp2``: FSDP2's own mixed precision over the fp32 model, in ``autocast``'s loop without autocast."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    shard(model, policy, device=device, compiled=compiled)
    return autocast_runner(model, dtype, device=device, autocast=False)


def fsdp2_halfprec_runner(model, dtype, *, impl: str, masters: str, device: str, compiled: bool):
    """``fsdp2-halfprec*``: the 16-bit model sharded with fp32 reduce-scatters, ``MixedPrecisionOptimizer`` over
    its shards in a plain loop (module docstring)."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import halfprec
    from halfprec.prepare import cast_module

    info = {"impl": impl, "masters": masters}
    if device == "cpu" and impl == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        impl = "torch"  # the fused kernels take CPU params only under the interpreter
        info = {"impl": impl, "masters": masters, "note": "impl='torch': CPU without TRITON_INTERPRET=1"}
    # FSDP2 fixes the shards' dtype at fully_shard(); the rotary inv_freq stays fp32, as under FSDP2's own recipe
    cast_module(model, dtype)
    shard(model, MixedPrecisionPolicy(reduce_dtype=torch.float32), device=device, compiled=compiled)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    mp = halfprec.MixedPrecisionOptimizer(opt, impl=impl, masters=masters, max_grad_norm=CLIP)

    def step(x):
        loss = model(input_ids=x, labels=x).loss
        mp.backward(loss)
        mp.step()
        mp.zero_grad()
        return loss.detach()

    step.info = info
    return step, lambda: (mp.grad_norm, mp.step_loss_scale)


def float8_filter(module, fqn: str) -> bool:
    """The Linears torchao's float8 training converts: not the ``lm_head`` (torchtitan's float8 recipe leaves the
    output layer in 16 bits), and only those whose dims are multiples of 16, as float8 matmuls need."""
    import torch

    return (
        isinstance(module, torch.nn.Linear)
        and fqn != "lm_head"
        and module.in_features % 16 == 0
        and module.out_features % 16 == 0
    )


def float8_module():
    """``torchao.float8``, imported quietly: torchao logs a warning for each CUDA kernel library it cannot load
    (all of them on a CPU build of torch)."""
    import logging

    logging.getLogger("torchao").setLevel(logging.ERROR)
    import torchao.float8

    return torchao.float8


def to_float8(model) -> None:
    """``torchao.float8.convert_to_float8_training`` in place (tensorwise dynamic scaling, its default)."""
    float8_module().convert_to_float8_training(model, module_filter_fn=float8_filter)


def deepspeed_runner(
    model, dtype, batch: int, *, reset: bool, clip=CLIP, scaled: bool = False, compiled=False
):
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
    if compiled:
        engine.compile()  # DeepSpeed's own: torch.compile of the module it wraps (inductor, default settings)
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
    plain_step, _ = (autocast_runner if autocast else halfprec_runner)(
        llama(args.seed, SHAPES[args.shape]), dtype
    )
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


HISTORY_ENTRIES = 1 << 22  # --memory's allocator trace: a ring buffer of this many events


def site_of(frames: list[dict], torch_dir: str) -> str:
    """Where a block was allocated: the innermost Python frame outside torch's own files (``torch_dir``, the
    folder of ``torch/__init__.py``), as ``folder/file:line function``."""
    for f in frames:
        if not f["filename"].startswith(torch_dir):
            path = Path(f["filename"])
            return f"{path.parent.name}/{path.name}:{f['line']} {f['name']}"
    return "torch" if frames else "no Python frame (autograd's backward thread)"


def live_at_peak(trace: list[dict], torch_dir: str, start: int = 0, top: int = 12) -> tuple[int, list[dict]]:
    """The requested bytes at the peak of an allocator trace (``torch.cuda.memory._snapshot()``'s
    ``device_traces`` entry, recorded from before the first allocation; its sizes are the requested ones, which
    ``memory_stats()["requested_bytes.all.peak"]`` counts) from the level before event ``start`` on, and the
    blocks live there summed by ``site_of``, largest first (``top`` of them, then the rest as one)."""

    def replay(stop: int) -> tuple[dict, int, int]:
        live, now, best, at = {}, 0, -1, -1
        for i, e in enumerate(trace[:stop]):
            if i == start:  # the level at the window's opening is its first candidate
                best, at = now, i - 1
            if e["action"] == "alloc":
                live[e["addr"]] = e
                now += e["size"]
            elif e["action"] == "free_requested":  # where torch's allocated and requested counters drop
                live.pop(e["addr"], None)
                now -= e["size"]
            if i >= start and now > best:
                best, at = now, i
        return live, best, at

    if not 0 <= start < len(trace):
        raise ValueError(f"the trace has {len(trace)} events, none from event {start} on")
    _, best, at = replay(len(trace))
    sites: dict[str, list[int]] = {}
    for e in replay(at + 1)[0].values():
        total = sites.setdefault(site_of(e.get("frames", []), torch_dir), [0, 0])
        total[0] += e["size"]
        total[1] += 1
    ranked = sorted(sites.items(), key=lambda kv: -kv[1][0])
    rows = [{"site": k, "mib": b / 2**20, "blocks": n} for k, (b, n) in ranked[:top]]
    if len(ranked) > top:
        rest = ranked[top:]
        rows.append({"site": f"{len(rest)} other sites", "mib": sum(b for _, (b, _n) in rest) / 2**20,
                     "blocks": sum(n for _, (_b, n) in rest)})  # fmt: skip
    return best, rows


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
    device, shape = args.device, SHAPES[args.shape]
    cuda = device == "cuda"
    memory = cuda and args.memory
    if memory:  # before the first allocation: every block live at the peak has its site
        torch.cuda.memory._record_memory_history(
            context="alloc", stacks="python", max_entries=HISTORY_ENTRIES
        )
    launch = launch_us() if cuda else math.nan
    model = llama(args.seed, shape, device)
    params, flops = sum(p.numel() for p in model.parameters()), flops_per_token(model, shape, args.seq)
    base, compiled = system.removesuffix(COMPILED), system.endswith(COMPILED)

    trace_start = 0  # with --memory: the trace's first event in the window of peak_gib

    def fresh_batches() -> list:
        """The run's batches, made before the timed steps: the peak memory counts from here."""
        nonlocal trace_start
        data = batches(args.batch, args.seq, vocab=shape.vocab, device=device)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        if memory:
            trace_start = len(torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()])
        return data

    def row(ms_per_step: float, final_loss: float, **extra) -> dict:
        tokens_per_s = args.batch * args.seq / (ms_per_step * 1e-3)
        return {
            "system": system, "dtype": dtype_name, "ms_per_step": ms_per_step, "tokens_per_s": tokens_per_s,
            "mfu": tokens_per_s * flops / PEAK_FLOPS,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None, "final_loss": final_loss,
            "params": params, "flops_per_token": flops, "shape": args.shape, "device": device,
            "torch": torch.__version__, "launch_us": launch, "launch_us_after": launch_us() if cuda else math.nan,
            **extra,
        }  # fmt: skip

    if system.endswith("-paired"):  # peak_gib: both models, not comparable to the other systems'
        return row(**paired_run(system, model, dtype, fresh_batches(), args))
    if system.startswith("hf"):
        nosync, nolink = system in ("hf-nosync", "hf-quiet"), system in ("hf-nolink", "hf-quiet")
        ms, losses = hf_run(model, dtype, fresh_batches(), args, nosync=nosync, nolink=nolink)
        return row(statistics.median(ms), losses[-1])
    if base.endswith("-float8"):
        to_float8(model)
    if compiled and not base.startswith(("fsdp2", "deepspeed")):  # fsdp2*: in shard(); deepspeed*: its runner
        model = torch.compile(model)
    if base in ("autocast", "torchao-float8"):
        step, probe = autocast_runner(model, dtype, device=device)
    elif base == "fsdp2":
        step, probe = fsdp2_runner(model, dtype, device=device, compiled=compiled)
    elif base.startswith("fsdp2-halfprec"):
        impl = "torch" if base.endswith("-exact") else "triton"
        masters = "split" if base.endswith("-split") else "fp32"
        step, probe = fsdp2_halfprec_runner(
            model, dtype, impl=impl, masters=masters, device=device, compiled=compiled
        )
    elif base == "halfprec-keep":
        step, probe = keep_runner(model, dtype)
    elif base.startswith("halfprec"):  # halfprec, -split, -noclip, -sched, -float8
        clip = None if base.endswith("-noclip") else CLIP
        masters = "split" if base == "halfprec-split" else "fp32"
        step, probe = halfprec_runner(model, dtype, clip, scheduled=base == "halfprec-sched", masters=masters)
    else:
        clip = 0.0 if base.endswith("-noclip") else CLIP
        step, probe = deepspeed_runner(
            model,
            dtype,
            args.batch,
            reset=base == "deepspeed-reset",
            clip=clip,
            scaled=base == "deepspeed-scaled",
            compiled=compiled,
        )
    data = fresh_batches()
    total = args.warmup + args.steps
    events = [(timing_event(device), timing_event(device)) for _ in range(total)]
    losses, probes = [], []  # probe() syncs: only with --trace, which is not for timing
    for i in range(total):
        events[i][0].record()
        losses.append(step(data[i % len(data)]))
        events[i][1].record()
        if args.trace:
            probes.append(probe())
    synchronize(device)

    def num(v):
        return None if v is None else float(v)

    result = row(
        statistics.median(periods(events[args.warmup :])), float(losses[-1]), **getattr(step, "info", {})
    )
    if hasattr(step, "skipped"):
        result["skipped_steps"] = int(step.skipped())
    if memory:
        trace = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
        torch.cuda.memory._record_memory_history(enabled=None)
        # a full ring buffer has wrapped: its first blocks and trace_start are lost
        if len(trace) >= HISTORY_ENTRIES:
            raise RuntimeError(
                f"--memory: the allocator trace filled its {HISTORY_ENTRIES} entries; run fewer steps"
            )
        torch_dir = os.path.dirname(torch.__file__) + os.sep
        traced, result["peak_sites"] = live_at_peak(trace, torch_dir, trace_start)
        result["peak_traced_gib"] = traced / 2**30
        result["peak_requested_gib"] = torch.cuda.memory_stats()["requested_bytes.all.peak"] / 2**30
        result["note"] = "allocator history on: ms/step is not a timing"
    if args.trace:
        result["trace"] = [
            {"loss": float(lo), "grad_norm": num(n), "scale": num(s)}
            for lo, (n, s) in zip(losses, probes, strict=True)
        ]
    return result


def unavailable(system: str, device: str) -> str | None:
    """Why ``system`` cannot run here (a missing package, no CUDA), or None when it can."""
    base = system.removesuffix(COMPILED)
    if device != "cuda" and (base.startswith(("hf", "deepspeed")) or base.endswith("-paired")):
        return "needs CUDA"
    if base.startswith("deepspeed"):
        try:
            import deepspeed  # noqa: F401
        except ImportError:
            return "deepspeed is not installed"
    if base.endswith("-float8"):
        try:
            float8_module()
        except ImportError:
            return "torchao is not installed (the [float8] extra)"
    split = base in ("halfprec-split", "fsdp2-halfprec-split")
    if split and device != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return "split masters need the fused kernels: CUDA, or TRITON_INTERPRET=1 on the CPU"
    return None


def provenance() -> dict:
    """What the raw file needs to be a report: the date (UTC), the command, the source's commit (``-dirty`` with
    uncommitted changes; None outside a git checkout; with ``--trees``, this script's), the versions of the
    packages the systems use (None: not installed) and the GPUs."""
    from importlib import metadata

    def version(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    def output(*command: str) -> str | None:
        if shutil.which(command[0]) is None:
            return None
        done = subprocess.run(command, cwd=Path(__file__).parent, capture_output=True, text=True, timeout=30)
        return (done.stdout.strip() or None) if done.returncode == 0 else None

    # "-dirty" when the checkout has uncommitted changes: the run is then not of that commit alone
    commit = output("git", "describe", "--always", "--dirty", "--abbrev=7")
    gpus = output("nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader")
    import torch

    versions = {"python": sys.version.split()[0], "torch": torch.__version__}
    versions |= {p: version(p) for p in ("triton", "transformers", "accelerate", "deepspeed", "torchao")}
    return {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "command": sys.argv, "commit": commit,
        "versions": versions, "gpus": gpus.splitlines() if gpus else [],
    }  # fmt: skip


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
    """MFU: of ``PEAK_FLOPS`` (module docstring); note: what the run did instead of what its system says."""
    lines = [
        "| round | system | dtype | ms/step | tokens/s | MFU % | peak GiB | loss after N steps | host us/launch | note |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        peak = "n/a" if r.get("peak_gib") is None else f"{r['peak_gib']:.2f}"
        lines.append(
            f"| {r.get('round', 'best')} | {r['system']} | {r['dtype']} | {r['ms_per_step']:.1f} | "
            f"{r['tokens_per_s']:,.0f} | {100 * r.get('mfu', float('nan')):.1f} | {peak} | "
            f"{r['final_loss']:.3f} | {r.get('launch_us', float('nan')):.1f} | {r.get('note', '')} |"
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
    parser.add_argument(
        "--systems", default=None, help="comma-separated (module docstring); default autocast,halfprec,deepspeed, "
        "with --smoke every one that can run on the CPU",
    )  # fmt: skip
    parser.add_argument("--dtypes", default="bf16,fp16")
    parser.add_argument("--shape", choices=SHAPES, default="271m", help="the Llama's size (module docstring)")
    parser.add_argument(
        "--device", choices=("cuda", "cpu"), default="cuda", help="cpu: host-clock timing, no peak memory"
    )
    parser.add_argument(
        "--smoke", action="store_true", help="3 steps of every system on the tiny shape on the CPU, bf16, one "
        "round; fails unless every loss is finite (module docstring)",
    )  # fmt: skip
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=None, help="tokens per row; default: the shape's")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--trace", action="store_true", help="every step's loss, scale and grad norm in the JSON"
    )
    parser.add_argument(
        "--memory", action="store_true", help="CUDA: the blocks live at the peak, by where they were allocated "
        "(peak_sites in the JSON; module docstring)",
    )  # fmt: skip
    parser.add_argument(
        "--cpus", default="", help="pin every run to these cores (e.g. 2,3), or 'auto': the two cores where a "
        "probe enqueues fastest (the step is host-paced; pinning also stops the launching thread migrating)",
    )  # fmt: skip
    parser.add_argument(
        "--trees", default="", help="A/B of source trees: NAME=DIR,NAME=DIR (each DIR holds src/halfprec); every "
        "system runs once per tree in each round, as SYSTEM@NAME, and the ratios are against the first tree's",
    )  # fmt: skip
    parser.add_argument(
        "--json", type=Path, default=None, help="write every run's result here (again after each run)"
    )
    parser.add_argument("--child", nargs=2, metavar=("SYSTEM", "DTYPE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.cpus == "probe":  # internal: the 'auto' probe's child
        print("RESULT " + json.dumps(core_speeds(sorted(os.sched_getaffinity(0)))), flush=True)
        return
    args.cpus = pick_cpus(args.cpus)
    if args.smoke:  # 3 steps: 1 warm-up, 2 timed
        vars(args).update(shape="tiny", device="cpu", dtypes="bf16", rounds=1, warmup=1, steps=2)
    args.seq = args.seq or SHAPES[args.shape].seq
    if args.child:
        group = one_rank_group(args.device) if args.child[0].startswith("fsdp2") else contextlib.nullcontext()
        with group:
            result = child(*args.child, args)
        print("RESULT " + json.dumps(result), flush=True)
        return
    if args.systems is None:
        args.systems = ",".join(SYSTEMS) if args.smoke else "autocast,halfprec,deepspeed"
    systems = [s for s in args.systems.split(",") if s]
    for s in systems:
        base = s.removesuffix(COMPILED)
        if base not in SYSTEMS:
            parser.error(f"unknown system {s!r}; choose from {', '.join(SYSTEMS)} (or SYSTEM{COMPILED})")
        if s != base and (base.startswith(NOT_COMPILED) or base.endswith("-paired")):
            parser.error(f"{s!r}: {base} has no compiled variant; every system but hf* and *-paired has")
    if args.memory and (untraced := [s for s in systems if s.startswith("hf") or s.endswith("-paired")]):
        parser.error(f"--memory traces the plain-loop systems only; drop {', '.join(untraced)}")
    reasons = {s: unavailable(s, args.device) for s in systems}
    for s, reason in reasons.items():
        if reason is not None:
            print(f"skipping {s}: {reason}", file=sys.stderr)
    systems = [s for s in systems if reasons[s] is None]
    if not systems:
        raise SystemExit("no system to run here (the notes above say why each was skipped)")
    dtypes = [d for d in args.dtypes.split(",") if d]
    rows, failures = [], []
    keys = ("steps", "warmup", "batch", "seq", "seed", "shape", "device")
    passthrough = [f"--{k}={getattr(args, k)}" for k in keys]
    passthrough += [f"--cpus={','.join(map(str, sorted(args.cpus)))}"] if args.cpus else []
    trees = trees_of(args.trees)
    about = provenance()

    def save() -> None:
        """The JSON so far: a command stopped by a time limit keeps the runs it finished."""
        if args.json:
            record = {**about, "runs": rows, "failures": failures, "cpus": sorted(args.cpus)}
            args.json.write_text(json.dumps(record, indent=1))

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
                    if ONLY_DTYPE.get(system.removesuffix(COMPILED), dtype) != dtype:
                        continue
                    cmd = [sys.executable, __file__, "--child", system, dtype, *passthrough]
                    cmd += ["--trace"] if args.trace else []
                    cmd += ["--memory"] if args.memory else []
                    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
                    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
                    if proc.returncode != 0 or line is None:
                        failures.append((rnd, label, dtype, proc.stderr[-2000:]))
                        print(f"round {rnd} {label} {dtype}: FAILED\n{proc.stderr[-2000:]}", file=sys.stderr)
                        save()
                        continue
                    row = json.loads(line[len("RESULT ") :]) | {"round": rnd, "system": label}
                    rows.append(row)
                    save()
                    print(table([row]).splitlines()[-1], flush=True)
                    for site in row.get("peak_sites", []):
                        print(f"    {site['mib']:10.1f} MiB {site['blocks']:6d} blocks  {site['site']}")
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
    if failures:
        sys.exit(1)
    if args.smoke:
        nonfinite = [
            f"{r['system']} {r['dtype']}: {r['final_loss']}"
            for r in rows
            if not math.isfinite(r["final_loss"])
        ]
        if nonfinite or not rows:
            raise SystemExit(f"smoke: no run, or a non-finite loss: {'; '.join(nonfinite)}")
        print(f"\nsmoke: {len(rows)} runs, every loss finite")


if __name__ == "__main__":
    main()
