"""A typical Accelerate training script, with nothing megatrain-specific in it.

``test_accelerate.py`` launches it as users would launch theirs::

    accelerate launch --config_file configs/accelerate_megatrain.yaml \\
        integration_tests/accelerate_clm.py --output-dir DIR [--learning-rate 0] [--model-dir DIR]

A tiny random-init Llama learns byte-level text from ``data/kjv_excerpt.txt``: client
AdamW with no weight decay on biases and norms, a warm-up/cosine schedule,
``accelerator.accumulate``/``accelerator.backward``, and the model saved the way the
Accelerate docs show. With ``--model-dir`` the model is ``from_pretrained`` that directory
instead, after the ``Accelerator`` is made (so a ZeRO-3 config with ``zero3_init_flag``
builds it under ``deepspeed.zero.Init``). The DeepSpeed config decides which engine runs;
the script never imports ``megatrain_ds``. It writes, under ``--output-dir``:

- ``result.json`` (the main process's): the engine's classes (MRO), the loss and learning
  rate of every micro-batch, the final evaluation loss, warnings about the scheduler order,
  the ZeRO stage Accelerate's plugin reports and whether the model was built partitioned;
- ``initial.safetensors`` (the weights before training, without ``--model-dir``),
  ``eval_batches.pt`` and ``model/`` (``save_pretrained``).
"""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path

import torch
import transformers
from accelerate import Accelerator
from tiny_clm import byte_blocks, corpus, tiny_llama


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", type=Path, required=True)
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--gradient-accumulation-steps", type=int, default=2)
    parser.add_argument("--num-examples", type=int, default=96, help="training sequences (one epoch)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model-dir", type=Path, default=None, help="from_pretrained this instead of a fresh model")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    args.output_dir.mkdir(parents=True, exist_ok=True)
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps)
    transformers.set_seed(args.seed)

    if args.model_dir is not None:
        model = transformers.AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    else:
        model = tiny_llama(args.output_dir)
    built_partitioned = any(hasattr(p, "ds_id") for p in model.parameters())  # by deepspeed.zero.Init

    text = corpus()
    train_data = byte_blocks(text, args.num_examples)
    eval_batches = [
        torch.stack([b["input_ids"] for b in byte_blocks(text, 8, start=args.num_examples + 8 * i)]) for i in range(2)
    ]
    if accelerator.is_main_process:  # one writer: every rank has the same batches
        torch.save(eval_batches, args.output_dir / "eval_batches.pt")
    train_dataloader = torch.utils.data.DataLoader(train_data, batch_size=args.batch_size, shuffle=True)

    no_decay = ("bias", "norm")
    grouped_parameters = [
        {
            "params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
            "weight_decay": args.weight_decay,
        },
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(grouped_parameters, lr=args.learning_rate, betas=(0.9, 0.95))
    num_update_steps = len(train_dataloader) // args.gradient_accumulation_steps
    lr_scheduler = transformers.get_scheduler(
        "cosine", optimizer=optimizer, num_warmup_steps=2, num_training_steps=num_update_steps
    )

    model, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, lr_scheduler
    )

    losses, learning_rates = [], []
    model.train()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch in train_dataloader:
            with accelerator.accumulate(model):
                learning_rates.append(lr_scheduler.get_last_lr()[0])
                loss = model(**batch).loss
                accelerator.backward(loss)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            losses.append(loss.item())

    model.eval()
    with torch.no_grad():
        eval_loss = sum(
            float(model(input_ids=b.to(accelerator.device), labels=b.to(accelerator.device)).loss) for b in eval_batches
        ) / len(eval_batches)

    unwrapped = accelerator.unwrap_model(model)
    unwrapped.save_pretrained(
        args.output_dir / "model",
        state_dict=accelerator.get_state_dict(model),
        is_main_process=accelerator.is_main_process,
        save_function=accelerator.save,
    )
    result = {
        "engine_mro": [f"{c.__module__}.{c.__qualname__}" for c in type(model).__mro__],
        "unwrapped": f"{type(unwrapped).__module__}.{type(unwrapped).__qualname__}",
        "losses": losses,
        "learning_rates": learning_rates,
        "eval_loss": eval_loss,
        "scheduler_warnings": [str(w.message) for w in caught if "lr_scheduler.step()" in str(w.message)],
        "device": str(accelerator.device),
        "zero_stage": accelerator.state.deepspeed_plugin.zero_stage,
        "built_partitioned": built_partitioned,
    }
    # Rank 0's: under data parallel each rank has its own micro-batches, so its own losses,
    # and two ranks writing one file would leave whichever finished last.
    if accelerator.is_main_process:
        (args.output_dir / "result.json").write_text(json.dumps(result, indent=1), encoding="utf-8")
    accelerator.end_training()


if __name__ == "__main__":
    main()
