"""Train a small MLP with halfprec through Lightning: the Trainer plugin, or Fabric with --fabric.

python examples/lightning_train.py --dtype fp16                     # Trainer(plugins=[HalfprecPrecision(...)])
python examples/lightning_train.py --dtype fp16 --ckpt /tmp/l.ckpt  # ... and save a .ckpt at the end
python examples/lightning_train.py --dtype bf16 --fabric            # Fabric + setup_fabric
"""

import argparse

import lightning as L
import torch
from torch import nn

from halfprec.integrations.lightning import HalfprecFabricPrecision, HalfprecPrecision, setup_fabric
from halfprec.precision import DTYPES  # --dtype's names: the plugins take the torch dtype


def data(n: int = 512) -> torch.utils.data.DataLoader:
    x = torch.randn(n, 32, generator=torch.Generator().manual_seed(1))
    y = x.sum(dim=1, keepdim=True).sin()
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)


def net() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 1))  # fp32; the plugin casts it


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = net()

    def training_step(self, batch, batch_idx):
        x, y = batch  # the plugin cast both to the 16-bit dtype
        loss = nn.functional.mse_loss(self.net(x).float(), y.float())
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        # Plain torch objects: the plugin wraps the optimizer (masters from the fp32 weights) in connect() and
        # holds this step-interval schedule on skipped steps.
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=32)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def train_with_trainer(dtype: torch.dtype, ckpt: str | None) -> float:
    trainer = L.Trainer(
        accelerator="auto",
        devices=1,
        max_epochs=2,
        plugins=[HalfprecPrecision(dtype)],  # no precision= argument: the plugin is the precision
        gradient_clip_val=1.0,  # clips the unscaled fp32 master grads
        accumulate_grad_batches=2,
        logger=False,
        enable_checkpointing=False,
    )
    model = Regression()
    trainer.fit(model, data())
    mp = trainer.optimizers[0]
    loss = trainer.callback_metrics["loss"].item()
    print(
        f"final loss {loss:.4f}, loss scale {mp.loss_scale:g}, skipped steps {mp.skipped_steps}, "
        f"last grad norm {mp.grad_norm:.3f}"
    )
    if ckpt:
        trainer.save_checkpoint(ckpt)  # resume with trainer.fit(model, data(), ckpt_path=ckpt)
    return loss


def train_with_fabric(dtype: torch.dtype) -> float:
    fabric = L.Fabric(accelerator="auto", devices=1, plugins=[HalfprecFabricPrecision(dtype)])
    model = net()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    # Instead of fabric.setup(model, opt): wraps opt in a MixedPrecisionOptimizer (casting the model, fp32
    # masters), then calls fabric.setup.
    model, opt = setup_fabric(fabric, model, opt, max_grad_norm=1.0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=32)
    loader = fabric.setup_dataloaders(data())
    for epoch in range(2):
        for i, (x, y) in enumerate(loader):
            boundary = i % 2 == 1
            with fabric.no_backward_sync(model, enabled=not boundary):
                loss = nn.functional.mse_loss(model(x), y)  # output comes back in fp32
                fabric.backward(loss / 2)  # scales the loss for fp16
            if boundary:
                opt.step()
                if not opt.step_was_skipped:  # Fabric has no scheduler hook: hold it here
                    sched.step()
                opt.zero_grad()
        fabric.print(
            f"epoch {epoch} loss {loss.item():.4f} scale {opt.loss_scale:g} grad_norm {opt.grad_norm:.3f}"
        )
    fabric.save("/tmp/halfprec_fabric.ckpt", {"model": model, "optimizer": opt, "scheduler": sched})
    return loss.item()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    parser.add_argument("--fabric", action="store_true", help="Fabric + setup_fabric instead of the Trainer")
    parser.add_argument("--ckpt", default=None, help="save a Trainer .ckpt here at the end")
    parser.add_argument("--seed", type=int, default=0, help="seeds the model's init (the data is fixed)")
    args = parser.parse_args()
    # The model's init draws from torch's global generator: unseeded, every run starts from other weights and
    # ends at another loss.
    L.seed_everything(args.seed)
    if args.fabric:
        train_with_fabric(DTYPES[args.dtype])
    else:
        train_with_trainer(DTYPES[args.dtype], args.ckpt)


if __name__ == "__main__":
    main()
