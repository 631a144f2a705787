"""A typical Accelerate script on the megatrain engine, launched as users launch theirs.

``accelerate_clm.py`` never imports ``megatrain_ds``; it is run under ``accelerate launch
--config_file configs/accelerate_megatrain.yaml`` three times: on the engine (lr 3e-3) and on
the engine with lr 0, both in one launch (``forked_runs.py``: each run a child forked after
the script's imports), and on DeepSpeed itself (stage 0, fp32, the same script and configs
with ``MEGATRAIN_DISABLE_HOOK=1``, which the start-up hook reads at import: a launch of its
own) as the reference; and a fourth time, in a third launch, with an Accelerate config
naming the minimal ``{"engine": "megatrain"}`` JSON, compared with the same reference run
(one launch of DeepSpeed serves both comparisons). The launches run side by side.
"""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path

import pytest
import torch
from launching import (
    ACCELERATE_CONFIG,
    Run,
    SharedLaunch,
    assert_zero_lr_kept_weights,
    eval_loss_of_saved_model,
    load_weights,
    run_side_by_side,
)

SCRIPT = Path(__file__).with_name("accelerate_clm.py")
MEGATRAIN_ENGINE = "megatrain_ds.integration.deepspeed_adapter.MegatrainDeepSpeedEngine"
DEEPSPEED_ENGINE = "deepspeed.runtime.engine.DeepSpeedEngine"


def minimal_accelerate_config(root: Path) -> Path:
    """The shipped Accelerate YAML, its DeepSpeed JSON replaced by ``{"engine": "megatrain"}``."""
    minimal = root / "minimal.json"
    minimal.write_text(json.dumps({"engine": "megatrain"}), encoding="utf-8")
    shipped = ACCELERATE_CONFIG.read_text(encoding="utf-8")
    yaml = root / "accelerate_minimal.yaml"
    yaml.write_text(shipped.replace("configs/ds_megatrain_accelerate.json", str(minimal)), encoding="utf-8")
    assert str(minimal) in yaml.read_text(encoding="utf-8")
    return yaml


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    root = tmp_path_factory.mktemp("accelerate")
    minimal = Run(
        "megatrain_minimal", SCRIPT, root / "megatrain_minimal", accelerate_config=minimal_accelerate_config(root)
    )
    minimal.start()  # side by side with the others; a failure of it fails only its own test
    on_the_engine = [
        Run("megatrain", SCRIPT, root / "megatrain"),
        Run("megatrain_lr0", SCRIPT, root / "megatrain_lr0", args=["--learning-rate", "0"]),
    ]
    reference = Run("deepspeed", SCRIPT, root / "deepspeed", env={"MEGATRAIN_DISABLE_HOOK": "1"})
    run_side_by_side([SharedLaunch.of("megatrain_runs", on_the_engine), reference])
    with contextlib.suppress(AssertionError):
        minimal.wait()
    return {run.name: run for run in (*on_the_engine, reference, minimal)}


def test_the_engine_is_megatrain_without_an_import(runs) -> None:
    assert "megatrain" not in SCRIPT.read_text(encoding="utf-8").split('"""', 2)[2]
    mro = runs["megatrain"].result()["engine_mro"]
    assert mro[0] == MEGATRAIN_ENGINE and DEEPSPEED_ENGINE in mro  # Accelerate's isinstance checks
    assert runs["megatrain"].result()["unwrapped"] == "transformers.models.llama.modeling_llama.LlamaForCausalLM"
    assert runs["deepspeed"].result()["engine_mro"][0] == DEEPSPEED_ENGINE  # the switch works


def test_loss_falls(runs) -> None:
    result = runs["megatrain"].result()
    losses = result["losses"]
    assert len(losses) == 24 and all(math.isfinite(loss) for loss in losses)
    # Random init predicts ~ln(256) = 5.55 nats per byte; 12 steps of lr 3e-3 reach ~4.0.
    assert losses[0] == pytest.approx(math.log(256), abs=0.1)
    assert max(losses[-4:]) < losses[0] - 1.0
    assert result["eval_loss"] < math.log(256) - 1.0


def test_losses_equal_deepspeed_stage0_fp32(runs) -> None:
    """Same script, same batches, fp32 on both sides: DeepSpeed runs the client AdamW and
    clips with its own global norm; the engine runs torch's AdamW arithmetic on flat host
    buffers. 1e-5 relative leaves room for summation order only (measured ~1e-7)."""
    ours, reference = runs["megatrain"].result(), runs["deepspeed"].result()
    assert len(ours["losses"]) == len(reference["losses"])
    for step, (a, b) in enumerate(zip(ours["losses"], reference["losses"])):
        assert a == pytest.approx(b, rel=1e-5), f"micro-batch {step}"
    assert ours["eval_loss"] == pytest.approx(reference["eval_loss"], rel=1e-5)
    # The client scheduler drives both (it changes the client's groups, the engine reads them).
    assert ours["learning_rates"] == reference["learning_rates"]
    assert max(ours["learning_rates"]) == pytest.approx(3e-3)


def test_client_scheduler_sees_an_optimizer_step(runs) -> None:
    """No "lr_scheduler.step() before optimizer.step()" warning: the client optimizer's
    step runs (as under DeepSpeed), see optimizer_facade's note."""
    assert runs["megatrain"].result()["scheduler_warnings"] == []
    assert runs["deepspeed"].result()["scheduler_warnings"] == []


def test_zero_learning_rate_leaves_weights_bit_identical(runs) -> None:
    run = runs["megatrain_lr0"]
    assert_zero_lr_kept_weights(run, runs["megatrain"])
    assert set(run.result()["learning_rates"]) == {0.0}


@pytest.mark.parametrize("name", ["megatrain", "megatrain_lr0"])
def test_saved_model_reloads_to_the_same_eval_loss(runs, name) -> None:
    """``unwrap_model(...).save_pretrained(state_dict=accelerator.get_state_dict(model))``
    holds the trained fp32 weights: plain transformers reproduces the engine's eval loss."""
    run = runs[name]
    batches = torch.load(run.output_dir / "eval_batches.pt")
    reloaded = eval_loss_of_saved_model(run.output_dir / "model", batches)
    assert reloaded == pytest.approx(run.result()["eval_loss"], rel=1e-5)


def test_weights_match_deepspeed(runs) -> None:
    """After training, the engine's saved weights equal DeepSpeed's to float rounding."""
    ours = load_weights(runs["megatrain"].output_dir / "model")
    reference = load_weights(runs["deepspeed"].output_dir / "model")
    assert ours.keys() == reference.keys()
    diff = sum(float(((ours[k].double() - reference[k].double()) ** 2).sum()) for k in ours)
    norm = sum(float((reference[k].double() ** 2).sum()) for k in ours)
    assert math.sqrt(diff / norm) < 1e-5


def test_minimal_json_under_accelerate_launch(runs) -> None:
    """``{"engine": "megatrain"}`` named by an Accelerate config, the script's own optimizer
    and scheduler: the same run as the shipped ``configs/ds_megatrain_accelerate.json`` on
    DeepSpeed (its "auto" keys and stage 0 are what the hook supplies). The reference is the
    module's DeepSpeed run: the same script, arguments, shipped config and environment."""
    runs["megatrain_minimal"].wait()  # raises with the log's tail if that run failed
    ours, reference = runs["megatrain_minimal"].result(), runs["deepspeed"].result()
    assert ours["engine_mro"][0] == MEGATRAIN_ENGINE and reference["engine_mro"][0] == DEEPSPEED_ENGINE
    assert len(ours["losses"]) == len(reference["losses"]) == 24
    for step, (a, b) in enumerate(zip(ours["losses"], reference["losses"])):
        assert a == pytest.approx(b, rel=1e-5), f"micro-batch {step}"
    assert ours["learning_rates"] == reference["learning_rates"]
    assert ours["eval_loss"] == pytest.approx(reference["eval_loss"], rel=1e-5)
