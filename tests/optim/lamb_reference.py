"""A plain FP32 LAMB (torch.optim.Optimizer, for-loop), the oracle of FusedLamb. Same formula order as the
kernels' docstring; torch-format state (step tensor, exp_avg, exp_avg_sq)."""

from __future__ import annotations

import torch


class ReferenceLamb(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                t = float(state["step"])
                g = p.grad
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.lerp_(g, 1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                bc1, bc2_sqrt = 1 - b1**t, (1 - b2**t) ** 0.5
                u = (m * (1 / bc1)) / (v.sqrt() / bc2_sqrt + group["eps"]) + group["weight_decay"] * p
                w_norm, u_norm = p.norm(), u.norm()
                trust = (w_norm / u_norm) if (w_norm > 0 and u_norm > 0) else torch.tensor(1.0)
                p.sub_(group["lr"] * trust * u)
