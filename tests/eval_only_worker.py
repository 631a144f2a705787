"""One rank of test_evaluation_only.py's data-parallel launches: engines built without an optimizer.

For each ``--placements`` in turn (one process, one engine after the other): build the
engine as the HF Trainer's ``evaluate()`` before ``train()`` builds it,
``deepspeed.initialize(model=..., config=...)`` with no optimizer, no ``"optimizer"`` block
and no ``model_parameters`` (optimizer/facade.py: [Note: evaluation-only engines]); the
ranks start from different seeds (the engine keeps the first node's weights, as it does
for training). Then, on every rank, in this order: evaluate this rank's rows of two global
batches (``eval()``, ``no_grad``, as the Trainer's ``prediction_step``), check its buffers
against its placement, and call the entry points that take the weights:
``engine.module.state_dict()``, the engine's ``state_dict()``,
``_zero3_consolidated_16bit_state_dict()`` and ``save_16bit_model`` (collectives where the
weights are on the tier: a rank that skipped one would leave the other waiting, which
``collective_timeout_s`` turns into a failure). A rank that is its node (``launch_nodes``)
also checks preflight's estimate for it. Each rank writes
``<out>/<placement>.rank<R>.pt``. The last placement's engine is not destroyed: the
process's exit handlers close it, as they close the engine of a script that simply returns.

Placements: ``ram`` (host memory), ``optimizer`` (``"nvme_offload": "optimizer"``: nothing
to put there without an optimizer), ``all`` (``"nvme_offload": "all"``: each rank's windows
of the weights on its own NVMe tier, gathered when used); ``-bf16`` and ``-fp16`` suffixes:
that placement with bf16 or fp16 compute.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from data_parallel_worker import MICRO, config, global_batch
from placement_check import node_share, placement_disagreements, preflight_disagreements
from tiny_models import llama

from megatrain_ds import MegatrainEngine

EVAL_SEEDS = (0, 1)
"""The global batches every placement evaluates (``global_batch(seed, MICRO * world_size)``)."""

PRECISIONS = {"": {}, "bf16": {"bf16": {"enabled": True}}, "fp16": {"fp16": {"enabled": True}}}
"""A placement's suffix: the config's precision block."""

PLACEMENTS = tuple(f"{level}-{suffix}".rstrip("-") for suffix in PRECISIONS for level in ("ram", "optimizer", "all"))


def evaluation_config(placement: str, world_size: int, out: Path, timeout: float) -> dict:
    """The data-parallel worker's config for ``placement`` without its ``"optimizer"`` block:
    what transformers' ``deepspeed_init(inference=True)`` leaves of a training config."""
    level, _, precision = placement.partition("-")
    tier = {}
    if level != "ram":  # the thread pool: the alignment preflight plans with, on any machine
        tier = {"nvme_offload": level, "nvme_path": str(out / "swap"), "nvme_aio": {"engine": "threads"}}
    settings = config(1, world_size, collective_timeout_s=timeout, **tier)
    del settings["optimizer"]
    return {**settings, **PRECISIONS[precision]}


def own_node_disagreements(engine: MegatrainEngine) -> list[str]:
    """Preflight's estimate against this rank's allocations where the rank is its node
    (preflight counts the node; a node of several ranks is the test's to add up)."""
    return preflight_disagreements(engine) if engine.data_parallel.node_size == 1 else []


def run_placement(args: argparse.Namespace, placement: str, rank: int, world_size: int) -> None:
    import deepspeed

    out = Path(args.out)
    torch.manual_seed(rank)  # the ranks start differently: the engine keeps the first node's weights
    settings = evaluation_config(placement, world_size, out, args.timeout)
    engine, optimizer, _, scheduler = deepspeed.initialize(model=llama(num_layers=4), config=settings)
    engine.eval()
    losses = []
    for seed in EVAL_SEEDS:
        batch = global_batch(seed, MICRO * world_size)
        mine = {key: value[rank * MICRO : (rank + 1) * MICRO] for key, value in batch.items()}
        with torch.no_grad():
            losses.append(engine(**mine).loss.float())
    where = out / placement
    answers = {"module.state_dict": {k: v.clone() for k, v in engine.module.state_dict().items()}}
    answers["engine.state_dict"] = {k.removeprefix("module."): v.clone() for k, v in engine.state_dict().items()}
    answers["_zero3_consolidated_16bit_state_dict"] = engine._zero3_consolidated_16bit_state_dict()
    engine.save_16bit_model(where, "model.bin")
    if rank == 0:  # written by the first rank once every rank has joined
        answers["save_16bit_model"] = torch.load(where / "model.bin", weights_only=True)
    report = {
        "returned": (optimizer, scheduler),
        "losses": losses,
        "answers": answers,
        "host_bytes": engine.host_bytes(),
        "nvme": engine.placement.nvme,
        "tier": engine.nvme_tier is not None,
        "collective": engine.state_dict_is_collective,
        "disagreements": placement_disagreements(engine) + own_node_disagreements(engine),
        "node_share": node_share(engine) if engine.data_parallel.node_size > 1 else None,  # added up by the test
    }
    torch.save(report, out / f"{placement}.rank{rank}.pt")
    if placement != args.placements[-1]:
        engine.destroy()
    # else left to the engine's exit handler, as the Trainer leaves its engines: the test
    # checks that it removed the swap directory ("all" on the tier).


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["evaluate"])  # the launch helpers name a mode first
    parser.add_argument("--out", required=True)
    parser.add_argument("--placements", nargs="+", choices=PLACEMENTS, required=True)
    parser.add_argument("--timeout", type=float, default=60.0, help="megatrain.collective_timeout_s")
    args, _ = parser.parse_known_args()
    torch.set_num_threads(1)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    for placement in args.placements:
        run_placement(args, placement, rank, world_size)


if __name__ == "__main__":
    main()
