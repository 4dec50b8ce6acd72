"""Every launch of the fused step's Triton kernels, replayed from a one-kernel CUDA graph once it has run.

A Triton launch costs the host tens of microseconds in Triton's Python launcher (binding and specializing the
arguments, the cache key, the driver call); a CUDA graph replay costs a few. A fused step is three launches per
chunk, and when the host calls ``step()`` on an idle device (after a synchronize, a logging read, a data-loader
wait) the device waits for each of them. So ``launch`` keys each launch on everything the host passes to the
kernel: the kernel, the grid, each tensor's address and dtype, each scalar's value and every meta-parameter. The
first time a key is seen the kernel is launched as usual (compiling it if needed); the second time the launch is
captured in a CUDA graph, which is replayed from then on. Whatever the kernel reads from device memory (the loss
scale, the hyper-parameters, the grad marks) is read at replay time, so a replay is the launch, bit for bit.

A key changes when a buffer moves (``zero_grad(set_to_none=True)`` frees the flat grad buffer; the caching
allocator mostly hands the same address back at the next backward) or a host scalar changes (``max_grad_norm``):
the new key runs eagerly once and is captured at its second sighting. Each launch site keeps its ``_KEPT`` most
recent keys (CUDA frees a dropped graph that is still running when it completes). Every launch runs on its
tensors' device, and one lock serialises the shared cache between threads. Launches run as they are (no replay)
in the interpreter, on the CPU, while a stream is being captured (the caller's graph records the launch itself),
under ``torch.compile`` and with ``HALFPREC_LAUNCH="replay=0"``.

``together()`` collects the launches made inside it and runs them as one: one key (every launch's), one graph, one
replay, so the device runs them back to back and the host pays one replay. ``wait``/``record`` put event waits and
records between them (events made with ``external=True``, which a capture keeps as graph nodes; a graph keeps
its events alive, since their driver handles key it).
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from . import interpreted
from .settings import pin_settings, settings, unpin_settings

__all__ = ["Together", "launch", "replay_stats", "together"]

_KEPT = 32  # keys kept per launch site: grad-buffer addresses, host scalars, optimizers and chunks in turn
_WARM = object()  # launched once eagerly (compiled), not captured yet

_sites: dict[Any, OrderedDict[tuple, Any]] = {}
_side_streams: dict[int, torch.cuda.Stream] = {}
_stats = {"eager": 0, "captured": 0, "replayed": 0}
_lock = threading.Lock()  # _sites, _side_streams and _stats are every thread's
_collecting = threading.local()  # .group: the Together being filled on this thread, if any
_TOGETHER = "together"  # the launch site of a Together not given another


def replay_stats() -> dict[str, int]:
    """Counts of launches run eagerly, captured and replayed since the process started (for tests and benchmarks)."""
    return dict(_stats)


def _arg_key(args: tuple) -> tuple:
    key = []
    for a in args:
        if isinstance(a, torch.Tensor):
            key.append((a.data_ptr(), a.dtype))
        else:  # typed: 1, 1.0 and True are equal keys but specialize differently
            key.append((type(a), a))
    return tuple(key)


def _replayable(device: torch.device) -> bool:
    return (
        device.type == "cuda"
        and not interpreted()
        and settings().replay
        and not torch.cuda.is_current_stream_capturing()
        and not torch.compiler.is_compiling()
    )


def _capture(run: Callable[[], None]) -> torch.cuda.CUDAGraph:
    """``run``'s launches captured on a side stream of the current device (``launch`` and ``together`` make it
    the launches' device)."""
    index = torch.cuda.current_device()
    side = _side_streams.get(index)
    if side is None:
        side = _side_streams[index] = torch.cuda.Stream(device=index)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        # thread_local: another thread's CUDA calls (a data loader's pinned copies) do not break the capture
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            run()
        finally:
            graph.capture_end()
    return graph


def _run(items: list[tuple]) -> None:
    for kernel, grid, args, meta in items:
        if kernel is None:  # an event: (None, "wait" or "record", event, None)
            stream = torch.cuda.current_stream()
            stream.wait_event(args) if grid == "wait" else args.record(stream)
        else:
            kernel[grid](*args, **meta)


class _Captured(NamedTuple):
    graph: torch.cuda.CUDAGraph
    # its nodes' events, alive while it is: no driver handle in a key is reused while a graph holds it
    events: tuple[torch.cuda.Event, ...]


def _replay(site_name: Any, key: tuple, items: list[tuple]) -> None:
    """Run ``items`` eagerly at the key's first sighting, capture them at its second, replay them after (on the
    current device's current stream)."""
    with _lock:
        site = _sites.setdefault(site_name, OrderedDict())
        entry = site.get(key)
        if entry is None:
            _run(items)
            _stats["eager"] += 1
            site[key] = _WARM
            while len(site) > _KEPT:
                site.popitem(last=False)
            return
        if entry is _WARM:
            graph = _capture(lambda: _run(items))
            events = tuple(event for kernel, _, event, _ in items if kernel is None)
            entry = site[key] = _Captured(graph, events)
            _stats["captured"] += 1
        site.move_to_end(key)
        entry.graph.replay()
        _stats["replayed"] += 1


def _launch_key(item: tuple) -> tuple:
    kernel, grid, args, meta = item
    if kernel is None:
        # the driver's event handle, which a graph node keeps (0: not made yet, nothing to wait on or captured)
        return (grid, args.cuda_event)
    return (kernel, grid, _arg_key(args), tuple(meta.items()))


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **meta: Any) -> None:
    """``kernel[grid](*args, **meta)``, replayed from a CUDA graph when this exact launch ran before (module
    docstring); inside ``together()``, collected. The first arg is a tensor on the launch's device."""
    item = (kernel, grid, args, meta)
    group = getattr(_collecting, "group", None)
    if group is not None:
        group.items.append(item)
        return
    device = args[0].device
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        if not _replayable(device):
            _run([item])
            return
        _replay(kernel, _launch_key(item), [item])


class Together:
    """The block ``together()`` opens: it collects the launches and event marks made inside and runs them as one
    when it ends (module docstring); a block that raises runs none of them. The launch settings are read once, as
    the block opens (``settings.pin_settings``): every launch inside reads those."""

    def __init__(self, site: str = _TOGETHER) -> None:
        self.items: list[tuple] = []
        self.site = site

    def wait(self, event: torch.cuda.Event) -> None:
        """The launches after this wait for ``event`` (made with ``external=True``)."""
        self.items.append((None, "wait", event, None))

    def record(self, event: torch.cuda.Event) -> None:
        """Record ``event`` (made with ``external=True``) after the launches so far."""
        self.items.append((None, "record", event, None))

    def __enter__(self) -> Together:
        if getattr(_collecting, "group", None) is not None:
            raise RuntimeError("together() blocks do not nest")
        pin_settings()  # first: settings that fail to read (a bad HALFPREC_LAUNCH) leave no block open
        _collecting.group = self
        return self

    def __exit__(self, kind: Any, value: Any, traceback: Any) -> None:
        _collecting.group = None
        try:
            if kind is None:
                self._run()
        finally:
            unpin_settings()

    def _run(self) -> None:
        launches = [item for item in self.items if item[0] is not None]
        if not launches:
            return
        device = launches[0][2][0].device
        with torch.cuda.device(device.index) if device.type == "cuda" else contextlib.nullcontext():
            if not _replayable(device):
                _run(self.items if device.type == "cuda" else launches)  # no events off CUDA
                return
            _replay(self.site, tuple([_launch_key(item) for item in self.items]), self.items)


def together(site: str = _TOGETHER) -> Together:
    """Collect the ``launch`` calls made inside and run them as one when the block ends (module docstring).
    ``site`` names the cache of keys the block's launches share: each site keeps its ``_KEPT`` latest, so a caller
    whose blocks alternate between two groups of launches gives each group its own site."""
    return Together(site)
