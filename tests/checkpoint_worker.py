"""The subprocess side of the checkpoint tests (``test_checkpoint.py``).

python checkpoint_worker.py resume DIR STEPS OUT THREADS   load DIR's latest into a fresh engine
                                                           (another initialisation), train STEPS,
                                                           write losses and host state to OUT
python checkpoint_worker.py save-loop DIR THREADS          train, save tag "base", print READY,
                                                           then save the same state over and over
                                                           until killed
"""

from __future__ import annotations

import sys

import tiny_models
import torch
from side_by_side import ds_config

from megatrain_ds import MegatrainEngine, parse_engine_config

ACCUMULATION = 2
CLIENT_STATE = {"epoch": 2, "ids": [1, 2], "pair": (3, 0.5), "by_id": {7: "x", "$odd": None}, "t": torch.arange(3)}
"""Saved with the engine by the ``saved`` fixture (``conftest.py``): values JSON cannot hold as they are."""


def build(seed: int, device: torch.device | None = None, megatrain: dict | None = None) -> MegatrainEngine:
    """GPT-2 (dropout on: resuming exactly needs the RNG state), accumulation 2, clipping,
    and a warm-up scheduler, with ``megatrain`` as the engine's options; on the CPU unless
    told (bitwise comparisons need one device)."""
    torch.manual_seed(seed)
    engine = MegatrainEngine(
        tiny_models.gpt2(),
        parse_engine_config(ds_config(accumulation=ACCUMULATION, megatrain=megatrain)),
        device=device if device is not None else torch.device("cpu"),
    )
    engine.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lambda step: min(1.0, (step + 1) / 4))
    engine.train()
    return engine


def train(engine: MegatrainEngine, steps: int) -> list[float]:
    """``steps`` optimizer steps; the batch of each micro-step is chosen by the engine's own
    counter, so a resumed run sees the batches the uninterrupted one saw."""
    losses = []
    for _ in range(steps * ACCUMULATION):
        batch = {k: v.to(engine.runtime.device) for k, v in tiny_models.make_batch(engine.micro_steps).items()}
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def host_state(engine: MegatrainEngine) -> dict[str, torch.Tensor]:
    engine.settle_optimizer()  # the host state is read directly
    state = {}
    for index, flat in enumerate(engine.states):
        state[f"{index}.master"] = flat.master.clone()
        state[f"{index}.exp_avg"] = flat.exp_avg.clone()
        state[f"{index}.exp_avg_sq"] = flat.exp_avg_sq.clone()
    return state


def main(argv: list[str]) -> None:
    mode = argv[0]
    if mode == "resume":
        directory, steps, out, threads = argv[1], int(argv[2]), argv[3], int(argv[4])
        torch.set_num_threads(threads)
        engine = build(seed=1)
        engine.load_checkpoint(directory)
        losses = train(engine, steps)
        torch.save(
            {
                "losses": losses,
                "state": host_state(engine),
                "lr": engine.get_lr(),
                "counters": (engine.global_steps, engine.micro_steps, engine.optimizer_steps),
            },
            out,
        )
        engine.destroy()
    elif mode == "save-loop":
        directory, threads = argv[1], int(argv[2])
        torch.set_num_threads(threads)
        engine = build(seed=0)
        train(engine, 2)
        engine.save_checkpoint(directory, tag="base")
        print("READY", flush=True)
        number = 0
        while True:
            number += 1
            engine.save_checkpoint(directory, tag=f"loop{number % 3}")
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
