"""One rank of a data-parallel run, launched from test_data_parallel.py (forked by ``forked_ranks.py``,
by ``torchrun``, the ``deepspeed`` launcher, or by hand).

Modes:
  parity  train ``--steps`` optimizer steps on this rank's half of each global batch
          (reference_batches) and save the final state_dict and grad norms; with
          ``--loss-chunk-tokens``/``--mlp-tile-tokens`` also how many chunks each loss and
          tiles each MLP call ran in; and this rank's place in its node (``node_size``,
          ``node_index``, ``leader``: in the node leaders' group).
  order   a model whose blocks sleep in backward: log when each gradient all-reduce
          starts and when backward returns.
  die     rank 1 kills itself in the middle of step 2; rank 0 reports what it sees.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny_models
from old_span_checkpoints import as_before_issue_44
from placement_check import engine_preflight, node_share, placement_disagreements, preflight_disagreements

from megatrain_ds import MegatrainEngine, parse_engine_config
from megatrain_ds.model import causal_lm_loss
from megatrain_ds.streaming.tiled_mlp import TiledTokenWise

# Imported by forked_ranks.py before it forks the ranks: what they build is loaded once, here.
tiny_models.load_eagerly("LlamaConfig", "LlamaForCausalLM")
tiny_models.load_engine_imports_eagerly()

LR, WEIGHT_DECAY, CLIPPING = 1e-3, 0.1, 0.05  # clipping active in every step of this model
MICRO, LENGTH = 2, 12


def global_batch(seed: int, rows: int, length: int = LENGTH) -> dict[str, torch.Tensor]:
    """``rows`` unpadded sequences: every rank's mean loss then weighs tokens equally."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, tiny_models.VOCAB, (rows, length), generator=generator)
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": input_ids.clone()}


def freeze_some(model: torch.nn.Module) -> list[str]:
    """Freeze (``requires_grad_(False)``) every block's MLP and the embedding, as a LoRA-style
    run freezes its base: frozen weights in the blocks and among the resident parameters.
    Returns their names."""
    frozen = [name for name, _ in model.named_parameters() if ".mlp." in name or "embed_tokens" in name]
    parameters = dict(model.named_parameters())
    for name in frozen:
        parameters[name].requires_grad_(False)
    return frozen


def freeze_all_but_later_input_norms(model: torch.nn.Module) -> list[str]:
    """Freeze every weight but the input norms of the blocks after the first and the final
    norm and head: a block's trained prefix is then one 64-element window, so with more than
    one rank some ranks' windows of it are empty while their windows of its frozen weights are
    not, and the first block has nothing trained at all (every rank's window of its trained
    prefix empty: its frozen weights alone, issue 44). Returns the frozen weights' names."""
    trained = ("input_layernorm", "model.norm", "lm_head")
    frozen = [
        name
        for name, _ in model.named_parameters()
        if not any(part in name for part in trained) or name.endswith("layers.0.input_layernorm.weight")
    ]
    parameters = dict(model.named_parameters())
    for name in frozen:
        parameters[name].requires_grad_(False)
    return frozen


BF16_FROZEN_STEPS = 2
"""Steps of ``--then-bf16-frozen-on-tier``'s run."""

FREEZERS = {"some": freeze_some, "all-but-later-input-norms": freeze_all_but_later_input_norms}
"""``--frozen``'s choices: which weights a run freezes."""


def config(accumulation: int, world_size: int, micro: int = MICRO, **megatrain: object) -> dict:
    return {
        "engine": "megatrain",
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accumulation,
        "train_batch_size": micro * accumulation * world_size,
        "gradient_clipping": CLIPPING,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}},
        "megatrain": megatrain,
    }


class _SleepInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        time.sleep(0.1)
        return grad


class SleepyBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SleepInBackward.apply(torch.tanh(self.linear(x)))


class SleepyModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(SleepyBlock() for _ in range(4))
        self.head = torch.nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x).square().mean()


def count_pieces(engine: MegatrainEngine) -> dict[str, list[int]]:
    """Record how many chunks each call of the chunked loss and how many tiles each call of
    a tiled MLP (forward, recompute, backward) runs in, from now on in this process."""
    assert engine.causal_loss is not None
    pieces: dict[str, list[int]] = {"loss_chunks": [], "mlp_tiles": []}
    chunked = causal_lm_loss.chunked_linear_cross_entropy

    def counted_loss(
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: object,
        targets: torch.Tensor,
        denominator: torch.Tensor,
        chunk_tokens: int,
        *rest: object,
    ) -> torch.Tensor:
        pieces["loss_chunks"].append(-(-hidden.shape[0] // chunk_tokens))
        return chunked(hidden, weight, bias, targets, denominator, chunk_tokens, *rest)

    tiles = TiledTokenWise.tiles

    def counted_tiles(self: TiledTokenWise, rows: int) -> list[tuple[int, int]]:
        result = tiles(self, rows)
        pieces["mlp_tiles"].append(len(result))
        return result

    causal_lm_loss.chunked_linear_cross_entropy = counted_loss
    TiledTokenWise.tiles = counted_tiles  # type: ignore[method-assign]
    return pieces


def count_collective_elements() -> dict[str, int]:
    """Count the elements (and, as ``<name>_bytes``, the bytes) this process passes to
    ``dist.reduce``, ``dist.broadcast`` and ``dist.all_gather`` (the engine's gradient
    reduce, weight gather after a step, and gathers of weights kept as windows; collectives
    used inside torch not counted). An all-gather counts the elements this process sends."""
    counted = {name: 0 for base in ("reduce", "broadcast", "all_gather") for name in (base, f"{base}_bytes")}
    for name in ("reduce", "broadcast", "all_gather"):
        collective = getattr(dist, name)

        def counting(*args: object, name: str = name, collective=collective, **kwargs: object):
            tensor = args[1] if name == "all_gather" else args[0]
            assert isinstance(tensor, torch.Tensor)
            counted[name] += tensor.numel()
            counted[f"{name}_bytes"] += tensor.numel() * tensor.element_size()
            return collective(*args, **kwargs)

        setattr(dist, name, counting)
    return counted


def _tier_report(engine: MegatrainEngine) -> dict:
    """This rank's NVMe tier: its blocks' sizes, swap-file and window bytes, and the bytes
    preflight plans for the node (its ranks' tiers together)."""
    tier = engine.nvme_tier
    assert tier is not None
    planned = engine_preflight(engine)
    return {
        "numels": tier.numels,
        "frozen_numels": [tier.frozen.numel(index) for index in range(len(tier.numels))],
        "disk": tier.directory.nbytes,
        "window": tier.window_bytes,
        "planned_disk": planned.disk,
        "planned_window": planned.host["nvme_window"],
    }


def run_parity(args: argparse.Namespace, rank: int, world_size: int, report: str = "rank") -> None:
    """Train and report to ``<out>/<report><rank>.pt``; with ``--then-frozen-on-tier`` then
    again in the same ranks (:func:`frozen_on_tier_args`), to ``frozen<rank>.pt``."""
    torch.manual_seed(rank)  # the ranks start differently: the engine must use the writer's weights
    collectives = count_collective_elements()
    model = tiny_models.llama(num_layers=4)
    if args.frozen:
        FREEZERS[args.frozen](model)
    long_context = {
        key: value
        for key, value in (("loss_chunk_tokens", args.loss_chunk_tokens), ("mlp_tile_tokens", args.mlp_tile_tokens))
        if value is not None
    }
    rows = args.rows or MICRO * world_size  # one micro-batch of every rank
    micro = rows // world_size
    tier = {"nvme_offload": "all" if args.nvme_weights else "optimizer", "nvme_path": args.nvme} if args.nvme else {}
    if args.nvme and args.nvme_io != "auto":
        tier["nvme_aio"] = {"engine": args.nvme_io}
    cast = {"frozen_weights": args.frozen_weights} if args.frozen_weights else {}
    settings = config(args.accumulation, world_size, micro, **long_context, **tier, **cast)
    if args.bf16:
        settings["bf16"] = {"enabled": True}
    engine = MegatrainEngine(model, parse_engine_config(settings))
    frozen_files = {"at_start": frozen_file_times(engine)}
    if args.bucket_elements:  # several buckets per block, each a few parameters out of layout order
        engine.blocks.gradient_bucket_elements = args.bucket_elements
    pieces: dict[str, list[int]] = {}
    if long_context:
        # The settings asked for are the ones in use (not "auto", not turned off).
        assert engine.causal_loss is not None and engine.causal_loss.chunk_tokens == args.loss_chunk_tokens
        assert engine.mlp_tile_tokens == args.mlp_tile_tokens
        pieces = count_pieces(engine)
    norms = []
    first = 0
    if args.resume_from:
        engine.load_checkpoint(args.resume_from)
        first = engine.global_steps
    for step in range(first, args.steps):
        if args.save_to and step == args.save_at:
            engine.save_checkpoint(args.save_to)
        for index in range(args.accumulation):
            batch = global_batch(step * args.accumulation + index, rows, args.length)
            mine = {key: value[rank * micro : (rank + 1) * micro] for key, value in batch.items()}
            engine.backward(engine(**mine).loss)
            engine.step()
        norms.append(engine.get_global_grad_norm())
    if args.save_to and args.save_at == args.steps:  # after the last step
        engine.save_checkpoint(args.save_to)
    state = {key: value.clone() for key, value in engine.module.state_dict().items()}
    held = _held_report(engine)
    held["collective_elements"] = dict(collectives)
    held["transfers"] = sum(engine.streamer.transfers.values())
    if engine.gathered_weights is not None:
        held["gathers"] = engine.gathered_weights.gathers
    held["frozen_files"] = {**frozen_files, "after_training": frozen_file_times(engine)}
    if args.load_after:  # a checkpoint loaded once the run is recorded (resharded into this node's spans)
        engine.load_checkpoint(args.load_after)
        held["loaded_states"] = flat_states(engine)
        # Copies: the live masters' views would change with the reload below.
        held["loaded_state_dict"] = {key: value.clone() for key, value in engine.module.state_dict().items()}
    if args.older_form_too:  # then that checkpoint as written before issue 44, over it
        held["older_form_loaded_state_dict"] = load_older_form(engine, args)
    if args.reload_saved:  # then the run's own checkpoint again, over what --load-after read
        engine.load_checkpoint(args.save_to)
        held["reloaded_state_dict"] = engine.module.state_dict()
    torch.save({"state_dict": state, "norms": norms, **pieces, **held}, Path(args.out) / f"{report}{rank}.pt")
    engine.destroy()
    if args.then_frozen_on_tier:
        run_parity(frozen_on_tier_args(args), rank, world_size, report="frozen")
    elif args.then_bf16_frozen_on_tier:  # after the frozen run (frozen_on_tier_args keeps the flag)
        run_parity(bf16_frozen_on_tier_args(args), rank, world_size, report="frozen_bf16")
    elif args.exact_frozen_levels:  # after the cast run: its fp32 frozen weights kept exact
        level, *rest = args.exact_frozen_levels
        run_parity(exact_frozen_args(args, level, rest), rank, world_size, report=f"frozen_exact_{level}")


def load_older_form(engine: MegatrainEngine, args: argparse.Namespace) -> dict[str, torch.Tensor]:
    """The run's checkpoint (``--save-to``'s latest) rewritten by rank 0 in the form written
    before every state was trained-only (``tests/old_span_checkpoints.py``: the fp32 frozen
    weights exact only in the span files' masters, bf16 in the model files) to
    ``<--save-to>_before_issue_44``, loaded by every rank; the state dict it gives."""
    dp = engine.data_parallel
    assert dp is not None
    saved = Path(args.save_to)
    older = saved.with_name(f"{saved.name}_before_issue_44")
    if dp.rank == 0:
        as_before_issue_44(saved / (saved / "latest").read_text().strip(), older, engine)
    dp.world_barrier("rewriting the checkpoint in the older form")  # Sync: every rank reads what rank 0 wrote
    engine.load_checkpoint(str(older))
    return {key: value.clone() for key, value in engine.module.state_dict().items()}


def bf16_frozen_on_tier_args(args: argparse.Namespace) -> argparse.Namespace:
    """A third run in the same ranks (no launch of its own), after the frozen one: the same
    weights frozen on the tier (``"all"``), bf16 compute with the fp32 frozen weights cast to
    it (``"frozen_weights": "compute_dtype"``: each rank's frozen windows in bf16 files), 2
    steps from the start, no checkpoint."""
    return argparse.Namespace(
        **{
            **vars(args),
            "bf16": True,
            "frozen_weights": "compute_dtype",
            "steps": BF16_FROZEN_STEPS,
            "save_to": None,
            "load_after": None,
            "reload_saved": False,
            "then_bf16_frozen_on_tier": False,
            "exact_frozen_levels": ("all", "optimizer"),
        }
    )


def exact_frozen_args(args: argparse.Namespace, level: str, rest: list[str]) -> argparse.Namespace:
    """After the cast run (no launch of their own): the same run with the fp32 frozen
    weights kept exact (``"frozen_weights": "exact"``) beside the fp32 master these nodes
    cut, with the NVMe tier holding ``level`` (``"all"``: each rank's window of them in fp32
    files, rounded as read; ``"optimizer"``: apart, whole, in each node's host memory), its
    checkpoint saved after the last step and loaded back, then in its older form
    (:func:`load_older_form`); then the ``rest`` of the levels."""
    checkpoint = str(Path(args.out) / f"frozen_exact_{level}_checkpoint")
    return argparse.Namespace(
        **{
            **vars(args),
            "frozen_weights": None,
            "nvme_weights": level == "all",
            "save_to": checkpoint,
            "save_at": args.steps,
            "load_after": checkpoint,
            "older_form_too": True,
            "exact_frozen_levels": tuple(rest),
        }
    )


def frozen_on_tier_args(args: argparse.Namespace) -> argparse.Namespace:
    """A second run in the same ranks (no launch of its own): the weights ``--then-frozen-on-tier``
    names frozen (``FREEZERS``), the weights on the NVMe tier (``"all"``), fp32, from the
    start, its checkpoint saved after the last step; after the report the first run's
    ``--load-after`` checkpoint is loaded (other weights, frozen ones too), where it has one,
    then its own checkpoint again."""
    checkpoint = str(Path(args.out) / "frozen_checkpoint")
    return argparse.Namespace(
        **{
            **vars(args),
            "frozen": args.then_frozen_on_tier,
            "nvme": args.nvme or str(Path(args.out) / "frozen_swap"),
            "nvme_weights": True,
            "bf16": False,
            "resume_from": None,
            "save_to": checkpoint,
            "save_at": args.steps,
            "load_after": args.load_after or checkpoint,
            "reload_saved": bool(args.load_after),
            "then_frozen_on_tier": None,
        }
    )


def frozen_file_times(engine: MegatrainEngine) -> dict[str, int]:
    """The modification time of each of this rank's frozen weights' files on its NVMe tier
    (``state/frozen_files.py``), by file name; empty without any."""
    tier = engine.nvme_tier
    if tier is None:
        return {}
    return {name: os.stat(path).st_mtime_ns for name, path in tier.directory.files.items() if name.endswith(".frozen")}


def _held_report(engine: MegatrainEngine) -> dict:
    """This rank's place in its node, what its node holds (node-shared: one copy per node)
    and what the whole state would take, its NVMe tier, and its flat states."""
    dp = engine.data_parallel
    held: dict = {}
    if dp is not None:
        held = {"node_size": dp.node_size, "node_index": dp.node_index, "leader": dp.leaders_group is not None}
    held.update(host_bytes=engine.host_bytes(), numels=[flat.layout.numel for flat in engine.states])
    held["stream_checked"] = engine.runtime.checker is not None  # MEGATRAIN_STREAM_CHECK reached the rank
    held["trained_numels"] = [flat.layout.trained_numel for flat in engine.states]
    held["frozen_in"] = [flat.placement.frozen_in for flat in engine.states]
    held["frozen_dtypes"] = sorted({str(flat.frozen.dtype) for flat in engine.states if flat.frozen is not None})
    # This rank's buffers against its placement (tests/test_placement.py: one process's combinations),
    # and against preflight's estimate where every host buffer is its node's.
    held["placement_disagreements"] = placement_disagreements(engine)
    # And against preflight's estimate, where this rank is its node (preflight counts the node);
    # else this rank's share of the node, which the test adds up with its node's other ranks'.
    alone = dp is None or dp.node_size == 1
    held["preflight_disagreements"] = preflight_disagreements(engine) if alone else []
    held["node_share"] = None if alone else node_share(engine)
    held["tier"] = None
    if engine.nvme_tier is not None:
        held["tier"] = _tier_report(engine)
    # With bf16 compute: the streamed copy is the master rounded, every span of it (received ones
    # too; where the master is sharded, in the span it holds).
    held["shadows_match"] = all(
        torch.equal(flat.shadow[slice(*flat.master_held)], flat.master.to(flat.shadow.dtype))
        for flat in engine.states
        if flat.shadow is not None
    )
    held["flat_states"] = flat_states(engine)
    return held


def flat_states(engine: MegatrainEngine) -> list[dict[str, object]]:
    """Copies of what this node holds of every flat state, with the elements each covers."""
    return [
        {
            "held": flat.held,
            "master_held": flat.master_held,
            "master": flat.master.clone() if not flat.master.is_meta else None,  # meta: on the NVMe tier
            "shadow": flat.shadow.clone() if flat.shadow is not None else None,
            "exp_avg": flat.exp_avg.clone() if not flat.exp_avg.is_meta else None,
        }
        for flat in engine.states
    ]


def run_fp16(args: argparse.Namespace, rank: int, world_size: int) -> None:
    """Dynamic loss scaling; at step ``--poison-at`` only rank 1's loss is made infinite:
    every rank must skip that step and lower the scale (the overflow agreed on)."""
    torch.manual_seed(0)
    fp16 = {"enabled": True, "initial_scale_power": 15, "hysteresis": 1}
    engine = MegatrainEngine(
        tiny_models.llama(num_layers=4), parse_engine_config({**config(1, world_size), "fp16": fp16})
    )
    skipped, scales = [], []
    for step in range(args.steps):
        batch = global_batch(step, MICRO * world_size)
        loss = engine(**{key: value[rank * MICRO : (rank + 1) * MICRO] for key, value in batch.items()}).loss
        if step == args.poison_at and rank == 1:
            loss = loss * float("inf")
        engine.backward(loss)
        engine.step()
        skipped.append(not engine.was_step_applied())
        scales.append(engine.optimizer.loss_scale)
    state = {key: value.clone() for key, value in engine.module.state_dict().items()}
    torch.save({"state_dict": state, "skipped": skipped, "scales": scales}, Path(args.out) / f"rank{rank}.pt")
    engine.destroy()


def run_order(args: argparse.Namespace, rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    engine = MegatrainEngine(SleepyModel(), parse_engine_config(config(1, world_size)))
    starts: list[tuple[int, float]] = []
    engine.sink.on_reduce = lambda index: starts.append((index, time.perf_counter()))
    x = torch.randn(MICRO, 16)
    loss = engine(x)
    backward_start = time.perf_counter()
    engine.backward(loss)
    backward_end = time.perf_counter()
    engine.step()
    Path(args.out, f"order{rank}.json").write_text(
        json.dumps({"starts": starts, "backward_start": backward_start, "backward_end": backward_end})
    )
    engine.destroy()


def run_die(args: argparse.Namespace, rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    engine = MegatrainEngine(
        tiny_models.llama(num_layers=4), parse_engine_config(config(1, world_size, collective_timeout_s=args.timeout))
    )
    for step in range(4):
        if args.save_to and step == 1:
            engine.save_checkpoint(args.save_to)
        batch = global_batch(step, MICRO)
        loss = engine(**batch).loss
        if step == 2 and rank == 1:
            Path(args.out, "killed").write_text(str(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        engine.backward(loss)
        engine.step()
    print("rank", rank, "finished every step", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["parity", "order", "die", "fp16"])
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--length", type=int, default=LENGTH, help="parity: tokens per sequence")
    parser.add_argument("--bf16", action="store_true", help="parity: bf16 compute, fp32 masters")
    parser.add_argument(
        "--frozen", nargs="?", const="some", choices=FREEZERS, help="parity: freeze these weights (FREEZERS)"
    )
    parser.add_argument("--bucket-elements", type=int, help="parity: the blocks' gradient bucket size")
    parser.add_argument("--nvme", help="parity: Adam's moments on the NVMe tier, its swap files under this path")
    parser.add_argument("--nvme-weights", action="store_true", help='parity: with --nvme, "nvme_offload": "all"')
    parser.add_argument(
        "--nvme-io",
        choices=("auto", "aio", "threads"),
        default="auto",
        help='parity: with --nvme, "nvme_aio": {"engine": ...} (threads: a fresh rank does not load the aio op)',
    )
    parser.add_argument("--rows", type=int, help="parity: rows of a global micro-batch (default: MICRO per rank)")
    parser.add_argument("--loss-chunk-tokens", type=int, help="parity: megatrain.loss_chunk_tokens")
    parser.add_argument("--mlp-tile-tokens", type=int, help="parity: megatrain.mlp_tile_tokens")
    parser.add_argument(
        "--save-to", help="parity: save a checkpoint here before step --save-at (--steps: after the last)"
    )
    parser.add_argument("--save-at", type=int, default=3)
    parser.add_argument("--poison-at", type=int, default=4, help="fp16: the step whose loss rank 1 makes infinite")
    parser.add_argument("--resume-from", help="parity: load the latest checkpoint from here first")
    parser.add_argument("--load-after", help="parity: load this checkpoint after the run, report the state")
    parser.add_argument(
        "--reload-saved", action="store_true", help="parity: after --load-after, load --save-to's checkpoint again"
    )
    parser.add_argument(
        "--then-frozen-on-tier",
        nargs="?",
        const="some",
        choices=FREEZERS,
        help="parity: then a second run in the same ranks, these weights frozen on the tier (frozen_on_tier_args)",
    )
    parser.add_argument(
        "--then-bf16-frozen-on-tier",
        action="store_true",
        help="parity: after --then-frozen-on-tier's run, a third: bf16, frozen weights cast (bf16_frozen_on_tier_args)",
    )
    parser.add_argument("--frozen-weights", choices=["exact", "compute_dtype"], help="parity: megatrain.frozen_weights")
    parser.set_defaults(exact_frozen_levels=())  # set by bf16_frozen_on_tier_args: the runs after it
    parser.set_defaults(older_form_too=False)  # set by exact_frozen_args: load_older_form after --load-after
    parser.add_argument(
        "--one-rank-per-node",
        action="store_true",
        help="treat every rank as a node of its own (multi-node code path on one host)",
    )
    args, _ = parser.parse_known_args()  # the deepspeed launcher adds --local_rank=N
    torch.set_num_threads(1)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.one_rank_per_node:
        # What a launcher of one rank per node would say (the engine reads it at start).
        os.environ.update(GROUP_RANK=str(rank), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    {"parity": run_parity, "order": run_order, "die": run_die, "fp16": run_fp16}[args.mode](args, rank, world_size)


if __name__ == "__main__":
    main()
