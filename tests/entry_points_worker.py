"""One rank of test_state_dict_collectives.py: every entry point that takes the weights, on every rank.

For each ``--placements`` in turn (one process, one engine after the other, as a user's
script would build them): train ``--steps`` optimizer steps through ``deepspeed.initialize``
(the ranks start from different seeds: the engine keeps the first node's weights), then
call, on every rank, in this order: ``engine.module.state_dict()``, the engine's
``state_dict()``, ``_zero3_consolidated_16bit_state_dict()`` (what Accelerate's
``get_state_dict`` calls on every rank under a ZeRO-3 config, and the HF Trainer's
``save_model`` through it), ``save_16bit_model``, ``save_pretrained`` (``is_main_process``
on rank 0 only, as Accelerate's ``save_model`` calls it), ``save_checkpoint`` and
``load_checkpoint`` of it, then ``state_dict()`` again. A collective one rank skipped, or
took in another order, would leave the others waiting: ``collective_timeout_s`` turns that
into a failure. Each rank writes ``<out>/<placement>.rank<R>.pt``: what each entry point
returned and the masters as the rank holds them (``flat_states``: its node's span where
several nodes shard them).

Placements: ``ram`` (host memory; with bf16 on several nodes the fp32 master sharded across
them), ``optimizer`` (``"nvme_offload": "optimizer"``: the fp32 masters and moments on
the NVMe tier, the compute copies in host memory), ``all`` (``"nvme_offload": "all"``:
each rank's windows of the weights on its own NVMe tier, gathered when used); with
``-bf16`` (``ram-bf16``, ...), that placement with bf16 compute.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import safetensors.torch
from data_parallel_worker import MICRO, config, global_batch
from placement_check import node_share, placement_disagreements, preflight_disagreements
from tiny_models import llama

STEPS = 2


def _masters_held(engine) -> list[dict[str, object]]:
    """What this process holds of every state's master, read directly (not through the
    state dict): the elements it holds (``master_held``), their values (``None`` where the
    tier holds them) and where each parameter lies in the state (``slots``: its state-dict
    name, offset, shape)."""
    engine.settle_optimizer()  # the host state is read directly
    num_blocks = len(engine.states) - 1  # the resident state comes last
    held = []
    for index, flat in enumerate(engine.states):
        prefix = f"{engine.block_path}.{index}." if index < num_blocks else ""
        slots = [(prefix + slot.name, slot.offset, tuple(slot.shape)) for slot in flat.layout.slots]
        master = None if flat.master.is_meta else flat.master.clone()
        held.append({"master_held": flat.master_held, "master": master, "slots": slots})
    return held


def run_placement(args: argparse.Namespace, placement: str, rank: int, world_size: int) -> None:
    import deepspeed

    torch.manual_seed(rank)  # the ranks start differently: the engine keeps the first node's weights
    level, _, precision = placement.partition("-")
    tier = {"nvme_offload": level, "nvme_path": str(Path(args.out) / "swap")} if level != "ram" else {}
    settings = config(1, world_size, collective_timeout_s=args.timeout, **tier)
    if precision == "bf16":
        settings["bf16"] = {"enabled": True}
    engine, *_ = deepspeed.initialize(model=llama(num_layers=4), config=settings)
    for step in range(args.steps):
        batch = global_batch(step, MICRO * world_size)
        mine = {key: value[rank * MICRO : (rank + 1) * MICRO] for key, value in batch.items()}
        engine.backward(engine(**mine).loss)
        engine.step()
    masters = _masters_held(engine)  # as trained, before any entry point runs
    # This rank's buffers against its placement and preflight (tests/test_placement.py: one process's).
    agreement = placement_disagreements(engine)
    share = None  # where the node has several ranks, the test adds up their shares for preflight
    if engine.data_parallel is None or engine.data_parallel.node_size == 1:  # preflight counts the node
        agreement += preflight_disagreements(engine)
    else:
        share = node_share(engine)
    out = Path(args.out) / placement
    answers = {"module.state_dict": {k: v.clone() for k, v in engine.module.state_dict().items()}}
    answers["engine.state_dict"] = {k.removeprefix("module."): v.clone() for k, v in engine.state_dict().items()}
    answers["_zero3_consolidated_16bit_state_dict"] = engine._zero3_consolidated_16bit_state_dict()
    engine.save_16bit_model(out, "model.bin")
    engine.module.save_pretrained(out / "pretrained", is_main_process=rank == 0)
    engine.save_checkpoint(str(out / "checkpoint"))
    engine.load_checkpoint(str(out / "checkpoint"))
    answers["state_dict after load_checkpoint"] = {k: v.clone() for k, v in engine.module.state_dict().items()}
    if rank == 0:  # the files, written by the first rank once every rank has joined
        answers["save_16bit_model"] = torch.load(out / "model.bin", weights_only=True)
        answers["save_pretrained"] = safetensors.torch.load_file(out / "pretrained" / "model.safetensors")
    report = {
        "answers": answers,
        "masters": masters,
        "collective": engine.state_dict_is_collective,
        "disagreements": agreement,
        "node_share": share,
    }
    torch.save(report, Path(args.out) / f"{placement}.rank{rank}.pt")
    engine.destroy()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["entry-points"])  # the launch helpers name a mode first
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "--placements",
        nargs="+",
        choices=[f"{level}{suffix}" for suffix in ("", "-bf16") for level in ("ram", "optimizer", "all")],
        required=True,
    )
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--timeout", type=float, default=60.0, help="megatrain.collective_timeout_s")
    args, _ = parser.parse_known_args()
    torch.set_num_threads(1)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    for placement in args.placements:
        run_placement(args, placement, rank, world_size)


if __name__ == "__main__":
    main()
