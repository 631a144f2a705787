"""The clients a user swaps in first, each as a short HF Trainer script that never imports ``megatrain_ds``.

``test_trainer_clients.py`` runs it in fresh processes, on this engine and on DeepSpeed's
own (``MEGATRAIN_DISABLE_HOOK=1``, stage 0, fp32) as the reference::

    python integration_tests/trainer_clients.py --client CLIENT --output-dir DIR [--deepspeed-config JSON]
    python integration_tests/trainer_clients.py --client CLIENT[=JSON] --client ... --output-dir DIR
        [--preload-deepspeed-optimizers]

With several clients each runs in a child process forked after the libraries are imported
(torch, transformers, TRL, PEFT: most of a run's time, the same for every client), with
``DIR/CLIENT`` its output directory, ``DIR/CLIENT.log`` its output and ``JSON`` its
``--deepspeed-config``; ``DIR/exit_codes.json`` holds each child's exit code. A child starts
with nothing of a Trainer, Accelerate or DeepSpeed in it (the parent only imports, and with
``--preload-deepspeed-optimizers`` loads DeepSpeed's optimizer ops:
:func:`load_deepspeed_optimizer_code`), so each client runs as in a fresh process.

Clients (a tiny random-init byte-level Llama, a few optimizer steps each):

- ``checkpointing``: ``TrainingArguments(gradient_checkpointing=True)``;
- ``sft``: TRL's ``SFTTrainer`` with its ``SFTConfig`` defaults (gradient checkpointing on),
  variable-length examples padded per batch;
- ``sft_packing``: the same with ``packing=True`` (best-fit packing into rows longer than
  the model's 32 positions, TRL's padding-free collator: ``position_ids`` restart per
  sequence);
- ``lora``: a PEFT LoRA model (``get_peft_model``); ``trainer.save_model`` writes the adapter;
  ``lora_zero3`` the same, meant for a ZeRO-3 offload ``JSON`` (the LoRA user's usual config);
- ``sft_lora``: TRL's ``SFTTrainer`` given ``peft_config`` (it wraps the model itself);
- ``accelerate_lora``: a PEFT LoRA model in a plain Accelerate loop (``Accelerator`` with a
  ``DeepSpeedPlugin`` of ``JSON`` less its optimizer and scheduler: the script brings its own),
  the adapter saved as the Accelerate docs show (``save_pretrained`` of ``get_state_dict``);
- ``minimal``: the Trainer with ``--deepspeed-config`` (a hand-written JSON), scheduler from
  ``TrainingArguments``;
- ``resume``: six steps saving a checkpoint every three, then a fresh model and Trainer
  resumed from the first checkpoint (``resume_from_checkpoint``) for the last three;
- ``evaluate_first``: ``evaluate()``, ``predict()`` and ``save_model`` on a fresh Trainer,
  with no ``train()`` (the Trainer then builds the engine without an optimizer: ZeRO
  inference on DeepSpeed, which refuses it below stage 3; ``result.json`` says so where it
  did);
  ``evaluate_first_zero3`` the same, meant for a ZeRO-3 offload ``JSON``;
- ``pretrained``: ``from_pretrained(--model-dir)`` after ``TrainingArguments`` (with a ZeRO-3
  ``--deepspeed-config`` transformers then builds it under ``deepspeed.zero.Init``), then
  the Trainer as ``minimal``; with ``--fp16`` (``TrainingArguments(fp16=True)``, which fills
  the JSON's ``"fp16": {"enabled": "auto"}``) and ``--max-steps``, and with ``--record-steps``
  every step written down (``steps.json``, ``batches.safetensors``: see :class:`StepRecorder`).

It writes, under ``--output-dir``: ``result.json`` (the engine's classes, logged losses,
the evaluation loss, and what each client reports), ``initial.safetensors``,
``eval_batches.pt``, and ``model/`` (``trainer.save_model``: the model, or the adapter).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
from pathlib import Path
from typing import Any

import forked_runs
import safetensors.torch
import torch
import transformers
from tiny_clm import REPO_ROOT, SEQ_LEN, byte_blocks, corpus, tiny_llama

LR = 3e-3
HF_CONFIG = REPO_ROOT / "configs" / "ds_megatrain_hf.json"
CLIENTS = (
    "checkpointing",
    "sft",
    "sft_packing",
    "lora",
    "lora_zero3",
    "sft_lora",
    "accelerate_lora",
    "minimal",
    "resume",
    "evaluate_first",
    "evaluate_first_zero3",
    "pretrained",
)


def byte_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """One token per byte (ids 0-255, as ``tiny_clm.byte_blocks``): NUL pads, newline ends."""
    from tokenizers import Tokenizer, models

    vocab = {f"<{i}>": i for i in range(256)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<0>"))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<0>", eos_token="<10>")


def sft_examples(count: int) -> list[dict[str, list[int]]]:
    """``count`` consecutive byte spans of 12 to 32 tokens (pre-tokenized: TRL skips tokenizing)."""
    data = corpus().encode("utf-8")
    examples, start = [], 0
    for i in range(count):
        length = 12 + (i * 7) % (SEQ_LEN - 11)
        examples.append({"input_ids": list(data[start : start + length])})
        start += length
    return examples


def common_args(output_dir: Path, config: Path, **overrides: Any) -> dict[str, Any]:
    return (
        dict(
            output_dir=str(output_dir / "trainer"),
            deepspeed=str(config),
            per_device_train_batch_size=4,
            per_device_eval_batch_size=8,
            gradient_accumulation_steps=2,
            learning_rate=LR,
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
            num_train_epochs=1,
        )
        | overrides
    )


def train_with_trainer(
    args: argparse.Namespace, model: torch.nn.Module, **overrides: Any
) -> tuple[transformers.Trainer, dict[str, Any]]:
    text = corpus()
    training_args = transformers.TrainingArguments(**common_args(args.output_dir, args.deepspeed_config, **overrides))
    trainer = transformers.Trainer(
        model=model,
        args=training_args,
        train_dataset=byte_blocks(text, 48),
        eval_dataset=byte_blocks(text, 16, start=48),
    )
    trainer.train()
    return trainer, {"eval_loss": trainer.evaluate()["eval_loss"]}


def lora_config() -> Any:
    """The adapter every LoRA client trains: r=4 on the attention's q and v projections."""
    import peft

    return peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"
    )


def frozen_and_trained(args: argparse.Namespace, model: torch.nn.Module) -> dict[str, Any]:
    """Write the frozen base weights after training (``base_after.safetensors``, named as in
    the plain model) and list the trained parameters' names."""
    base = {
        name.removeprefix("base_model.model.").replace(".base_layer", ""): value.detach().clone().contiguous()
        for name, value in model.named_parameters()
        if not value.requires_grad
    }
    safetensors.torch.save_file(base, args.output_dir / "base_after.safetensors")
    return {"trainable": sorted(n for n, p in model.named_parameters() if p.requires_grad)}


def train_with_sft(
    args: argparse.Namespace, model: torch.nn.Module, packing: bool, peft_config: Any = None
) -> tuple[transformers.Trainer, dict[str, Any]]:
    import datasets
    import trl

    # SFTConfig's own defaults (gradient checkpointing on, its scheduler, its bf16 on a GPU:
    # on the CPU, where TrainingArguments refuses bf16 without use_cpu, fp32 as on both sides
    # of the comparison); a learning rate that moves the weights, one process's batch.
    sft_args = trl.SFTConfig(
        output_dir=str(args.output_dir / "trainer"),
        deepspeed=str(args.deepspeed_config),
        bf16=torch.cuda.is_available(),
        learning_rate=LR,
        per_device_train_batch_size=4,
        max_steps=6,
        logging_steps=1,
        report_to=[],
        seed=0,
        disable_tqdm=True,
        save_strategy="no",
        packing=packing,
        max_length=3 * SEQ_LEN if packing else SEQ_LEN,
    )
    examples = sft_examples(64)
    trainer = trl.SFTTrainer(
        model=model,
        args=sft_args,
        processing_class=byte_tokenizer(),
        train_dataset=datasets.Dataset.from_list(examples[:48]),
        eval_dataset=datasets.Dataset.from_list(examples[48:]),
        peft_config=peft_config,
    )
    batch = next(iter(trainer.get_train_dataloader()))
    trainer.train()
    return trainer, {
        "eval_loss": trainer.evaluate()["eval_loss"],
        "bf16": sft_args.bf16,
        "gradient_checkpointing": sft_args.gradient_checkpointing,
        "first_batch": {
            k: list(v.shape) if isinstance(v, torch.Tensor) else v
            for k, v in batch.items()
            if k in ("input_ids", "position_ids", "attention_mask", "max_length_q")
        },
    }


def train_with_lora(args: argparse.Namespace, model: torch.nn.Module) -> tuple[transformers.Trainer, dict[str, Any]]:
    import peft

    model = peft.get_peft_model(model, lora_config())
    trainer, extra = train_with_trainer(args, model)
    return trainer, extra | frozen_and_trained(args, trainer.model)


def train_lora_with_accelerate(
    args: argparse.Namespace, model: torch.nn.Module, eval_batches: list[torch.Tensor]
) -> dict[str, Any]:
    """A PEFT model in a plain Accelerate loop, as ``accelerate_clm.py`` runs a whole model
    (fixed order, no shuffling: the same batches on both engines); ``result.json``'s fields."""
    import accelerate
    import peft

    model = peft.get_peft_model(model, lora_config())
    config = json.loads(args.deepspeed_config.read_text(encoding="utf-8"))
    for key in ("optimizer", "scheduler"):  # the script brings its own
        config.pop(key, None)
    # What `accelerate launch` would tell the process; a forked child of its own, so it stays there.
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    plugin = accelerate.utils.DeepSpeedPlugin(hf_ds_config=config, gradient_accumulation_steps=2, gradient_clipping=1.0)
    accelerator = accelerate.Accelerator(deepspeed_plugin=plugin, gradient_accumulation_steps=2)
    loader = torch.utils.data.DataLoader(byte_blocks(corpus(), 48), batch_size=4)
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
    schedule = transformers.get_linear_schedule_with_warmup(optimizer, 2, len(loader) // 2)
    model, optimizer, loader, schedule = accelerator.prepare(model, optimizer, loader, schedule)
    micro_losses = []
    model.train()
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad()
        micro_losses.append(loss.item())
    model.eval()
    with torch.no_grad():
        eval_loss = sum(float(model(input_ids=b, labels=b).loss) for b in eval_batches) / len(eval_batches)
    unwrapped = accelerator.unwrap_model(model)
    unwrapped.save_pretrained(args.output_dir / "model", state_dict=accelerator.get_state_dict(model))
    result = {
        "engine_mro": [f"{c.__module__}.{c.__qualname__}" for c in type(model).__mro__],
        "losses": [sum(micro_losses[i : i + 2]) / 2 for i in range(0, len(micro_losses), 2)],  # per step
        "global_steps": model.global_steps,
        "eval_loss": eval_loss,
        **frozen_and_trained(args, unwrapped),
    }
    accelerator.end_training()
    return result


class StepRecorder(transformers.TrainerCallback):
    """What the Trainer did, step by step, for a test to replay on a reference.

    Per micro-batch (:class:`RecordingTrainer`): the batch it fed, the ``num_items_in_batch``
    it passed to the model and the loss ``training_step`` handed to ``accelerator.backward``.
    Per optimizer step (``on_step_end``, after the Trainer's own scheduler bookkeeping): the
    engine's loss scale (``optimizer.cur_scale`` and ``loss_scale``, DeepSpeed's two names),
    its ``overflow`` flag, Accelerate's ``optimizer_step_was_skipped`` (which the Trainer
    reads to decide whether to step the scheduler), the engine's ``skipped_steps`` and
    ``global_steps``, and the scheduler's position and learning rate.
    """

    def __init__(self) -> None:
        self.trainer: transformers.Trainer | None = None
        self.input_ids: list[torch.Tensor] = []
        self.labels: list[torch.Tensor] = []
        self.micro_batches: list[dict[str, Any]] = []
        self.steps: list[dict[str, Any]] = []

    def record_micro_batch(self, inputs: dict[str, Any], num_items_in_batch: Any, loss: torch.Tensor) -> None:
        assert set(inputs) == {"input_ids", "labels"}, sorted(inputs)  # all a replay needs
        self.input_ids.append(inputs["input_ids"].detach().cpu().clone())
        self.labels.append(inputs["labels"].detach().cpu().clone())
        items = int(num_items_in_batch) if num_items_in_batch is not None else None
        self.micro_batches.append({"num_items_in_batch": items, "loss": float(loss)})

    def on_step_end(self, args: Any, state: transformers.TrainerState, control: Any, **kwargs: Any) -> None:
        assert self.trainer is not None
        engine = self.trainer.model_wrapped
        scheduler = getattr(self.trainer.lr_scheduler, "scheduler", self.trainer.lr_scheduler)
        self.steps.append(
            {
                "global_step": state.global_step,
                "cur_scale": float(engine.optimizer.cur_scale),
                "loss_scale": float(engine.optimizer.loss_scale),
                "overflow": bool(engine.optimizer.overflow),
                "optimizer_step_was_skipped": bool(self.trainer.accelerator.optimizer_step_was_skipped),
                "engine_skipped_steps": int(engine.skipped_steps),
                "engine_global_steps": int(engine.global_steps),
                "scheduler_iteration": getattr(scheduler, "last_batch_iteration", None),
                "lr": float(engine.get_lr()[0]),
            }
        )

    def save(self, output_dir: Path) -> None:
        tensors = {"input_ids": torch.stack(self.input_ids), "labels": torch.stack(self.labels)}
        safetensors.torch.save_file(tensors, output_dir / "batches.safetensors")
        record = {"micro_batches": self.micro_batches, "steps": self.steps}
        (output_dir / "steps.json").write_text(json.dumps(record, indent=1), encoding="utf-8")


class RecordingTrainer(transformers.Trainer):
    """The Trainer, handing each micro-batch and its loss to a :class:`StepRecorder`."""

    def __init__(self, *args: Any, recorder: StepRecorder, **kwargs: Any) -> None:
        super().__init__(*args, callbacks=[recorder], **kwargs)
        self.recorder = recorder
        recorder.trainer = self

    def training_step(
        self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None
    ) -> torch.Tensor:
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.recorder.record_micro_batch(inputs, num_items_in_batch, loss)
        return loss


def train_from_pretrained(args: argparse.Namespace) -> tuple[transformers.Trainer, dict[str, Any]]:
    """The usual order: ``TrainingArguments`` (which registers the DeepSpeed config with
    transformers) before ``from_pretrained``."""
    text = corpus()
    overrides: dict[str, Any] = {"fp16": args.fp16}
    if args.max_steps is not None:
        overrides["max_steps"] = args.max_steps
    training_args = transformers.TrainingArguments(**common_args(args.output_dir, args.deepspeed_config, **overrides))
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    built_partitioned = any(hasattr(p, "ds_id") for p in model.parameters())  # by deepspeed.zero.Init
    recorder = StepRecorder() if args.record_steps else None
    trainer_class = functools.partial(RecordingTrainer, recorder=recorder) if recorder else transformers.Trainer
    trainer = trainer_class(
        model=model,
        args=training_args,
        train_dataset=byte_blocks(text, 48),
        eval_dataset=byte_blocks(text, 16, start=48),
    )
    trainer.train()
    if recorder is not None:
        recorder.save(args.output_dir)
    return trainer, {
        "eval_loss": trainer.evaluate()["eval_loss"],
        "built_partitioned": built_partitioned,
        "zero_stage": trainer.accelerator.state.deepspeed_plugin.zero_stage,
        # The config as the Trainer filled it ("auto" replaced from TrainingArguments).
        "deepspeed_config": trainer.accelerator.state.deepspeed_plugin.deepspeed_config,
    }


def evaluate_before_training(args: argparse.Namespace, model: torch.nn.Module) -> dict[str, Any]:
    """``evaluate()``, ``predict()`` on the evaluation set and ``save_model``, no ``train()``;
    ``result.json``'s fields. transformers' refusal of ZeRO inference below stage 3
    (DeepSpeed's engine given the minimal config spelled out at stage 0) is recorded, not
    raised: the test checks it."""
    text = corpus()
    training_args = transformers.TrainingArguments(**common_args(args.output_dir, args.deepspeed_config))
    evaluation = byte_blocks(text, 16, start=48)
    trainer = transformers.Trainer(
        model=model, args=training_args, train_dataset=byte_blocks(text, 48), eval_dataset=evaluation
    )
    try:
        eval_loss = trainer.evaluate()["eval_loss"]
    except ValueError as error:
        if "ZeRO inference only makes sense with ZeRO Stage 3" not in str(error):
            raise
        return {"refused": str(error)}
    predict_loss = trainer.predict(evaluation).metrics["test_loss"]
    trainer.save_model(str(args.output_dir / "model"))  # evaluated, then saved: never trained
    engine = trainer.model_wrapped
    host_bytes = getattr(engine, "host_bytes", None)  # the megatrain engine's host state
    return {
        "engine_mro": [f"{c.__module__}.{c.__qualname__}" for c in type(engine).__mro__],
        "eval_loss": eval_loss,
        "predict_loss": predict_loss,
        "global_steps": trainer.state.global_step,
        "host_bytes": host_bytes() if callable(host_bytes) else None,
    }


def train_and_resume(args: argparse.Namespace, model: torch.nn.Module) -> tuple[transformers.Trainer, dict[str, Any]]:
    overrides = dict(max_steps=6, save_strategy="steps", save_steps=3)
    trainer, _ = train_with_trainer(args, model, **overrides)
    uninterrupted = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    transformers.set_seed(0)
    (args.output_dir / "fresh").mkdir()
    fresh = tiny_llama(args.output_dir / "fresh")
    training_args = transformers.TrainingArguments(**common_args(args.output_dir, args.deepspeed_config, **overrides))
    resumed = transformers.Trainer(
        model=fresh,
        args=training_args,
        train_dataset=byte_blocks(corpus(), 48),
        eval_dataset=byte_blocks(corpus(), 16, start=48),
    )
    resumed.train(resume_from_checkpoint=str(args.output_dir / "trainer" / "checkpoint-3"))
    after_resume = [entry["loss"] for entry in resumed.state.log_history if "loss" in entry and entry["step"] > 3]
    return resumed, {
        "eval_loss": resumed.evaluate()["eval_loss"],
        "uninterrupted_losses": uninterrupted,
        "losses_after_resume": after_resume,
        "checkpoint_files": sorted(p.name for p in (args.output_dir / "trainer" / "checkpoint-3").iterdir()),
    }


def run_client(args: argparse.Namespace) -> None:
    """Train ``args.client`` and write its outputs under ``args.output_dir``."""
    args.output_dir.mkdir(parents=True, exist_ok=True)
    transformers.set_seed(0)
    model = tiny_llama(args.output_dir)
    eval_batches = [torch.stack([e["input_ids"] for e in byte_blocks(corpus(), 8, start=48 + 8 * i)]) for i in (0, 1)]
    torch.save(eval_batches, args.output_dir / "eval_batches.pt")
    if args.client in ("accelerate_lora", "evaluate_first", "evaluate_first_zero3"):
        if args.client == "accelerate_lora":
            result = train_lora_with_accelerate(args, model, eval_batches)
        else:
            result = evaluate_before_training(args, model)
        (args.output_dir / "result.json").write_text(json.dumps(result, indent=1), encoding="utf-8")
        return

    if args.client in ("checkpointing", "minimal"):
        trainer, extra = train_with_trainer(args, model, gradient_checkpointing=args.client == "checkpointing")
        extra["is_gradient_checkpointing"] = model.is_gradient_checkpointing
    elif args.client in ("sft", "sft_packing"):
        trainer, extra = train_with_sft(args, model, packing=args.client == "sft_packing")
    elif args.client == "sft_lora":
        trainer, extra = train_with_sft(args, model, packing=False, peft_config=lora_config())
        extra |= frozen_and_trained(args, trainer.model)
    elif args.client in ("lora", "lora_zero3"):
        trainer, extra = train_with_lora(args, model)
    elif args.client == "pretrained":
        trainer, extra = train_from_pretrained(args)
    else:
        trainer, extra = train_and_resume(args, model)
    trainer.save_model(str(args.output_dir / "model"))

    engine = trainer.model_wrapped
    result = {
        "engine_mro": [f"{c.__module__}.{c.__qualname__}" for c in type(engine).__mro__],
        "losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
        "learning_rates": [entry["learning_rate"] for entry in trainer.state.log_history if "loss" in entry],
        "grad_norms": [entry.get("grad_norm") for entry in trainer.state.log_history if "loss" in entry],
        "global_steps": trainer.state.global_step,
        **extra,
    }
    (args.output_dir / "result.json").write_text(json.dumps(result, indent=1), encoding="utf-8")


def run_in_child(args: argparse.Namespace) -> int:
    """:func:`run_client` in a forked child, its output in ``<output-dir>.log``; its exit code."""

    def body() -> None:
        with open(args.output_dir.with_name(args.output_dir.name + ".log"), "w", encoding="utf-8") as log:
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
        run_client(args)

    return forked_runs.run_forked(body)


def load_deepspeed_optimizer_code() -> None:
    """Load, before the forks, the optimizer code that DeepSpeed's engine loads on first use,
    which each forked client would otherwise load again (the parent loads it as it imports the
    libraries: a client still builds every optimizer and engine itself). For the runs on
    DeepSpeed's engine (``--preload-deepspeed-optimizers``), where every client loads some of it;
    on the megatrain engine only the ``accelerate_lora`` client loads one op, and loading them
    all in the parent would cost more than it saves.

    - The ops of the optimizers DeepSpeed builds: ``FusedAdam`` (a config's ``"optimizer"``
      block at stage 0), ``DeepSpeedCPUAdam`` (with ``offload_optimizer``; Accelerate, too, for
      a client's ``AdamW`` there, on either engine). DeepSpeed's builder keeps a loaded op for
      the process (``OpBuilder._loaded_ops``), but loading one probes the CPU twice in child
      interpreters (py-cpuinfo): about 2.4 s of CPU per op, per client.
    - The module DeepSpeed's ZeRO optimizer check imports (its Muon optimizer, whose
      ``torch.compile`` decorators import Inductor): about 2 s per ZeRO-3 client.
    """
    import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401
    from deepspeed.ops.op_builder import CPUAdamBuilder, FusedAdamBuilder  # pyright: ignore[reportAttributeAccessIssue]

    CPUAdamBuilder().load()
    FusedAdamBuilder().load()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--client", action="append", required=True, help="CLIENT (one, in this process) or CLIENT=JSON (several)"
    )
    parser.add_argument("--output-dir", type=Path, required=True)
    parser.add_argument("--deepspeed-config", type=Path, default=HF_CONFIG)
    parser.add_argument("--model-dir", type=Path, default=None, help="the pretrained client's model")
    parser.add_argument("--fp16", action="store_true", help="the pretrained client: TrainingArguments(fp16=True)")
    parser.add_argument(
        "--max-steps", type=int, default=None, help="the pretrained client: TrainingArguments(max_steps)"
    )
    parser.add_argument("--record-steps", action="store_true", help="the pretrained client: write steps.json")
    parser.add_argument(
        "--preload-deepspeed-optimizers",
        action="store_true",
        help="several clients: load DeepSpeed's optimizer ops before the forks (load_deepspeed_optimizer_code)",
    )
    args = parser.parse_args()
    clients = [(name, Path(config) if config else args.deepspeed_config) for name, _, config in
               (spec.partition("=") for spec in args.client)]  # fmt: skip
    for name, _ in clients:
        if name not in CLIENTS:
            parser.error(f"--client {name!r}: one of {', '.join(CLIENTS)}")
    if len(clients) == 1:
        args.client, args.deepspeed_config = clients[0]
        run_client(args)
        return
    # What the clients import when they first need it, imported once before the forks (the
    # names touched load the modules transformers, TRL and PEFT import lazily; DeepSpeed is
    # what the Trainer imports for its config, routed by the start-up hook as it would be there).
    import accelerate
    import datasets  # noqa: F401
    import deepspeed  # noqa: F401
    import peft
    import trl

    for module, names in (
        (transformers, ("Trainer", "TrainingArguments", "LlamaForCausalLM", "AutoModelForCausalLM")),
        (trl, ("SFTConfig", "SFTTrainer")),
        (peft, ("LoraConfig", "get_peft_model", "PeftModel")),
        (accelerate, ("Accelerator",)),
        (accelerate.utils, ("DeepSpeedPlugin",)),
    ):
        for name in names:
            getattr(module, name)
    if args.preload_deepspeed_optimizers:
        load_deepspeed_optimizer_code()

    args.output_dir.mkdir(parents=True, exist_ok=True)
    codes = {}
    for name, config in clients:
        child = argparse.Namespace(**{**vars(args), "client": name, "deepspeed_config": config})
        child.output_dir = args.output_dir / name
        codes[name] = run_in_child(child)
    (args.output_dir / "exit_codes.json").write_text(json.dumps(codes), encoding="utf-8")


if __name__ == "__main__":
    main()
