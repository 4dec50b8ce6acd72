"""Train a small MLP with halfprec under HuggingFace Accelerate (CPU or one GPU).

halfprec owns the weight dtype and the loss scale, so the Accelerator runs with mixed_precision="no";
Accelerate keeps the device placement, gradient accumulation, scheduler and checkpoint plumbing.

    python examples/accelerate_train.py --dtype fp16 --steps 20
"""

import argparse

import torch
from accelerate import Accelerator
from torch import nn

from halfprec.integrations import accelerate as hp_accelerate


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--accum", type=int, default=2)
    parser.add_argument("--save", default=None, help="directory for accelerator.save_state at the end")
    args = parser.parse_args()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]

    torch.manual_seed(0)
    accelerator = Accelerator(mixed_precision="no", gradient_accumulation_steps=args.accum)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 1))  # built in fp32
    model.to(accelerator.device)  # before wrapping: the masters are made on the params' device
    # a MixedPrecisionOptimizer: param_dtype casts the model's params in place and keeps their fp32 values as the
    # masters; bf16 micro-batches are summed in fp32 (grad_accum_dtype="auto" reads the accumulation steps)
    mp = hp_accelerate.wrap_optimizer(
        accelerator, torch.optim.AdamW(model.parameters(), lr=3e-3), param_dtype=dtype, max_grad_norm=1.0
    )
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(mp, T_max=args.steps)
    x = torch.randn(args.steps * args.accum * 16, 32)
    y = x.sum(dim=1, keepdim=True).sin()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)
    # prepare() = accelerator.prepare() + a check of the settings + linking halfprec's skipped steps to
    # opt.step_was_skipped / accelerator.optimizer_step_was_skipped (so the scheduler holds on them).
    model, opt, loader, sched = hp_accelerate.prepare(accelerator, model, mp, loader, sched)

    for i, (xb, yb) in enumerate(loader):
        with accelerator.accumulate(model):
            loss = nn.functional.mse_loss(model(xb.to(dtype)).float(), yb)
            accelerator.backward(mp.scale_loss(loss))  # the scaled entry point; Accelerate divides by accum
            opt.step()  # halfprec: unscale, overflow check, clip the fp32 master grads, update, copy back
            sched.step()  # held when the step was skipped
            opt.zero_grad()
        if accelerator.sync_gradients:
            accelerator.print(
                f"batch {i:3d} loss {loss.item():.4f} grad_norm {mp.grad_norm:.3f} "
                f"scale {mp.loss_scale:g} skipped {opt.step_was_skipped} lr {sched.get_last_lr()[0]:.2e}"
            )
    if args.save:
        accelerator.save_state(args.save)  # optimizer.bin holds masters, moments and the loss scaler


if __name__ == "__main__":
    main()
