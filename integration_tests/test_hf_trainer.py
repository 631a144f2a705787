"""The HF Trainer on the megatrain engine: ``TrainingArguments(deepspeed="configs/ds_megatrain_hf.json")``.

``hf_trainer_clm.py`` never imports ``megatrain_ds``; the shipped config is full of
``"auto"`` values (batch sizes, clipping, precision, the AdamW hyperparameters and the
WarmupDecayLR steps) that the Trainer fills in. Run twice, lr 3e-3 and lr 0, in one launch
(``forked_runs.py``: each run a child forked after the script's imports, as in a fresh
process).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from launching import (
    Run,
    SharedLaunch,
    assert_zero_lr_kept_weights,
    eval_loss_of_saved_model,
    launched_once,
    run_side_by_side,
)
from tiny_clm import TRAINER_LOSS_FRACTION

SCRIPT = Path(__file__).with_name("hf_trainer_clm.py")
LR = 3e-3
# 96 sequences, 4 per micro-batch, 2 micro-batches per step, one epoch.
NUM_STEPS = 12


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    with launched_once(tmp_path_factory, "hf_trainer") as (root, done):  # once, whichever worker asks first
        runs = [
            Run("megatrain", SCRIPT, root / "megatrain", args=["--learning-rate", str(LR)], accelerate=False),
            Run("megatrain_lr0", SCRIPT, root / "megatrain_lr0", args=["--learning-rate", "0"], accelerate=False),
        ]
        if not done:
            run_side_by_side([SharedLaunch.of("megatrain_runs", runs)])
    return {run.name: run for run in runs}


def test_the_engine_is_megatrain_without_an_import(runs) -> None:
    assert "megatrain_ds" not in SCRIPT.read_text(encoding="utf-8").split('"""', 2)[2]
    result = runs["megatrain"].result()
    assert result["engine_mro"][0] == "megatrain_ds.integration.deepspeed_adapter.MegatrainDeepSpeedEngine"
    assert "deepspeed.runtime.engine.DeepSpeedEngine" in result["engine_mro"]
    assert result["global_steps"] == NUM_STEPS


def test_loss_falls(runs) -> None:
    """The first step's loss is that of an untrained byte model, log(256) per token (as the
    Trainer normalises it: ``TRAINER_LOSS_FRACTION``); the loss then falls."""
    result = runs["megatrain"].result()
    losses = result["losses"]
    assert len(losses) == NUM_STEPS and all(math.isfinite(loss) for loss in losses)
    assert losses[0] == pytest.approx(math.log(256) * TRAINER_LOSS_FRACTION, abs=0.1)
    assert losses[-1] < losses[0] - 1.0
    assert result["eval_loss"] < math.log(256) - 1.0
    # get_global_grad_norm reaches the Trainer's logs (clipping "auto" -> max_grad_norm 1.0).
    assert all(norm is not None and math.isfinite(norm) and norm > 0 for norm in result["grad_norms"])


def test_auto_scheduler_follows_deepspeeds_warmup_decay(runs) -> None:
    """The config's WarmupDecayLR, its "auto" values filled by the Trainer, built with
    DeepSpeed's own class: the logged learning rates are what that class gives a plain
    optimizer stepped once per optimizer step."""
    from deepspeed.runtime.lr_schedules import WarmupDecayLR

    result = runs["megatrain"].result()
    assert result["scheduler"] == "WarmupDecayLR"
    reference_optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    reference = WarmupDecayLR(
        reference_optimizer,
        total_num_steps=NUM_STEPS,
        warmup_min_lr=0,
        warmup_max_lr=LR,
        warmup_num_steps=2,
        warmup_type="linear",
    )
    expected = []
    for _ in range(NUM_STEPS):
        reference.step()
        expected.append(reference.get_last_lr()[0])
    assert result["learning_rates"] == pytest.approx(expected, rel=1e-12)


def test_zero_learning_rate_leaves_weights_bit_identical(runs) -> None:
    run = runs["megatrain_lr0"]
    assert_zero_lr_kept_weights(run, runs["megatrain"])


@pytest.mark.parametrize("name", ["megatrain", "megatrain_lr0"])
def test_saved_model_reloads_to_the_same_eval_loss(runs, name) -> None:
    """``trainer.save_model`` (through ``accelerator.get_state_dict``) holds the trained fp32
    weights: plain transformers reproduces ``trainer.evaluate()``'s loss on the same data (the
    mean token loss, which the Trainer scales by ``TRAINER_LOSS_FRACTION``)."""
    run = runs[name]
    batches = torch.load(run.output_dir / "eval_batches.pt")
    reloaded = eval_loss_of_saved_model(run.output_dir / "model", batches)
    assert reloaded * TRAINER_LOSS_FRACTION == pytest.approx(run.result()["eval_loss"], rel=1e-5)
