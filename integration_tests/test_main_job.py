"""The main job (``examples/train_clm.py``), end to end on a short run, launched as
``scripts/train.sh`` launches it: ``accelerate launch --config_file configs/accelerate_megatrain.yaml``.

Checks that Accelerate got this engine from ``deepspeed.initialize``, that the model learns
(held-out loss falls), that the loss plot is a PNG, and that the saved model is the
trained one: reloaded with plain ``transformers`` it gives the engine's final eval loss.
"""

from __future__ import annotations

import importlib.util
import math
import sys

import pytest
import torch
import transformers
from launching import REPO_ROOT, Run, run_side_by_side

SCRIPT = REPO_ROOT / "examples" / "train_clm.py"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
ARGS = [
    "--steps",
    "30",
    "--seq-len",
    "64",
    "--eval-every",
    "15",
    "--eval-batches",
    "2",
    "--batch-size",
    "8",
    "--seed",
    "0",
    "--no-progress",
]


def _load_script():
    spec = importlib.util.spec_from_file_location("train_clm", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while being defined
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory):
    output_dir = tmp_path_factory.mktemp("train_clm") / "out"
    job = run_side_by_side([Run("main_job", SCRIPT, output_dir, args=ARGS)])
    return job["main_job"].result("metrics.json")


def test_uses_megatrain_engine(run) -> None:
    assert run["engine_type"] == "megatrain_ds.integration.deepspeed_adapter.MegatrainDeepSpeedEngine"


def test_eval_loss_falls(run) -> None:
    assert len(run["losses"]) == 30
    assert all(math.isfinite(loss) for loss in run["losses"])
    # Random init predicts ~ln(256) = 5.55 nats per byte; 30 steps reach well below 4.
    assert run["initial_eval_loss"] == pytest.approx(math.log(256), abs=0.1)
    assert run["final_eval_loss"] < run["initial_eval_loss"] - 1.0
    assert run["eval_steps"] == [0, 15, 30]


def test_loss_plot_is_png(run) -> None:
    with open(run["plot_path"], "rb") as handle:
        data = handle.read()
    assert data.startswith(PNG_SIGNATURE)
    assert len(data) > 1000


def test_saved_model_matches_engine(run) -> None:
    """The checkpoint holds the fp32 masters: plain transformers reproduces the engine's
    final eval loss on the same held-out batches. fp32 on both sides; rtol 1e-5 leaves
    room only for kernel-order differences (the engine runs blocks from flat buffers)."""
    train_clm = _load_script()
    _, eval_text = train_clm.split_corpus(train_clm.DEFAULT_DATA.read_text(encoding="utf-8"))
    batches = train_clm.make_eval_batches(train_clm.encode_bytes(eval_text), 8, 64, 2)
    model = transformers.AutoModelForCausalLM.from_pretrained(run["model_dir"], dtype=torch.float32)
    assert isinstance(model, transformers.LlamaForCausalLM)
    reloaded = train_clm.evaluate(model.eval(), batches, torch.device("cpu"))
    assert reloaded == pytest.approx(run["final_eval_loss"], rel=1e-5)
