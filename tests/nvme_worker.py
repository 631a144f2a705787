"""The subprocess side of the NVMe tier's crash test (``test_nvme_checkpoint.py``).

python nvme_worker.py crash NVME_DIR CKPT_DIR THREADS   train 2 steps, save, then die by SIGKILL
                                                        in the middle of step 3's write-behind
python nvme_worker.py resume NVME_DIR CKPT_DIR OUT THREADS   load the latest checkpoint into a
                                                        fresh engine on the same nvme_path, train
                                                        2 steps, write losses, weights, moments
"""

from __future__ import annotations

import os
import signal
import sys

import tiny_models
import torch
from side_by_side import ds_config

from megatrain_ds import MegatrainEngine, parse_engine_config

ACCUMULATION = 2


def build(seed: int, nvme_path: str | None, bf16: bool = False, level: str = "optimizer") -> MegatrainEngine:
    """Llama, accumulation 2, clipping; the NVMe tier with a 2-block window when given a path
    (with ``bf16`` compute the tier holds the fp32 masters too; ``level`` "all": the weights
    too).

    ATen's fused kernel, chosen when DeepSpeed's op made a resumed run differ from the
    uninterrupted one by an ulp (its bias-correction powers multiplied along, and its
    scalar tail); ``optimizer/cpu_adam.py`` has since made both path-independent."""
    torch.manual_seed(seed)
    megatrain: dict = {"cpu_adam_kernel": "torch_fused"}
    if nvme_path:
        megatrain.update(nvme_offload=level, nvme_path=nvme_path, nvme_window_blocks=2)
    engine = MegatrainEngine(
        tiny_models.llama(), parse_engine_config(ds_config(accumulation=ACCUMULATION, bf16=bf16, megatrain=megatrain))
    )
    engine.train()
    return engine


def train(engine: MegatrainEngine, steps: int) -> list[float]:
    """Batches chosen by the engine's own counter: a resumed run sees the uninterrupted run's."""
    losses = []
    for _ in range(steps * ACCUMULATION):
        loss = engine(**tiny_models.make_batch(engine.micro_steps)).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def snapshot(engine: MegatrainEngine) -> dict[str, torch.Tensor]:
    """Every state's master and Adam moments, from whichever tier holds them."""
    kinds = ("master", "exp_avg", "exp_avg_sq")
    engine.settle_optimizer()  # the host state is read directly (RAM only: the update may be in flight)
    tier = engine.nvme_tier
    if tier is None:
        return {
            f"{index}.{kind}": getattr(flat, kind).clone() for index, flat in enumerate(engine.states) for kind in kinds
        }
    with tier.file_views() as on_tier:
        return {
            f"{index}.{kind}": (on_tier(flat) or {}).get(kind, getattr(flat, kind)).clone()
            for index, flat in enumerate(engine.states)
            for kind in kinds
        }


def main(argv: list[str]) -> None:
    mode = argv[0]
    if mode == "crash":
        nvme, checkpoints, threads = argv[1], argv[2], int(argv[3])
        torch.set_num_threads(threads)
        engine = build(0, nvme)
        train(engine, 2)
        engine.save_checkpoint(checkpoints)
        tier = engine.nvme_tier
        original = tier.io.write
        writes = []

        def write_then_die(buffer, path, offset):
            original(buffer, path, offset)
            writes.append(path)
            if len(writes) == 2:  # step 3 is half written back: some swap files new, some old
                print(f"KILLED after writing {writes}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

        tier.io.write = write_then_die
        train(engine, 1)
        raise SystemExit("step 3 finished: the kill did not happen")
    if mode == "resume":
        nvme, checkpoints, out, threads = argv[1], argv[2], argv[3], int(argv[4])
        torch.set_num_threads(threads)
        engine = build(1, nvme)
        engine.load_checkpoint(checkpoints)
        losses = train(engine, 2)
        torch.save({"losses": losses, "state": snapshot(engine), "steps": engine.global_steps}, out)
        engine.destroy()
        return
    raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
