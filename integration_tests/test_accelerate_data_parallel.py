"""``accelerate launch --num_processes 2`` on a machine without a GPU.

Accelerate runs DeepSpeed's ranks there as if each were alone: its state reports one
process, so the data is not sharded and the "auto" batch sizes are filled for one rank.
DeepSpeed itself then stops at its batch-size check; the engine must stop the same way
(never train each rank on the same data as if that were data parallel) and point to
``torchrun``, with which data parallel runs on the CPU (tests/test_data_parallel.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from launching import Run

SCRIPT = Path(__file__).with_name("accelerate_clm.py")
BATCH_RULE = "train_batch_size is not equal to micro_batch_per_gpu * gradient_acc_step * world_size"


@pytest.mark.skipif(torch.cuda.is_available(), reason="Accelerate runs DeepSpeed data parallel on GPUs")
def test_two_processes_stop_at_the_batch_rule_like_deepspeed(tmp_path: Path) -> None:
    runs = [
        Run(name, SCRIPT, tmp_path / name, args=["--num-examples", "8"], num_processes=2, env=env)
        for name, env in (("megatrain", {}), ("deepspeed", {"MEGATRAIN_DISABLE_HOOK": "1"}))
    ]
    for run in runs:
        run.start()
    logs = {}
    for run in runs:
        with pytest.raises(AssertionError, match="exited with"):
            run.wait()
        logs[run.name] = run.log_path.read_text(encoding="utf-8", errors="replace")
    assert BATCH_RULE in logs["deepspeed"] and "megatrain_ds" not in logs["deepspeed"]
    assert BATCH_RULE in logs["megatrain"] and "launch the ranks with torchrun" in logs["megatrain"]
    assert "megatrain_ds/config/engine_config.py" in logs["megatrain"]  # the engine's check, not DeepSpeed's
    assert not (tmp_path / "megatrain" / "result.json").exists()
