"""An HF Trainer run on the megatrain engine: ``TrainingArguments(deepspeed=...)``, nothing else.

``test_hf_trainer.py`` runs it in a fresh process::

    python integration_tests/hf_trainer_clm.py --output-dir DIR [--learning-rate 0]

The DeepSpeed config is the shipped ``configs/ds_megatrain_hf.json``, whose batch sizes,
clipping, precision, optimizer hyperparameters and scheduler steps are all ``"auto"``:
the Trainer fills them from ``TrainingArguments``. A tiny random-init Llama learns
byte-level text from ``data/kjv_excerpt.txt``; the script never imports ``megatrain_ds``.
It writes, under ``--output-dir``: ``result.json`` (the engine's classes, logged losses
and learning rates, the evaluation loss), ``initial.safetensors``, ``eval_batches.pt`` and
``model/`` (``trainer.save_model``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import transformers
from tiny_clm import REPO_ROOT, byte_blocks, corpus, tiny_llama


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", type=Path, required=True)
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--num-examples", type=int, default=96)
    args = parser.parse_args()
    args.output_dir.mkdir(parents=True, exist_ok=True)

    training_args = transformers.TrainingArguments(
        output_dir=str(args.output_dir / "trainer"),
        deepspeed=str(REPO_ROOT / "configs" / "ds_megatrain_hf.json"),
        per_device_train_batch_size=4,
        per_device_eval_batch_size=8,
        gradient_accumulation_steps=2,
        num_train_epochs=1,
        learning_rate=args.learning_rate,
        weight_decay=0.1,
        adam_beta2=0.95,
        warmup_steps=2,
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="no",
        eval_strategy="no",
        report_to=[],
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    transformers.set_seed(training_args.seed)
    model = tiny_llama(args.output_dir)

    text = corpus()
    train_dataset = byte_blocks(text, args.num_examples)
    eval_dataset = byte_blocks(text, 16, start=args.num_examples)
    torch.save(
        [torch.stack([e["input_ids"] for e in eval_dataset[i : i + 8]]) for i in (0, 8)],
        args.output_dir / "eval_batches.pt",
    )

    trainer = transformers.Trainer(
        model=model, args=training_args, train_dataset=train_dataset, eval_dataset=eval_dataset
    )
    trainer.train()
    metrics = trainer.evaluate()
    trainer.save_model(str(args.output_dir / "model"))

    engine = trainer.model_wrapped
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    result = {
        "engine_mro": [f"{c.__module__}.{c.__qualname__}" for c in type(engine).__mro__],
        "scheduler": type(getattr(trainer.lr_scheduler, "scheduler", trainer.lr_scheduler)).__name__,
        "losses": [entry["loss"] for entry in logs],
        "learning_rates": [entry["learning_rate"] for entry in logs],
        "grad_norms": [entry.get("grad_norm") for entry in logs],
        "global_steps": engine.global_steps,
        "eval_loss": metrics["eval_loss"],
    }
    (args.output_dir / "result.json").write_text(json.dumps(result, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
