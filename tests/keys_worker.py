"""One rank of a 2-rank run for tests/test_deepspeed_keys.py, forked by ``forked_ranks.py``.

Builds the engine through ``deepspeed.initialize(training_data=...)`` over a dataset of
row indices and writes, per rank, the indices its loader yields (two epochs), and the
weights after one accumulation window trained with and without ``no_sync()``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny_models
from side_by_side import ds_config

# Imported by forked_ranks.py before it forks the ranks: what they build is loaded once, here.
tiny_models.load_eagerly("LlamaConfig", "LlamaForCausalLM")
tiny_models.load_engine_imports_eagerly()

ROWS = 21  # not a multiple of 2 ranks x 2 rows: DistributedSampler pads, drop_last drops


class _Indices(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return ROWS

    def __getitem__(self, index: int) -> int:
        return index


def _weights_after_window(use_no_sync: bool) -> dict[str, list[float]]:
    import deepspeed

    torch.manual_seed(0)
    engine, *_ = deepspeed.initialize(model=tiny_models.llama(), config=ds_config(accumulation=2))
    rank = int(os.environ["RANK"])
    try:
        for micro in range(2):
            batch = tiny_models.make_batch(10 * rank + micro)
            if use_no_sync and micro == 0:  # Accelerate's accumulate(): no_sync before the boundary
                with engine.no_sync():
                    engine.backward(engine(**batch).loss)
            else:
                engine.backward(engine(**batch).loss)
            engine.step()
        return {k: v.flatten()[:64].tolist() for k, v in engine.module.state_dict().items()}
    finally:
        engine.destroy()


def main() -> None:
    import deepspeed

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    config = {**ds_config(), "dataloader_drop_last": True}
    engine, _, loader, _ = deepspeed.initialize(model=tiny_models.llama(), config=config, training_data=_Indices())
    epochs = [[batch.tolist() for batch in loader] for _ in range(2)]
    engine.destroy()
    result = {"epochs": epochs, "with_no_sync": _weights_after_window(True), "without": _weights_after_window(False)}
    (args.out / f"rank{os.environ['RANK']}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
