"""Train a causal language model: a plain Accelerate script, run on the megatrain engine.

The project's main job, small enough for a laptop CPU: a Llama-shaped model (random
init from ``configs/models/tiny_llama.json``, byte-level: tokens are the bytes 0..255)
learns the King James excerpt in ``data/kjv_excerpt.txt``. The first 95% of the text
trains, the last 5% evaluates. ``--model DIR`` fine-tunes any local Hugging Face
causal-LM directory instead, with its own tokenizer.

    accelerate launch --config_file configs/accelerate_megatrain.yaml examples/train_clm.py
    python examples/train_clm.py        # the same, one process, without the launcher

Nothing here is specific to the engine: the script prepares a model, a client AdamW
(no weight decay on norms and biases), a DataLoader and a warm-up/cosine scheduler with
Accelerate and trains with ``accelerator.backward``. The DeepSpeed JSON's
``"engine": "megatrain"`` routes ``deepspeed.initialize`` to the engine (the package
installs that routing; ``MEGATRAIN_DISABLE_HOOK=1`` gives plain DeepSpeed instead).
The GPU is used when there is one (add ``--mixed_precision bf16`` to the launch for bf16
compute), else the CPU. It writes ``loss_curve.png``, ``metrics.json`` and the trained
model (``model/``, loadable with ``AutoModelForCausalLM.from_pretrained``) to ``--output-dir``.
"""

from __future__ import annotations

import os

import torch

# DeepSpeed reads this when it is imported: without a GPU it must use its CPU accelerator.
if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

import argparse
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # no display needed; must precede pyplot
import matplotlib.pyplot as plt
import transformers
from accelerate import Accelerator
from accelerate.utils import DeepSpeedPlugin
from tqdm.auto import tqdm

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO_ROOT / "data" / "kjv_excerpt.txt"
DEFAULT_MODEL_CONFIG = REPO_ROOT / "configs" / "models" / "tiny_llama.json"
DEFAULT_DEEPSPEED_CONFIG = REPO_ROOT / "configs" / "ds_megatrain_accelerate.json"
EVAL_FRACTION = 0.05
# Measured on 2 CPU cores (fp32, seq 128, micro-batch 8): ~0.14 s a step (~7,500 tokens/s),
# so 1000 steps plus evaluation take ~2.5 minutes; eval loss falls from 5.54 (ln 256) to
# ~1.4 nats per byte.
DEFAULT_STEPS = 1000

Batch = dict[str, torch.Tensor]
Encode = Callable[[str], torch.Tensor]


@dataclass
class TrainResult:
    """What a run produced; ``main`` returns it so tests can check the numbers."""

    engine_type: str
    """Module and class of the prepared model: the engine Accelerate got from DeepSpeed."""
    losses: list[float]
    """Training loss of every optimizer step."""
    eval_steps: list[int]
    eval_losses: list[float]
    """Evaluation loss after each of ``eval_steps`` (step 0 is before training)."""
    initial_eval_loss: float
    final_eval_loss: float
    tokens_per_second: float
    """Training throughput, evaluation time excluded."""
    plot_path: Path
    model_dir: Path
    device: torch.device
    """Where the engine computed."""
    eval_batches: list[Batch]
    """The held-out micro-batches every evaluation used (on the host)."""
    seconds: float
    """Wall time of ``main``, start to end."""

    def to_json(self) -> dict[str, Any]:
        """Everything but the batches (written to ``metrics.json``)."""
        data = asdict(self)
        del data["eval_batches"]
        return {key: str(value) if isinstance(value, (Path, torch.device)) else value for key, value in data.items()}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument(
        "--deepspeed_config",
        type=Path,
        default=DEFAULT_DEEPSPEED_CONFIG,
        help="DeepSpeed JSON when run without `accelerate launch` (with it, the Accelerate config names the JSON)",
    )
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per micro-batch")
    parser.add_argument("--gradient-accumulation-steps", type=int, default=1)
    parser.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    parser.add_argument("--weight-decay", type=float, default=0.1, help="on matrices only")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per training sequence")
    parser.add_argument("--eval-every", type=int, default=50, help="steps between evaluations")
    parser.add_argument(
        "--eval-batches",
        type=int,
        default=8,
        help="micro-batches of held-out text per evaluation (the same ones each time)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--model", type=Path, default=None, help="fine-tune this local Hugging Face causal-LM directory instead"
    )
    parser.add_argument(
        "--model-config",
        type=Path,
        default=DEFAULT_MODEL_CONFIG,
        help="model config JSON for random init (ignored with --model)",
    )
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="UTF-8 text corpus")
    parser.add_argument("--output-dir", type=Path, default=Path("runs/train_clm"))
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    for name in ("steps", "seq_len", "eval_every", "eval_batches", "batch_size", "gradient_accumulation_steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


# -- data -----------------------------------------------------------------------------------


def split_corpus(text: str, eval_fraction: float = EVAL_FRACTION) -> tuple[str, str]:
    """The first ``1 - eval_fraction`` of the text trains, the rest evaluates.

    The cut is at a line start, and contiguous so that no verse is on both sides.
    """
    cut = int(len(text) * (1 - eval_fraction))
    newline = text.find("\n", cut)
    cut = newline + 1 if newline != -1 else cut
    return text[:cut], text[cut:]


def encode_bytes(text: str) -> torch.Tensor:
    """Byte-level tokenizer: the UTF-8 bytes are the token ids (vocabulary of 256)."""
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()


def hf_encoder(tokenizer: Any) -> Encode:
    """Tokenise a whole corpus with a Hugging Face tokenizer, without special tokens."""

    def encode(text: str) -> torch.Tensor:
        # The corpus is far longer than the model's context; it is cut into blocks later,
        # so the tokenizer's "sequence too long" warning does not apply.
        saved, tokenizer.model_max_length = tokenizer.model_max_length, int(1e30)
        try:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        finally:
            tokenizer.model_max_length = saved
        return torch.tensor(ids, dtype=torch.long)

    return encode


class RandomWindows(torch.utils.data.Dataset):
    """``num_samples`` windows of ``seq_len`` tokens at random offsets fixed by ``seed``;
    labels = inputs (the model shifts them)."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, num_samples: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.tokens, self.seq_len = tokens, seq_len
        self.starts = torch.randint(0, tokens.numel() - seq_len + 1, (num_samples,), generator=generator).tolist()

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index: int) -> Batch:
        window = self.tokens[self.starts[index] : self.starts[index] + self.seq_len]  # [T]
        return {"input_ids": window, "labels": window.clone()}


def make_eval_batches(tokens: torch.Tensor, batch_size: int, seq_len: int, max_batches: int) -> list[Batch]:
    """Consecutive non-overlapping blocks of the held-out text, the same for every call."""
    num_blocks = min(tokens.numel() // seq_len, batch_size * max_batches)
    if num_blocks < 1:
        raise ValueError(f"the evaluation text has {tokens.numel()} tokens, fewer than --seq-len {seq_len}")
    blocks = tokens[: num_blocks * seq_len].view(num_blocks, seq_len)  # [N, T]
    return [{"input_ids": chunk, "labels": chunk.clone()} for chunk in blocks.split(batch_size)]


def to_device(batch: Batch, device: torch.device) -> Batch:
    return {key: value.to(device, non_blocking=True) for key, value in batch.items()}


# -- model, schedule, evaluation ---------------------------------------------------------------


def build_model(args: argparse.Namespace) -> tuple[transformers.PreTrainedModel, Encode, Any]:
    """The model to train, the corpus encoder, and the tokenizer to save (``None`` for bytes)."""
    if args.model is not None:
        model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
        tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
        return model, hf_encoder(tokenizer), tokenizer
    config = transformers.LlamaConfig.from_json_file(args.model_config)
    if config.vocab_size < 256:
        raise ValueError(f"{args.model_config}: a byte-level model needs vocab_size >= 256")
    return transformers.AutoModelForCausalLM.from_config(config), encode_bytes, None


def parameter_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on matrices only: norms' gains (and any biases) are not decayed."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def warmup_cosine(optimizer: torch.optim.Optimizer, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up over 5% of the steps, then cosine decay to 10% of the peak lr."""
    warmup = max(1, total_steps // 20)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


@torch.no_grad()
def evaluate(model: Callable[..., Any], batches: Sequence[Batch], device: torch.device) -> float:
    """Mean loss over ``batches`` (every block is full, so each batch weighs the same)."""
    total = 0.0
    for batch in batches:
        total += float(model(**to_device(batch, device)).loss)
    return total / len(batches)


def plot_losses(path: Path, losses: Sequence[float], eval_steps: Sequence[int], eval_losses: Sequence[float]) -> None:
    """Training loss per step (raw and smoothed) and evaluation loss, to a PNG."""
    smoothed, ema = [], losses[0]
    for loss in losses:
        ema = 0.9 * ema + 0.1 * loss
        smoothed.append(ema)
    steps = range(1, len(losses) + 1)
    figure, axes = plt.subplots(figsize=(7, 4.5))
    axes.plot(steps, losses, color="tab:blue", alpha=0.25, linewidth=0.8, label="train (per step)")
    axes.plot(steps, smoothed, color="tab:blue", label="train (EMA 0.9)")
    axes.plot(eval_steps, eval_losses, "o-", color="tab:orange", label="eval")
    axes.set_xlabel("optimizer step")
    axes.set_ylabel("cross-entropy (nats/token)")
    axes.set_title("megatrain: causal-LM training")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


# -- main ---------------------------------------------------------------------------------------


def make_accelerator(args: argparse.Namespace) -> Accelerator:
    """The launcher's Accelerator, or, run as plain ``python``, one with ``--deepspeed_config``."""
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":  # accelerate launch
        return Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps)
    # One process without the launcher: DeepSpeed's process group still wants these.
    for key, value in {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
    }.items():
        os.environ.setdefault(key, value)
    return Accelerator(
        deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=str(args.deepspeed_config)),
        mixed_precision="bf16" if torch.cuda.is_available() else "no",
        gradient_accumulation_steps=args.gradient_accumulation_steps,
    )


def main(argv: Sequence[str] | None = None) -> TrainResult:
    """Train, evaluate, plot and save; see the module docstring and ``--help``."""
    args = parse_args(argv)
    started = time.perf_counter()
    accelerator = make_accelerator(args)
    transformers.set_seed(args.seed)
    args.output_dir.mkdir(parents=True, exist_ok=True)

    model, encode, tokenizer = build_model(args)
    max_positions = getattr(model.config, "max_position_embeddings", None)
    if max_positions is not None and args.seq_len > max_positions:
        raise ValueError(f"--seq-len {args.seq_len} exceeds the model's max_position_embeddings {max_positions}")
    train_text, eval_text = split_corpus(args.data.read_text(encoding="utf-8"))
    train_tokens, eval_tokens = encode(train_text), encode(eval_text)
    if train_tokens.numel() < args.seq_len:
        raise ValueError(f"the training text has {train_tokens.numel()} tokens, fewer than --seq-len {args.seq_len}")
    accumulation = args.gradient_accumulation_steps
    train_loader = torch.utils.data.DataLoader(
        RandomWindows(train_tokens, args.seq_len, args.steps * accumulation * args.batch_size, args.seed),
        batch_size=args.batch_size,
    )
    eval_batches = make_eval_batches(eval_tokens, args.batch_size, args.seq_len, args.eval_batches)
    num_parameters = sum(p.numel() for p in model.parameters())

    optimizer = torch.optim.AdamW(parameter_groups(model, args.weight_decay), lr=args.lr, betas=(0.9, 0.95))
    scheduler = warmup_cosine(optimizer, args.steps)
    # The DeepSpeed JSON's "auto" values are filled here: micro-batch from the DataLoader,
    # accumulation from the Accelerator. With "engine": "megatrain", `model` is the engine.
    model, optimizer, train_loader, scheduler = accelerator.prepare(model, optimizer, train_loader, scheduler)
    device = accelerator.device
    engine_type = f"{type(model).__module__}.{type(model).__qualname__}"
    tokens_per_step = args.batch_size * accumulation * args.seq_len
    print(
        f"model: {num_parameters / 1e6:.2f}M parameters | data: {train_tokens.numel():,} train / "
        f"{eval_tokens.numel():,} eval tokens | engine: {engine_type} on {device} "
        f"(mixed precision: {accelerator.mixed_precision}) | {tokens_per_step:,} tokens a step"
    )

    model.eval()
    eval_steps, eval_losses = [0], [evaluate(model, eval_batches, device)]
    model.train()
    losses: list[float] = []
    train_seconds, step_loss, step = 0.0, 0.0, 0
    progress = tqdm(total=args.steps, desc="train", disable=args.no_progress, dynamic_ncols=True)
    tick = time.perf_counter()
    for batch in train_loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)  # at the last micro-batch: the engine's optimizer step
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        step_loss += loss.detach().item() / accumulation  # waits for the micro-batch's work
        if not accelerator.sync_gradients:
            continue
        step += 1
        train_seconds += time.perf_counter() - tick
        losses.append(step_loss)
        step_loss = 0.0
        if step % args.eval_every == 0 or step == args.steps:
            model.eval()
            eval_steps.append(step)
            eval_losses.append(evaluate(model, eval_batches, device))
            model.train()
        progress.update()
        progress.set_postfix(
            loss=f"{losses[-1]:.3f}",
            eval=f"{eval_losses[-1]:.3f}",
            tok_s=f"{step * tokens_per_step / train_seconds:,.0f}",
            lr=f"{scheduler.get_last_lr()[0]:.1e}",
        )
        tick = time.perf_counter()
    progress.close()

    plot_path = args.output_dir / "loss_curve.png"
    model_dir = args.output_dir / "model"
    if accelerator.is_main_process:
        plot_losses(plot_path, losses, eval_steps, eval_losses)
    # The state dict holds the fp32 masters: nothing to gather.
    accelerator.unwrap_model(model).save_pretrained(
        model_dir,
        state_dict=accelerator.get_state_dict(model),
        is_main_process=accelerator.is_main_process,
        save_function=accelerator.save,
    )
    if tokenizer is not None and accelerator.is_main_process:
        tokenizer.save_pretrained(model_dir)

    result = TrainResult(
        engine_type=engine_type,
        losses=losses,
        eval_steps=eval_steps,
        eval_losses=eval_losses,
        initial_eval_loss=eval_losses[0],
        final_eval_loss=eval_losses[-1],
        tokens_per_second=len(losses) * tokens_per_step / train_seconds,
        plot_path=plot_path,
        model_dir=model_dir,
        device=device,
        eval_batches=eval_batches,
        seconds=time.perf_counter() - started,
    )
    if accelerator.is_main_process:
        (args.output_dir / "metrics.json").write_text(json.dumps(result.to_json(), indent=1), encoding="utf-8")
    accelerator.end_training()
    accelerator.free_memory()  # destroys the engine: its worker thread, pinned memory
    tail = losses[-min(20, len(losses)) :]
    print(
        f"done: {len(losses)} steps in {result.seconds:.1f}s | final train loss "
        f"{sum(tail) / len(tail):.4f} (mean of last {len(tail)}) | eval loss "
        f"{result.initial_eval_loss:.4f} -> {result.final_eval_loss:.4f} | "
        f"{result.tokens_per_second:,.0f} tokens/s | saved {plot_path} and {model_dir}"
    )
    return result


if __name__ == "__main__":
    main()
