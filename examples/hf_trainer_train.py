"""Train a tiny GPT-2 (built from a config, no download) with halfprec under the HF Trainer, on CPU or GPU.

TrainingArguments keeps fp16=False and bf16=False: halfprec owns the weight dtype and the loss scale.
max_grad_norm is applied to the unscaled fp32 master grads, and the logged grad_norm is unscaled.

    python examples/hf_trainer_train.py --dtype fp16 --steps 40 --out /tmp/hf_run --stop-after 20   # "interrupted"
    python examples/hf_trainer_train.py --dtype fp16 --steps 40 --out /tmp/hf_run --resume   # bit-exact resume

Keep --steps the same when resuming: the LR schedule is built for max_steps, so a resume with another --steps
continues a different schedule. The second command ends where an uninterrupted 40-step run ends, bit for bit.
"""

import argparse

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments

from halfprec.integrations.hf import HalfprecTrainer


class StopAfter(TrainerCallback):
    """Stop (as an interruption would) once ``step`` optimizer steps are done and saved."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_save = True
            control.should_training_stop = True
        return control


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default="/tmp/halfprec_hf_example")
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint-N in --out")
    parser.add_argument("--stop-after", type=int, default=None, help="save and stop after this many steps")
    args = parser.parse_args()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=256, n_positions=64)
    model = GPT2LMHeadModel(config)  # fp32 here; halfprec casts it and keeps the fp32 values as masters
    ids = torch.randint(0, 256, (512, 32), generator=torch.Generator().manual_seed(1))
    dataset = [{"input_ids": row, "labels": row} for row in ids]

    training_args = TrainingArguments(
        output_dir=args.out,
        max_steps=args.steps,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
        learning_rate=1e-3,
        max_grad_norm=1.0,
        fp16=False,  # halfprec owns precision; fp16=True/bf16=True with HalfprecTrainer is an error
        bf16=False,
        logging_steps=5,
        save_steps=10,
        report_to="none",
        disable_tqdm=True,
    )
    trainer = HalfprecTrainer(model=model, args=training_args, train_dataset=dataset, param_dtype=dtype)
    if args.stop_after is not None:
        trainer.add_callback(StopAfter(args.stop_after))
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    # Every log record carries loss, grad_norm (unscaled), learning_rate, loss_scale and skipped_steps.


if __name__ == "__main__":
    main()
