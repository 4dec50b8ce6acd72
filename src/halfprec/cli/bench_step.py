"""Timing of one optimizer step (fused, generic torch path, plain torch pipeline): ``step()`` only, grads in place
and grad marks set outside the timed region, the median of CUDA-event timings after warm-up, against the copy
bandwidth of the same run and the bytes floor of the algorithm (``FLOOR_BYTES``).

The fused rows also time the step as a training loop calls it (``time_as_users_call``): ``zero_grad()`` (torch's
default, set_to_none=True: the flat grad buffer is freed), a real backward that produces the grads (backward's
hooks copy them into a new flat buffer), a synchronize, then ``step()`` alone between CUDA events, with the host's
time to return from it. Back-to-back timing hides the host's work in ``step()`` behind the previous step's
kernels; after a synchronize the device waits for it, as it does in a loop paced by the host."""

from __future__ import annotations

import itertools
import logging
import statistics
import time
import warnings
from dataclasses import asdict, dataclass
from typing import Any

import torch

import halfprec

from ..kernels.launch import replay_stats
from ..kernels.settings import settings
from ..optim import FusedAdagrad, FusedAdamW, FusedLamb, FusedSGD

__all__ = [
    "BenchRow",
    "FLOOR_BYTES",
    "WORKLOADS",
    "bench_fused_optimizer",
    "bench_params",
    "copy_bandwidth",
    "format_table",
    "run_bench",
    "time_as_users_call",
    "users_backward",
]

# Bytes per param: AdamW reads the grads twice (norm, update), reads and writes master, m, v and writes the
# 16-bit param; SGD with momentum and Adagrad: 22; LAMB: its three passes (norm 2 + stage 22 + apply 18).
FLOOR_BYTES = {"adamw": 30, "sgd": 22, "adagrad": 22, "lamb": 42}
# impl -> bytes per param it adds to that floor. "split" (fused, masters="split", bf16): the master read and write
# become P and L (4 + 4 B) and the separate param write goes. "fused32" (fused, grad_accum_dtype="fp32"):
# the norm and the update passes read 4-byte grads.
_IMPL_FLOOR_BYTES = {"split": -2, "fused32": 4}
# name -> list of param shapes (268M: 16 weights of 4096x4096 and 16 biases of 4096)
WORKLOADS = {
    "268M": [(4096, 4096)] * 16 + [(4096,)] * 16,
    "1B": [(8192, 8192)] * 16 + [(8192,)] * 16,
    "small": [(1024, 1024)] * 4 + [(1024,)] * 4,
}


@dataclass
class BenchRow:
    impl: str
    optimizer: str
    dtype: str
    n_params: int
    ms: float
    gbps: float
    pct_copy_bw: float
    x_floor: float
    vs_plain: float | None
    extra_mib: float
    skipped_ms: float | None = None
    graph_ms: float | None = None
    graph_skipped_ms: float | None = None
    user_ms: float | None = None
    user_skipped_ms: float | None = None
    user_host_ms: float | None = None


def _time(fn, before=None, *, warmup: int, iters: int) -> float:
    """Median ms of ``fn`` over ``iters`` back-to-back runs (no sync between them, as in a training loop)."""
    before = before or (lambda: None)
    for _ in range(warmup):
        before()
        fn()
    torch.cuda.synchronize()
    events = []
    for _ in range(iters):
        before()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def users_backward(opt, params, grads) -> None:
    """``opt.zero_grad()``, then a real backward whose grads are ``grads`` (times ``opt``'s loss scale):
    d(sum of p . g)/dp = g, so autograd makes new grad tensors, as a model's backward does."""
    opt.zero_grad()
    loss = sum(torch.dot(p.view(-1), g.view(-1)).float() for p, g in zip(params, grads, strict=True))
    opt.backward(loss)


def time_as_users_call(
    opt, params, grads, *, warmup: int, iters: int, overflow: bool = False
) -> tuple[float, float]:
    """Median ``(ms, host_ms)`` of ``opt.step()`` after ``opt.zero_grad()`` and a backward whose grads are
    ``grads`` (times the loss scale; ``overflow``: one inf among them), timed from a synchronized device: CUDA
    events on CUDA (``ms``), the host clock elsewhere; ``host_ms``: until ``step()`` returned."""
    cuda = params[0].is_cuda
    if overflow:
        grads = [g.clone() for g in grads]
        grads[0].view(-1)[0] = float("inf")
    device_ms, host_ms = [], []
    for i in range(warmup + iters):
        users_backward(opt, params, grads)
        if cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t = time.perf_counter()
        opt.step()
        host = (time.perf_counter() - t) * 1e3
        if cuda:
            end.record()
            torch.cuda.synchronize()
        if i >= warmup:
            device_ms.append(start.elapsed_time(end) if cuda else host)
            host_ms.append(host)
        assert opt.step_was_skipped == overflow
    return statistics.median(device_ms), statistics.median(host_ms)


def copy_bandwidth(nbytes: int = 2 << 30, *, iters: int = 20) -> float:
    """Device-to-device copy bandwidth in GB/s (bytes read + written)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    ms = _time(lambda: dst.copy_(src), warmup=3, iters=iters)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def bench_params(shapes, dtype):
    """CUDA params of ``shapes`` in ``dtype`` with small random grads (seeded), as the bench times them."""
    g = torch.Generator(device="cuda").manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, device="cuda", generator=g).to(dtype)) for s in shapes]
    for p in params:
        p.grad = (torch.randn(p.shape, device="cuda", generator=g) * 1e-3).to(dtype)
    return params


# name -> (torch optimizer, fused optimizer, the hyperparameters of both); torch has no LAMB to compare with
_OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, FusedAdamW, dict(lr=1e-4, weight_decay=0.1)),
    "sgd": (torch.optim.SGD, FusedSGD, dict(lr=1e-2, momentum=0.9)),
    "adagrad": (torch.optim.Adagrad, FusedAdagrad, dict(lr=1e-2)),
    "lamb": (None, FusedLamb, dict(lr=1e-3, weight_decay=0.01)),
}


def _torch_opt(name, params, *, fused=None):
    cls, _, hyper = _OPTIMIZERS[name]
    return cls(params, **hyper, fused=fused)


def bench_fused_optimizer(name, params, masters="fp32", grad_accum_dtype="param"):
    """The fused optimizer ``name`` over ``params`` as the bench times it (clipping at 1.0; fp16 scaled)."""
    _, cls, hyper = _OPTIMIZERS[name]
    scaler = halfprec.DynamicLossScaler() if params[0].dtype == torch.float16 else None
    return cls(
        params,
        **hyper,
        loss_scaler=scaler,
        max_grad_norm=1.0,
        masters=masters,
        grad_accum_dtype=grad_accum_dtype,
    )


class _PlainPipeline:
    """The plain torch master weights: copy grads, GradScaler-style unscale, clip, fused step, copy back."""

    def __init__(self, name, params):
        self.params = params
        self.grads = [p.grad for p in params]
        self.masters = [p.detach().float().requires_grad_() for p in params]
        for m in self.masters:
            m.grad = torch.empty_like(m)
        # fused where torch has a CUDA kernel (Adam/AdamW/SGD), else its default (foreach)
        self.opt = _torch_opt(name, self.masters, fused=True if name != "adagrad" else None)
        self.found_inf = torch.zeros((), device="cuda")
        self.inv_scale = torch.ones((), device="cuda")
        if name != "adagrad":  # torch's foreach Adagrad takes no found_inf
            self.opt.found_inf = self.found_inf

    def step(self):
        mg = [m.grad for m in self.masters]
        torch._foreach_copy_(mg, self.grads)
        self.found_inf.zero_()
        torch._amp_foreach_non_finite_check_and_unscale_(mg, self.found_inf, self.inv_scale)
        torch.nn.utils.clip_grad_norm_(self.masters, 1.0, foreach=True)
        self.opt.step()
        torch._foreach_copy_([p.data for p in self.params], self.masters)


def _capture(opt, mark) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        mark()
        opt.step()
    torch.cuda.current_stream().wait_stream(side)
    mark()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    return graph


def _extra_mib(fn, before=None) -> float:
    if before is not None:
        before()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def _measure(impl: str, name: str, shapes, dtype, *, warmup: int, iters: int) -> dict[str, Any]:
    """One impl's measured ``BenchRow`` fields (fused: also the skipped-step and CUDA-graph times)."""
    params = bench_params(shapes, dtype)
    row = {"n_params": sum(p.numel() for p in params)}
    sources = [p.grad.clone() for p in params]  # the 16-bit grads (fused32 adds them into its fp32 buffer)
    if impl in ("fused", "split"):
        opt = bench_fused_optimizer(name, params, masters="split" if impl == "split" else "fp32")
        mark = opt.mark_grads  # what backward's hooks do
    elif impl == "fused32":
        opt = bench_fused_optimizer(name, params, grad_accum_dtype="fp32")

        def mark(params=params) -> None:
            # backward's hooks: each 16-bit grad copied into the fp32 buffer and released
            for p, g in zip(params, sources, strict=True):
                p.grad = g
            opt.mark_grads()

    elif impl == "torch":
        opt = halfprec.MixedPrecisionOptimizer(_torch_opt(name, params), max_grad_norm=1.0, impl="torch")

        def mark(params=params) -> None:
            # a new backward's grads (new tensor objects, same storage): step() refuses to re-apply old ones
            for p in params:
                p.grad = p.grad.detach()

    else:
        opt, mark = _PlainPipeline(name, params), None
    row["ms"] = _time(opt.step, mark, warmup=warmup, iters=iters)
    row["extra_mib"] = _extra_mib(opt.step, mark)
    if impl in ("fused", "split", "fused32"):
        # fused32: the 16-bit grad mark() copies in; else a view of the flat grad buffer since the first step
        grad = (sources[0] if impl == "fused32" else params[0].grad).view(-1)

        def overflowing(step) -> float:
            grad[0] = float("inf")
            ms = _time(step, mark, warmup=2, iters=iters)
            assert opt.step_was_skipped
            grad[0] = 0.0
            return ms

        row["skipped_ms"] = overflowing(opt.step)
        # the same step replayed from a CUDA graph: GPU time without Python launch overhead
        graph = _capture(opt, mark)
        row["graph_ms"] = _time(graph.replay, mark, warmup=2, iters=iters)
        row["graph_skipped_ms"] = overflowing(graph.replay)
        del graph
        if impl != "fused32":  # its hooks release the 16-bit grads; the same step otherwise
            timing = dict(warmup=warmup, iters=iters)
            row["user_ms"], row["user_host_ms"] = time_as_users_call(opt, params, sources, **timing)
            row["user_skipped_ms"], _ = time_as_users_call(opt, params, sources, overflow=True, **timing)
    params = opt = None  # freed for empty_cache()
    torch.cuda.empty_cache()
    return row


def run_bench(
    *,
    workload: str = "268M",
    optimizers=("adamw",),
    dtypes=("float16",),
    impls=("fused", "torch", "plain"),
    warmup: int = 5,
    iters: int = 20,
) -> dict[str, Any]:
    """Measure every (optimizer, dtype, impl); returns {"copy_gbps", "rows", ...} (rows as dicts)."""
    if not torch.cuda.is_available():
        raise RuntimeError("halfprec bench needs a CUDA device")
    logging.getLogger("halfprec").setLevel(logging.ERROR)  # the timed overflow steps would log each skip
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "n/a"
    bw = copy_bandwidth()
    rows: list[BenchRow] = []
    shapes = WORKLOADS[workload]
    for name, dtype_name in itertools.product(optimizers, dtypes):
        dtype, results = getattr(torch, dtype_name), {}
        for impl in ("plain", "torch", "fused", "fused32", "split"):
            if impl not in impls or (name == "lamb" and impl in ("plain", "torch")):
                continue
            if impl == "split" and dtype != torch.bfloat16:
                continue  # split masters are for bf16 params
            try:
                with warnings.catch_warnings():
                    # loss-scaled grads written by hand would trigger the unscaled-backward warning
                    warnings.filterwarnings("ignore", message=r"halfprec: step\(\) after a backward")
                    results[impl] = _measure(impl, name, shapes, dtype, warmup=warmup, iters=iters)
            except Exception as e:  # one failing configuration must not lose the others
                print(f"bench: {name} {dtype_name} {impl} failed: {type(e).__name__}: {e}")
                torch.cuda.empty_cache()
        plain_ms = results.get("plain", {}).get("ms")
        for impl, m in results.items():
            floor = FLOOR_BYTES[name] + _IMPL_FLOOR_BYTES.get(impl, 0)
            x_floor = m["ms"] / (floor * m["n_params"] / (bw * 1e9) * 1e3)
            gbps = floor * m["n_params"] / (m["ms"] * 1e-3) / 1e9
            vs_plain = None if plain_ms is None else plain_ms / m["ms"]
            rates = dict(gbps=gbps, pct_copy_bw=100 * gbps / bw, x_floor=x_floor, vs_plain=vs_plain)
            rows.append(BenchRow(impl=impl, optimizer=name, dtype=dtype_name, **rates, **m))
    return {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton_version,
        "workload": workload,
        "copy_gbps": bw,
        # whether the fused launches replayed from CUDA graphs (HALFPREC_LAUNCH=replay=0 turns it off), and how often
        "launch_replay": bool(settings().replay),
        "replay_stats": replay_stats(),
        "rows": [asdict(r) for r in rows],
    }


def format_table(result: dict[str, Any]) -> str:
    def cell(value: float | None, spec: str) -> str:  # a measurement the impl does not make is left blank
        return "" if value is None else format(value, spec)

    lines = [
        f"device {result['device']}, torch {result['torch']}, triton {result['triton']}, workload "
        f"{result['workload']}, copy bandwidth {result['copy_gbps']:.0f} GB/s",
        "| impl | optimizer | dtype | N params | ms | floor ms | x floor | GB/s | % copy BW "
        "| x faster than plain | extra MiB | skipped-step ms | graph ms | graph skipped ms "
        "| as called: ms | x floor | skipped ms | host ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['impl']} | {r['optimizer']} | {r['dtype']} | {r['n_params'] / 1e6:.1f}M | {r['ms']:.3f} "
            f"| {r['ms'] / r['x_floor']:.3f} | {r['x_floor']:.2f} | {r['gbps']:.0f} | {r['pct_copy_bw']:.1f} "
            f"| {cell(r['vs_plain'], '.2f')} | {r['extra_mib']:.1f} | {cell(r['skipped_ms'], '.3f')} "
            f"| {cell(r['graph_ms'], '.3f')} | {cell(r['graph_skipped_ms'], '.3f')} "
            f"| {cell(r.get('user_ms'), '.3f')} "
            f"| {cell(None if r.get('user_ms') is None else r['user_ms'] * r['x_floor'] / r['ms'], '.2f')} "
            f"| {cell(r.get('user_skipped_ms'), '.3f')} | {cell(r.get('user_host_ms'), '.3f')} |"
        )
    return "\n".join(lines)
