"""``accelerate launch --num_processes 2`` on a machine without a GPU.

From Accelerate 1.13.0 on, Accelerate runs DeepSpeed's ranks there as if each were alone:
it sets up a CPU process group only when asked for the CPU (``use_cpu``), so its state
reports one process, the data is not sharded and the "auto" batch sizes are filled for one
rank. DeepSpeed itself then stops at its batch-size check; the engine must stop the same
way (never train each rank on the same data as if that were data parallel) and point to
``torchrun``, with which data parallel runs on the CPU (tests/test_data_parallel.py).

Before 1.13.0 (``AcceleratorState._prepare_backend`` took any multi-process launch on a
machine without an accelerator for a gloo one; checked in the wheels of 1.10.0, 1.12.0 and
1.13.0), the two processes are real data parallel ranks, and both engines train them.
"""

from __future__ import annotations

from pathlib import Path

import accelerate
import pytest
import torch
from launching import Run
from packaging.version import Version

SCRIPT = Path(__file__).with_name("accelerate_clm.py")
BATCH_RULE = "train_batch_size is not equal to micro_batch_per_gpu * gradient_acc_step * world_size"
RANKS_RUN_ALONE = Version(accelerate.__version__) >= Version("1.13.0")


@pytest.mark.skipif(torch.cuda.is_available(), reason="Accelerate runs DeepSpeed data parallel on GPUs")
def test_two_processes_stop_at_the_batch_rule_like_deepspeed(tmp_path: Path) -> None:
    runs = [
        Run(name, SCRIPT, tmp_path / name, args=["--num-examples", "32"], num_processes=2, env=env)
        for name, env in (("megatrain", {}), ("deepspeed", {"MEGATRAIN_DISABLE_HOOK": "1"}))
    ]
    for run in runs:
        run.start()
    if not RANKS_RUN_ALONE:
        assert_both_train_data_parallel(runs)
        return
    logs = {}
    for run in runs:
        with pytest.raises(AssertionError, match="exited with"):
            run.wait()
        logs[run.name] = run.log_path.read_text(encoding="utf-8", errors="replace")
    assert BATCH_RULE in logs["deepspeed"] and "megatrain_ds" not in logs["deepspeed"]
    assert BATCH_RULE in logs["megatrain"] and "launch the ranks with torchrun" in logs["megatrain"]
    assert "megatrain_ds/config/engine_config.py" in logs["megatrain"]  # the engine's check, not DeepSpeed's
    assert not (tmp_path / "megatrain" / "result.json").exists()


def assert_both_train_data_parallel(runs: list[Run]) -> None:
    """Accelerate before 1.13.0: both runs finish, on the engine asked for, with the data
    split over the ranks (rank 0's 16 of the 32 examples are 4 micro-batches of 4, where a
    rank alone would have 8: two optimizer steps, the second with a learning rate above 0)
    and the same losses and evaluation loss after those steps, which a rank that trained on
    its own gradient alone would miss (fp32 on both sides: 1e-5 relative, room for summation
    order only, as in ``test_accelerate.py``)."""
    for run in runs:
        run.wait()
    ours, reference = (run.result() for run in runs)
    assert ours["engine_mro"][0] == "megatrain_ds.integration.deepspeed_adapter.MegatrainDeepSpeedEngine"
    assert reference["engine_mro"][0] == "deepspeed.runtime.engine.DeepSpeedEngine"
    assert len(ours["losses"]) == len(reference["losses"]) == 4
    assert ours["learning_rates"] == reference["learning_rates"] and ours["learning_rates"][2] > 0
    assert ours["losses"] == pytest.approx(reference["losses"], rel=1e-5)
    assert ours["eval_loss"] == pytest.approx(reference["eval_loss"], rel=1e-5)
