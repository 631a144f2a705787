"""The main job (``examples/train_clm.py``), end to end on a short run.

Checks that ``deepspeed.initialize`` handed back this engine, that the model learns
(held-out loss falls), that the loss plot is a PNG, and that the saved model is the
trained one: reloaded with plain ``transformers`` it gives the engine's final eval loss.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch
import transformers

import megatrain_ds

REPO_ROOT = Path(__file__).resolve().parents[1]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _load_script():
    spec = importlib.util.spec_from_file_location("train_clm", REPO_ROOT / "examples" / "train_clm.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while being defined
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory):
    train_clm = _load_script()
    output_dir = tmp_path_factory.mktemp("train_clm")
    result = train_clm.main([
        "--deepspeed_config", str(REPO_ROOT / "configs" / "ds_megatrain_fp32.json"),
        "--steps", "30", "--seq-len", "64", "--eval-every", "15", "--eval-batches", "2",
        "--seed", "0", "--output-dir", str(output_dir), "--no-progress",
    ])
    return train_clm, result


def test_uses_megatrain_engine(run) -> None:
    _, result = run
    assert result.engine_type is megatrain_ds.MegatrainEngine


def test_eval_loss_falls(run) -> None:
    _, result = run
    assert len(result.losses) == 30
    assert all(math.isfinite(loss) for loss in result.losses)
    # Random init predicts ~ln(256) = 5.55 nats per byte; 30 steps reach well below 4.
    assert result.initial_eval_loss == pytest.approx(math.log(256), abs=0.1)
    assert result.final_eval_loss < result.initial_eval_loss - 1.0
    assert result.eval_steps == [0, 15, 30]


def test_loss_plot_is_png(run) -> None:
    _, result = run
    data = result.plot_path.read_bytes()
    assert data.startswith(PNG_SIGNATURE)
    assert len(data) > 1000


def test_saved_model_matches_engine(run) -> None:
    """The checkpoint holds the fp32 masters: plain transformers reproduces the engine's
    final eval loss. fp32 on both sides, same batches and device; rtol 1e-5 leaves room
    only for kernel-order differences (the engine runs blocks from flat buffers)."""
    train_clm, result = run
    model = transformers.AutoModelForCausalLM.from_pretrained(result.model_dir, dtype=torch.float32)
    assert isinstance(model, transformers.LlamaForCausalLM)
    model.to(result.device).eval()
    reloaded = train_clm.evaluate(model, result.eval_batches, result.device)
    assert reloaded == pytest.approx(result.final_eval_loss, rel=1e-5)
