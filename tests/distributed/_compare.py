"""Compare what the ranks returned with an oracle; every failure names the rank, the step, the tensor and how far
apart the values are (max abs diff), never a bare ``assert False``."""

from __future__ import annotations

import torch

__all__ = [
    "assert_equal",
    "assert_same",
    "assert_steps",
    "describe",
    "labelled",
    "max_rel",
    "stitch",
    "unskipped",
]


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


def describe(got: torch.Tensor, want: torch.Tensor) -> str:
    """How two tensors differ: dtype/shape, or the count of differing elements and the largest difference."""
    if got.dtype != want.dtype or got.shape != want.shape:
        return f"got {got.dtype} {tuple(got.shape)}, want {want.dtype} {tuple(want.shape)}"
    a, b = got.detach().double().reshape(-1), want.detach().double().reshape(-1)
    differ = ~((a == b) | (a.isnan() & b.isnan()))
    if not differ.any():
        return "equal"
    d = (a - b).abs().nan_to_num(float("inf"))
    i = int(torch.where(differ, d, torch.zeros_like(d)).argmax())
    return f"{int(differ.sum())} of {a.numel()} elements differ, max abs diff {d[i].item():.3g} at [{i}] (got {a[i].item()!r}, want {b[i].item()!r})"


def assert_equal(got: dict, want: dict, where: str) -> None:
    """Every tensor of ``got`` equals ``want``'s bit for bit (NaN equals NaN); the message lists each one that does
    not, with its largest difference."""
    assert sorted(got) == sorted(want), f"{where}: names {sorted(got)} != {sorted(want)}"
    bad = {name: describe(got[name], ref) for name, ref in want.items()}
    bad = {name: text for name, text in bad.items() if text != "equal"}
    assert not bad, f"{where}:\n" + "\n".join(f"  {name}: {text}" for name, text in bad.items())


def assert_steps(got: list, want: list, what: str, where: str) -> None:
    """Per-step values (skips, scales) equal; the message names the first step that differs."""
    assert len(got) == len(want), f"{where}: {len(got)} {what} recorded, want {len(want)}"
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a == b, f"{where}: {what} at step {step}: got {a!r}, want {b!r} (all: {got} vs {want})"


def assert_same(
    masters: dict, state: dict, oracle: dict, *, atol: float = 0.0, rtol: float = 0.0, where: str = ""
) -> None:
    """Masters and every state tensor equal the oracle's (bit for bit when atol = rtol = 0)."""
    assert set(masters) == set(oracle["masters"]), (where, sorted(masters), sorted(oracle["masters"]))
    for name, ref in oracle["masters"].items():
        torch.testing.assert_close(
            masters[name].reshape(-1),
            ref.reshape(-1),
            atol=atol,
            rtol=rtol,
            msg=labelled(f"{where} master {name}"),
        )
    assert set(state) == set(oracle["state"]), (where, sorted(state), sorted(oracle["state"]))
    for name, ref_state in oracle["state"].items():
        assert set(state[name]) == set(ref_state), (where, name, sorted(state[name]), sorted(ref_state))
        for key, ref in ref_state.items():
            got = state[name][key]
            if ref.dim() > 0 or got.dim() > 0:
                got, ref = got.reshape(-1), ref.reshape(-1)
            exact = key == "step"
            torch.testing.assert_close(
                got,
                ref,
                atol=0 if exact else atol,
                rtol=0 if exact else rtol,
                msg=labelled(f"{where} state {name}.{key}"),
            )


def labelled(where: str):
    """assert_close's own report (max abs/rel diff, mismatched count) prefixed with what was compared."""
    return lambda text: f"{where.strip()}: {text}"


def max_rel(masters: dict, oracle: dict) -> float:
    return max(
        ((masters[n] - r.reshape(-1)).abs() / r.reshape(-1).abs().clamp_min(1e-3)).max().item()
        for n, r in oracle["masters"].items()
    )


def unskipped(run: dict, cfg: dict, label: str, rank: int):
    """``(where, step record)`` of each step of ``run`` that no rank poisoned (``cfg["poison"]``: ``[step, 1]``
    pairs); asserts on the way that a step was skipped exactly when poisoned, that is when its oracle is not finite."""
    for step, s in enumerate(run["steps"]):
        where = f"{label}, rank {rank}, step {step}"
        poisoned = [step, 1] in cfg.get("poison", [])
        assert s["skipped"] == poisoned == (not s["finite"]), where
        if not poisoned:
            yield where, s
