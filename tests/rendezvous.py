"""Where spawned ranks meet: a TCPStore that the test process hosts, as torchrun's agent does.

Its port is bound by the store from the moment it is chosen until the ranks are done, so no other process can take
it in between (a port found free, released, then bound by rank 0 could be: that race once failed a launch)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.distributed as dist

__all__ = ["rendezvous_env"]


@contextlib.contextmanager
def rendezvous_env(world_size: int) -> Iterator[dict[str, str]]:
    """The environment that makes ``init_process_group`` (env:// or tcp://) of ``world_size`` ranks connect to a
    store hosted here, kept open for the ``with`` block."""
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    try:
        # every rank a client of this store (torch.distributed.rendezvous reads these, as under torchrun)
        yield {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(store.port),
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_RESTART_COUNT": "0",
        }
    finally:
        del store
