"""Stitch the per-rank pieces of a sharded run back into whole tensors and compare them with an oracle."""

from __future__ import annotations

import torch

__all__ = ["stitch", "assert_same", "max_rel"]


def stitch(ranks: list[dict]) -> tuple[dict, dict]:
    """Per-rank ``pieces(opt)`` results -> (masters, state) keyed by name, 1-D; elements no rank holds are NaN."""
    masters: dict[str, torch.Tensor] = {}
    state: dict[str, dict] = {}
    numel = {}
    for pieces in ranks:
        for name, pc in pieces.items():
            numel[name] = max(numel.get(name, 0), pc["hi"])
    for pieces in ranks:
        for name, pc in pieces.items():
            full = masters.setdefault(name, torch.full((numel[name],), float("nan")))
            full[pc["lo"] : pc["hi"]] = pc["master"]
            for key, value in pc["state"].items():
                st = state.setdefault(name, {})
                if value.dim() == 0:
                    st[key] = value
                else:
                    st.setdefault(key, torch.full((numel[name],), float("nan"), dtype=value.dtype))[
                        pc["lo"] : pc["hi"]
                    ] = value
    return masters, state


def assert_same(masters: dict, state: dict, oracle: dict, *, atol: float = 0.0, rtol: float = 0.0) -> None:
    """Masters and every state tensor equal the oracle's (bit for bit when atol = rtol = 0)."""
    assert set(masters) == set(oracle["masters"]), (sorted(masters), sorted(oracle["masters"]))
    for name, ref in oracle["masters"].items():
        torch.testing.assert_close(
            masters[name].reshape(-1), ref.reshape(-1), atol=atol, rtol=rtol, msg=f"master {name}"
        )
    assert set(state) == set(oracle["state"]), (sorted(state), sorted(oracle["state"]))
    for name, ref_state in oracle["state"].items():
        assert set(state[name]) == set(ref_state), (name, sorted(state[name]), sorted(ref_state))
        for key, ref in ref_state.items():
            got = state[name][key]
            if ref.dim() > 0 or got.dim() > 0:
                got, ref = got.reshape(-1), ref.reshape(-1)
            exact = key == "step"
            torch.testing.assert_close(
                got, ref, atol=0 if exact else atol, rtol=0 if exact else rtol, msg=f"state {name}.{key}"
            )


def max_rel(masters: dict, oracle: dict) -> float:
    return max(
        ((masters[n] - r.reshape(-1)).abs() / r.reshape(-1).abs().clamp_min(1e-3)).max().item()
        for n, r in oracle["masters"].items()
    )
