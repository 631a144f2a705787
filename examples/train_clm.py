"""Train a causal language model with the megatrain engine through ``deepspeed.initialize``.

The project's main job, small enough for a laptop CPU: a Llama-shaped model (random
init from ``configs/models/tiny_llama.json``, byte-level: tokens are the bytes 0..255)
learns the King James excerpt in ``data/kjv_excerpt.txt``. The first 95% of the text
trains, the last 5% evaluates. ``--model DIR`` fine-tunes any local Hugging Face
causal-LM directory instead, with its own tokenizer.

    python examples/train_clm.py                        # ~2-3 minutes on 2 CPU cores
    python examples/train_clm.py --steps 2000 --deepspeed_config configs/ds_megatrain.json

The engine picks its device itself (the GPU when there is one); the script only moves
batches to ``engine.runtime.device``. It writes ``loss_curve.png`` and the trained model
(``model/``, loadable with ``AutoModelForCausalLM.from_pretrained``) to ``--output-dir``.
"""

from __future__ import annotations

import os

import torch

# DeepSpeed reads these when it is imported; one process needs them as much as many.
if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
for _key, _value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "RANK": "0",
                     "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
    os.environ.setdefault(_key, _value)

import argparse  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable, Sequence  # noqa: E402

import deepspeed  # noqa: E402
import matplotlib  # noqa: E402

matplotlib.use("Agg")  # no display needed; must precede pyplot
import matplotlib.pyplot as plt  # noqa: E402
import transformers  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

import megatrain_ds  # noqa: E402,F401  (routes deepspeed.initialize to the engine)

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO_ROOT / "data" / "kjv_excerpt.txt"
DEFAULT_MODEL_CONFIG = REPO_ROOT / "configs" / "models" / "tiny_llama.json"
EVAL_FRACTION = 0.05
# Measured on 2 CPU cores (fp32 config, seq 128, micro-batch 8): ~0.14 s a step
# (~7,500 tokens/s), so 1000 steps plus evaluation take ~2.5 minutes; eval loss falls
# from 5.54 (ln 256) to ~1.42 nats per byte.
DEFAULT_STEPS = 1000

Batch = dict[str, torch.Tensor]
Encode = Callable[[str], torch.Tensor]


@dataclass
class TrainResult:
    """What a run produced; ``main`` returns it so tests can check the numbers."""

    engine_type: type
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


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    default_config = REPO_ROOT / "configs" / (
        "ds_megatrain.json" if torch.cuda.is_available() else "ds_megatrain_fp32.json")
    parser.add_argument("--deepspeed_config", type=Path, default=default_config,
                        help="DeepSpeed JSON with \"engine\": \"megatrain\" (bf16 on GPU, fp32 on CPU)")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="optimizer steps")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per training sequence")
    parser.add_argument("--eval-every", type=int, default=50, help="steps between evaluations")
    parser.add_argument("--eval-batches", type=int, default=8,
                        help="micro-batches of held-out text per evaluation (the same ones each time)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", type=Path, default=None,
                        help="fine-tune this local Hugging Face causal-LM directory instead")
    parser.add_argument("--model-config", type=Path, default=DEFAULT_MODEL_CONFIG,
                        help="model config JSON for random init (ignored with --model)")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="UTF-8 text corpus")
    parser.add_argument("--output-dir", type=Path, default=Path("runs/train_clm"))
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    for name in ("steps", "seq_len", "eval_every", "eval_batches"):
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


def sample_train_batch(tokens: torch.Tensor, batch_size: int, seq_len: int,
                       generator: torch.Generator) -> Batch:
    """``batch_size`` windows of ``seq_len`` tokens at random offsets; labels = inputs
    (the model shifts them)."""
    starts = torch.randint(0, tokens.numel() - seq_len + 1, (batch_size,), generator=generator)
    input_ids = torch.stack([tokens[s : s + seq_len] for s in starts.tolist()])  # [B, T]
    return {"input_ids": input_ids, "labels": input_ids.clone()}


def make_eval_batches(tokens: torch.Tensor, batch_size: int, seq_len: int,
                      max_batches: int) -> list[Batch]:
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


def parameter_groups(model: torch.nn.Module) -> list[dict[str, Any]]:
    """Weight decay on matrices only: norms' gains (and any biases) are not decayed."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]


def warmup_cosine(total_steps: int) -> Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LambdaLR]:
    """Linear warm-up over 5% of the steps, then cosine decay to 10% of the config's lr.

    Returned as DeepSpeed's callable form: ``deepspeed.initialize`` calls it with the
    engine's optimizer.
    """
    warmup = max(1, total_steps // 20)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))

    return lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


@torch.no_grad()
def evaluate(model: Callable[..., Any], batches: Sequence[Batch], device: torch.device) -> float:
    """Mean loss over ``batches`` (every block is full, so each batch weighs the same)."""
    total = 0.0
    for batch in batches:
        total += float(model(**to_device(batch, device)).loss)
    return total / len(batches)


def plot_losses(path: Path, losses: Sequence[float], eval_steps: Sequence[int],
                eval_losses: Sequence[float]) -> None:
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


def main(argv: Sequence[str] | None = None) -> TrainResult:
    """Train, evaluate, plot and save; see the module docstring and ``--help``."""
    args = parse_args(argv)
    started = time.perf_counter()
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

    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=parameter_groups(model), config=str(args.deepspeed_config),
        lr_scheduler=warmup_cosine(args.steps),
    )
    try:
        device = engine.runtime.device
        batch_size = engine.train_micro_batch_size_per_gpu()
        accumulation = engine.gradient_accumulation_steps()
        eval_batches = make_eval_batches(eval_tokens, batch_size, args.seq_len, args.eval_batches)
        generator = torch.Generator().manual_seed(args.seed)
        tokens_per_step = batch_size * accumulation * args.seq_len
        print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters | "
              f"data: {train_tokens.numel():,} train / {eval_tokens.numel():,} eval tokens | "
              f"engine: {type(engine).__name__} on {device} | config: {args.deepspeed_config}")

        engine.eval()
        eval_steps, eval_losses = [0], [evaluate(engine, eval_batches, device)]
        engine.train()
        losses: list[float] = []
        train_seconds = 0.0
        progress = tqdm(range(1, args.steps + 1), desc="train", disable=args.no_progress,
                        dynamic_ncols=True)
        for step in progress:
            tick = time.perf_counter()
            step_loss = 0.0
            for _ in range(accumulation):
                batch = to_device(sample_train_batch(train_tokens, batch_size, args.seq_len, generator), device)
                loss = engine(**batch).loss
                engine.backward(loss)
                engine.step()
                step_loss += loss.detach().item() / accumulation  # waits for the step's work
            train_seconds += time.perf_counter() - tick
            losses.append(step_loss)
            if step % args.eval_every == 0 or step == args.steps:
                engine.eval()
                eval_steps.append(step)
                eval_losses.append(evaluate(engine, eval_batches, device))
                engine.train()
            progress.set_postfix(loss=f"{step_loss:.3f}", eval=f"{eval_losses[-1]:.3f}",
                                 tok_s=f"{step * tokens_per_step / train_seconds:,.0f}",
                                 lr=f"{engine.get_lr()[0]:.1e}")
        progress.close()

        plot_path = args.output_dir / "loss_curve.png"
        plot_losses(plot_path, losses, eval_steps, eval_losses)
        model_dir = args.output_dir / "model"
        engine.module.save_pretrained(model_dir)  # state_dict reports the fp32 masters
        if tokenizer is not None:
            tokenizer.save_pretrained(model_dir)
    finally:
        engine.destroy()

    result = TrainResult(
        engine_type=type(engine), losses=losses, eval_steps=eval_steps, eval_losses=eval_losses,
        initial_eval_loss=eval_losses[0], final_eval_loss=eval_losses[-1],
        tokens_per_second=args.steps * tokens_per_step / train_seconds,
        plot_path=plot_path, model_dir=model_dir, device=device, eval_batches=eval_batches,
        seconds=time.perf_counter() - started,
    )
    tail = losses[-min(20, len(losses)):]
    print(f"done: {args.steps} steps in {result.seconds:.1f}s | final train loss "
          f"{sum(tail) / len(tail):.4f} (mean of last {len(tail)}) | eval loss "
          f"{result.initial_eval_loss:.4f} -> {result.final_eval_loss:.4f} | "
          f"{result.tokens_per_second:,.0f} tokens/s | saved {plot_path} and {model_dir}")
    return result


if __name__ == "__main__":
    main()
