"""A short run of every synchronised path of the engine under the race checker.

Run as a script (``tests/test_stream_ordering.py`` does, once per mutant of the package):
it sets ``MEGATRAIN_STREAM_CHECK=1`` (in :func:`main`) and trains a tiny Llama through

- ``host``: the host optimizer, clipping (speculative updates and their validation),
  gradient accumulation 2, activation checkpoints offloaded, then a checkpoint saved and
  loaded back and one more step;
- ``no-clipping``: the worker updating each block while backward runs;
- ``device-optimizer``: ``"optimizer_device": "gpu"`` (state streamed through the device
  on the optimizer stream, written back on the d2h stream), with clipping (updates from
  the held gradients) and without (updates straight from the sink's staging buffers);
- ``stash``: ``"recompute": 1``, the first two blocks' saved activations stashed on the
  host (copied device-to-host after their forward, brought back for their backward);
- ``wide``: two blocks per checkpoint segment, three weight buffers, stashed blocks;
- ``user-checkpointing`` (and ``-stash``, with stashed blocks): a model that wraps each
  block in ``torch.utils.checkpoint`` (a no-op inside streamed blocks that changes when
  backward drops what it read);
- ``fragments``: ``"fragment_bytes"``, each block's weights copied in pieces, each module
  of a recomputed block waiting for its own, a stashed block's backward for all of them;
- ``device-state``: ``"device_state": 0.5``, the resident state and the first block kept on
  the device (``optimizer/device_states.py``), with clipping, accumulation 2 and a checkpoint;
- ``forward-ahead``: two forwards, then their backwards with an optimizer step between: the
  second backward's gradients land while the step's update runs behind it, its loss from
  a forward that waited for none of it (``engine.backward``'s settle orders them); then
  ``step()`` twice in a row (its settle's refresh of the resident copy, device work no
  gradient follows: ``_before_update``'s wait for the device orders it); then a
  forward between a backward and its ``step()`` (the same wait orders its reads);
- ``nvme``: the NVMe tier (``state/nvme_tier.py``) with a two-block window: Adam m and v
  read ahead and written behind by its I/O threads, clipping, accumulation 2, then a
  checkpoint saved from and loaded into the swap files and one more step.
- ``nvme-all``: the same with the blocks' weights on the tier too (``state/nvme_weights.py``),
  five blocks: forward and backward read them from the swap files through a three-buffer
  weight window.

Exit status: 0 when every step ran without a race, ``RACE_EXIT`` (printing the race)
when the checker raised ``StreamRaceError``, anything else for other failures.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("TRITON_INTERPRET", "1")  # the device optimizer's kernel on CPU tensors

import torch
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny_models
from side_by_side import ds_config

from megatrain_ds import MegatrainEngine, parse_engine_config
from megatrain_ds.runtime.stream_check import StreamRaceError

RACE_EXIT = 3
SCENARIOS = {
    "host": dict(accumulation=2, clipping=1.0, megatrain={"optimizer_device": "cpu", "offload_checkpoints": True}),
    "no-clipping": dict(accumulation=1, clipping=0.0, megatrain={"optimizer_device": "cpu"}),
    "device-optimizer": dict(accumulation=1, clipping=1.0, megatrain={"optimizer_device": "gpu"}),
    "device-optimizer-no-clipping": dict(
        accumulation=1, clipping=0.0, megatrain={"optimizer_device": "gpu", "num_staging_buffers": 2}
    ),
    # Checkpoints kept on the device: their offload would order h2d after d2h for the stash.
    "stash": dict(
        accumulation=2,
        clipping=1.0,
        megatrain={"optimizer_device": "cpu", "recompute": 1, "offload_checkpoints": False},
    ),
    "wide": dict(
        accumulation=2,
        clipping=1.0,
        megatrain={"optimizer_device": "cpu", "checkpoint_interval": 2, "num_buffers": 3, "recompute": 1},
    ),
    # The model wraps its blocks in torch.utils.checkpoint itself (a no-op inside streamed
    # blocks): the engine's backward then drops brought-back tensors earlier in its schedule.
    "user-checkpointing": dict(
        accumulation=1, clipping=1.0, megatrain={"optimizer_device": "cpu", "offload_checkpoints": True}
    ),
    "user-checkpointing-stash": dict(
        accumulation=1, clipping=1.0, megatrain={"optimizer_device": "cpu", "recompute": 1}
    ),
    "fragments": dict(
        accumulation=1, clipping=1.0, megatrain={"optimizer_device": "cpu", "fragment_bytes": 4096, "recompute": 1}
    ),
    # The GPU tier: the resident state and the first block on the device (updated there on the
    # optimizer stream, their gradients added on the device), the rest on the host.
    "device-state": dict(accumulation=2, clipping=1.0, megatrain={"optimizer_device": "cpu", "device_state": 0.5}),
    # The host optimizer's update pipelined behind step() (clipping), one micro-batch a step.
    "forward-ahead": dict(accumulation=1, clipping=1.0, megatrain={"optimizer_device": "cpu"}),
    # nvme_path: a temporary directory, set by run().
    "nvme": dict(
        accumulation=2,
        clipping=1.0,
        megatrain={"optimizer_device": "cpu", "nvme_offload": "optimizer", "nvme_window_blocks": 2},
    ),
    "nvme-all": dict(
        accumulation=2,
        clipping=1.0,
        megatrain={"optimizer_device": "cpu", "nvme_offload": "all", "nvme_window_blocks": 2},
    ),
}
WITH_CHECKPOINT = ("host", "nvme", "nvme-all", "device-state")
LAYERS = {"nvme-all": 5}
"""Blocks of the scenarios' Llama where three would not do: five blocks through a
three-buffer weight window reuse buffers within a pass, and blocks leave the tier's
window while their write is still in flight."""
NVME_SCENARIOS = ("nvme", "nvme-all")
"""The scenarios of the NVMe tier, whose handoffs only its own I/O threads and windows use."""
SETTLE_SCENARIOS = ("host", "forward-ahead")
"""What ``engine.settle_optimizer()``'s mutants run: its callers wait for the update behind
``step()``, the same in every scenario that pipelines it (the others vary the streaming,
which it does not touch); ``host`` saves and loads a checkpoint behind it, ``forward-ahead``
lands gradients behind it."""
DEVICE_STATE_SCENARIOS = ("device-state",)
"""The GPU tier's scenario: its mutants (``optimizer/device_states.py``) run it alone, the
others the rest (the paths it shares with them, the sink and the streamer, run there)."""


class UserCheckpointed(torch.nn.Module):
    """Three residual MLP blocks, each called through ``torch.utils.checkpoint``."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(tiny_models.VOCAB, 16)
        self.layers = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 16)) for _ in range(3)
        )
        self.head = torch.nn.Linear(16, tiny_models.VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> SimpleNamespace:
        hidden = self.embed(input_ids)
        for layer in self.layers:
            hidden = hidden + checkpoint(layer, hidden, use_reentrant=False)
        logits = self.head(hidden)
        return SimpleNamespace(loss=torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()))


def batch(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, tiny_models.VOCAB, (2, 12), generator=generator)
    return {"input_ids": input_ids, "labels": input_ids.clone()}


def train(engine: MegatrainEngine, steps: int, first_seed: int) -> None:
    for micro in range(steps * engine.gradient_accumulation_steps()):
        loss = engine(**batch(first_seed + micro)).loss
        engine.backward(loss)
        engine.step()


def forward_ahead(engine: MegatrainEngine) -> None:
    """Two losses, then a step between their backwards: the second backward's gradients land
    in the held gradients the update behind that step() reads, its forward having waited for
    none of it. (Plain PyTorch refuses this order, its step having changed weights the graph
    saved in place; the engine's blocks recompute, so it runs.) At the end a state dict
    between a step's last backward and step(), after a forward there."""
    ahead, behind = engine(**batch(0)).loss, engine(**batch(1)).loss
    engine.backward(ahead)
    engine.step()
    assert engine.pipelined_finish is not None and engine.pipelined_finish.in_flight, "no update behind step()"
    engine.backward(behind)
    engine.step()
    # step() again with no backward: its settle refreshes the resident copy on the compute
    # stream while the update it starts writes the host weights.
    engine.step()
    engine.backward(engine(**batch(2)).loss)
    # A forward after the step's backward, before step(): the update must wait for its reads,
    # and the blocks it copied ahead for its backward (which never comes) are the old weights.
    engine(**batch(3))
    engine.step()
    engine.backward(engine(**batch(4)).loss)
    engine.step()
    # A zero loss: an unclipped step, after which the predictor speculates again. That step's
    # worker updates the journaled ranges during backward; a forward after it, then a state
    # dict before step(), which undoes the speculative updates -- after that forward's weight
    # copies, which read the host weights the undoing writes.
    engine.backward(engine(**batch(5)).loss * 0)
    engine.step()
    engine.backward(engine(**batch(6)).loss)
    engine(**batch(7))
    engine.state_dict()
    engine.step()


FLOWS = {"forward-ahead": forward_ahead}
"""Scenarios that train their own way (the others: :func:`train`, then :data:`WITH_CHECKPOINT`'s)."""


def run(name: str) -> None:
    with tempfile.TemporaryDirectory() as swap:
        spec = SCENARIOS[name]
        if "nvme_offload" in spec["megatrain"]:
            spec = {**spec, "megatrain": {**spec["megatrain"], "nvme_path": swap}}
        torch.manual_seed(0)
        model = (
            UserCheckpointed()
            if name.startswith("user-checkpointing")
            else tiny_models.llama(num_layers=LAYERS.get(name, 3))
        )
        engine = MegatrainEngine(model, parse_engine_config(ds_config(**spec)), device=torch.device("cpu"))
        try:
            assert engine.runtime.checker is not None, "the race checker is not on"
            if name in FLOWS:
                FLOWS[name](engine)
            else:
                train(engine, steps=2, first_seed=0)
            if name in WITH_CHECKPOINT:
                with tempfile.TemporaryDirectory() as directory:
                    engine.save_checkpoint(directory, tag="step2")
                    train(engine, steps=1, first_seed=100)
                    engine.load_checkpoint(directory, tag="step2")
                train(engine, steps=1, first_seed=100)
            print(f"{name}: {engine.runtime.checker.num_accesses} accesses checked, no race")
        finally:
            engine.destroy()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "scenarios", nargs="*", metavar="SCENARIO", help=f"any of {', '.join(SCENARIOS)} (default: all)"
    )
    args = parser.parse_args()
    unknown = set(args.scenarios) - set(SCENARIOS)
    if unknown:
        parser.error(f"unknown scenario(s) {sorted(unknown)}; choose from {list(SCENARIOS)}")
    torch.set_num_threads(1)
    # Set here, not at import: tests import RACE_EXIT, and the rest of their session must
    # not run under the checker. Runtimes read it when they are created.
    os.environ["MEGATRAIN_STREAM_CHECK"] = "1"
    try:
        for name in args.scenarios or SCENARIOS:
            run(name)
    except StreamRaceError as race:
        print(race)
        return RACE_EXIT
    return 0


if __name__ == "__main__":
    sys.exit(main())
