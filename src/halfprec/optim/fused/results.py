"""What a fused step leaves behind, read without a host sync in ``step()``: the step record and the skip reports.

Both read the first six device scalars the finalize program writes: found_inf, grad norm, clip coefficient,
skipped count, loss scale used, loss scale after. ``DeviceResults`` is the fused optimizers'
``results.StepState`` (the same attribute names). ``SkipReporter`` copies them into a pinned host buffer with one
non-blocking copy per step and records an event; completed records are logged at a later step, or when the caller
reads a result, each skip once. Buffers and events are reused, so a step allocates nothing (a skipped step is
mostly host time).

With the built-in scalers nothing after the finalize program writes those slots, so the record is copied on a side
stream as soon as that program has run (``events``: the step records ``ready`` after it and waits for ``copied``
before its next finalize, both in its launch group), while the update pass runs; a scaler whose own ``update`` runs
after the update pass is staged after it. Reading ``step_was_skipped``, ``grad_norm`` or ``step_loss_scale`` then
waits for that record only: the update pass stays queued and runs while the host goes on (an LR scheduler that holds
on skipped steps, the HF Trainer's loop, the next batch). Once a step was captured in a CUDA graph, a replay records
nothing, so every read goes to the device scalars and waits for the stream.
"""

from __future__ import annotations

from collections import deque

import torch

from ...scaler import LossScaler
from ..results import SkipLog

__all__ = ["DeviceResults", "SkipReporter"]

_MAX_PENDING = 64
_WIDTH = 6


class SkipReporter:
    def __init__(self, log: SkipLog, scaler: LossScaler, scalars: torch.Tensor) -> None:
        self._log = log
        self._staged = scalars[:_WIDTH]  # what record() copies (the slice made once: host time at every step)
        self._pending: deque[tuple[torch.Tensor, torch.cuda.Event]] = deque()
        self._free: list[tuple[torch.Tensor, torch.cuda.Event]] = []
        self._dynamic = scaler.is_dynamic
        self._min_scale = getattr(scaler, "min_scale", 1.0)
        self._last: tuple[torch.Tensor, torch.cuda.Event] | None = None  # the latest step's record
        self._graphed = False  # a step was captured: replays record nothing, so _last may be stale
        self._side: torch.cuda.Stream | None = None  # where the records are copied (CUDA)
        self._events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None  # (copied, ready)

    def events(self, device: torch.device) -> tuple[torch.cuda.Event, torch.cuda.Event] | None:
        """``(copied, ready)`` on CUDA (None elsewhere): a step records ``ready`` after its finalize program and
        ``record(after=ready)`` copies from there on the side stream, then records ``copied``, which the next
        step waits for before its finalize overwrites the slots. Made with ``external=True`` so that a step captured
        in a launch graph (``kernels/launch.py``) keeps the record and the wait as graph nodes."""
        if device.type != "cuda":
            return None
        if self._events is None:
            self._side = torch.cuda.Stream(device=device)
            self._events = (torch.cuda.Event(external=True), torch.cuda.Event(external=True))
        return self._events

    def fence(self) -> None:
        """Make the current stream wait for the last record's copy (the host is about to write its slots)."""
        if self._events is not None:
            torch.cuda.current_stream(self._side.device).wait_event(self._events[0])

    def record(self, after: torch.cuda.Event | None = None) -> None:
        """Stage the first six scalars for a later report (a CUDA-graph capture calls ``captured()`` instead): on
        the current stream, or with ``after`` (``events``' ready) on the side stream once ``after`` has run."""
        staged = self._staged
        if staged.device.type != "cuda":
            self._process(staged.cpu())
            return
        if len(self._pending) >= _MAX_PENDING:
            self._report_oldest()
        if self._free:
            buf, event = self._free.pop()
        else:
            buf = torch.empty(_WIDTH, dtype=staged.dtype, pin_memory=True)
            event = torch.cuda.Event()
        if after is None:
            buf.copy_(staged, non_blocking=True)
            # the copy's stream, whatever the current device
            event.record(torch.cuda.current_stream(staged.device))
        else:
            side, (copied, _) = self._side, self._events
            side.wait_event(after)
            with torch.cuda.stream(side):
                buf.copy_(staged, non_blocking=True)
                event.record(side)
                copied.record(side)
        self._pending.append((buf, event))
        self._last = (buf, event)

    def captured(self) -> None:
        """A step is being captured in a CUDA graph: from now on ``latest`` is None."""
        self._graphed = True

    def latest(self, slot: int) -> float | None:
        """Slot ``slot`` of the latest step's record, waiting only for that record's copy (an event wait, which
        ``torch.cuda.set_sync_debug_mode`` does not report); None when there is none to trust (no CUDA record
        yet, or a step was captured in a graph)."""
        if self._graphed or self._last is None:
            return None
        buf, event = self._last  # not reused before the next record(), which replaces _last
        event.synchronize()
        return float(buf[slot])

    def drain(self, wait: bool = False) -> None:
        """Report the records whose copy has landed (``wait``: all of them, waiting for their copies)."""
        while self._pending and (wait or self._pending[0][1].query()):
            self._report_oldest()

    def _report_oldest(self) -> None:
        buf, event = self._pending.popleft()
        event.synchronize()
        self._process(buf)
        self._free.append((buf, event))

    def _process(self, buf: torch.Tensor) -> None:
        found, _norm, _coef, skipped, before, after = buf.tolist()
        if not found:
            return
        self._log.report(
            before=before,
            after=after,
            skipped_so_far=int(skipped),
            at_min_scale=self._dynamic and before <= self._min_scale,
        )


class DeviceResults:
    """The fused step's record (``results.StepState``'s attribute names) over the finalize program's scalars."""

    unscaled = False  # the fused step never unscales grads in place

    def __init__(self, scalars: torch.Tensor, reporter: SkipReporter, *, live: bool = True) -> None:
        self.scalars = scalars
        self.reporter = reporter
        self.live = live  # the optimizer's own record, whose latest step the reporter staged (not a snapshot)
        self.stepped = False  # set by the first step: until then the per-step results are None

    def _read(self, slot: int) -> float | None:
        """Slots 0, 1 and 4 (found_inf, grad norm, loss scale used): a load_state_dict writes none of them."""
        if not self.stepped:
            return None
        staged = self.reporter.latest(slot) if self.live else None
        return float(self.scalars[slot].item()) if staged is None else staged

    grad_norm = property(lambda self: self._read(1))
    step_loss_scale = property(lambda self: self._read(4))

    @property
    def grad_norm_deferred(self) -> torch.Tensor | None:
        """``grad_norm`` as a 0-d device tensor: taking it does not wait for the step, ``float()`` of it does."""
        return self.scalars[1] if self.stepped else None

    @property
    def step_was_skipped(self) -> bool:
        value = bool(self._read(0))
        self.reporter.drain()
        return value

    @property
    def skipped_steps(self) -> int:
        return int(self.scalars[3].item())

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self.reporter.fence()
        self.scalars[3].fill_(float(value))

    def snapshot(self) -> DeviceResults:
        """This step's results in a device copy (no host sync): read when first needed, after later steps."""
        kept = DeviceResults(self.scalars[:_WIDTH].clone(), self.reporter, live=False)
        kept.stepped = self.stepped
        return kept
