"""The HF Trainer with ``--fp16`` and ``--deepspeed`` a ZeRO-3 offload JSON plus ``"engine": "megatrain"``.

``trainer_clients.py --client pretrained --fp16 --record-steps`` runs the Trainer as users do
(``TrainingArguments(fp16=True, deepspeed=JSON)`` before ``from_pretrained``), in a fresh
process, on two copies of the usual template (``configs/ds_zero3_offload_megatrain.json``,
whose ``"fp16": {"enabled": "auto"}`` the Trainer fills from ``--fp16``):

- ``shipped``: the template unchanged (DeepSpeed's default initial scale, 2^16; this model's
  first steps do not overflow at it, while the engine's chunked loss did at any scale of
  2^16 or more until [Note: low-precision gradients of the chunked loss] in
  ``megatrain_ds/model/chunked_loss.py``);
- ``scale_too_high``: ``initial_scale_power`` 32, so the first 15 steps overflow and are
  skipped (hysteresis 2: one overflow tolerated, then the scale halves at each, down to
  2^18) before the last 11 train.

DeepSpeed's own fp16 engine refuses a CPU, so the reference is ``side_by_side.Fp16Reference``
(plain PyTorch: fp32 masters, ``torch.optim.AdamW``, ``clip_grad_norm_``, an fp16 compute copy,
DeepSpeed's own ``DynamicLossScaler`` built from DeepSpeed's config model) with DeepSpeed's
``WarmupDecayLR`` stepped after every applied step, as DeepSpeed's engine steps it. It starts
from the same pretrained weights with the hyperparameters the test derives from the script's
``TrainingArguments`` (checked against what the Trainer filled into the JSON) and replays
exactly the micro-batches the Trainer fed, with its ``num_items_in_batch``.

Compared, step by step: which steps were skipped and the loss scale after each (identical:
the overflow is an inf in an fp16 gradient, far from any threshold, and the scaler is
DeepSpeed's on both sides); the Trainer's bookkeeping under skips (Accelerate's
``optimizer_step_was_skipped``, the engine's ``overflow`` and ``skipped_steps``, the scheduler
not stepped after a skipped step, so the learning rates the Trainer logs are the
reference's exactly); the losses, the unscaled gradient norms the Trainer logs, and the
weights ``trainer.save_model`` wrote.

Tolerances: losses and gradient norms 1e-4 relative, weights 5e-4 relative Frobenius error
(measured: 6e-6, 2e-5 and 4e-5). The shipped JSON runs the engine's defaults: DeepSpeed's CPU
Adam kernel, whose arithmetic differs from ``torch.optim.AdamW`` in the last fp32 bits, and
the chunked loss, which sums the cross-entropy in another order. An fp32 master one ulp away
can round to the other fp16 neighbour in the compute copy (a 2^-11 ~ 4.9e-4 relative change
of that one weight), which later forwards carry: the weights stay within one fp16 rounding
of the reference's (``tests/test_fp16.py`` measured 1.2e-4 with that kernel after 8 steps;
with the op-by-op kernel it proves the engine's arithmetic bit for bit). A wrong step (a
skipped step applied, a wrong scale or learning rate) moves them by 1e-2 and more, and the
skips, scales and learning rates are compared exactly besides.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from launching import REPO_ROOT, Run, load_weights, run_side_by_side
from trainer_clients import LR

sys.path.insert(0, str(REPO_ROOT / "tests"))  # the reference lives with the unit tests
from side_by_side import Fp16Reference

HERE = Path(__file__).parent
ZERO3_CONFIG = REPO_ROOT / "configs" / "ds_zero3_offload_megatrain.json"
MEGATRAIN_ENGINE = "megatrain_ds.integration.deepspeed_adapter.MegatrainDeepSpeedEngine"

# What trainer_clients.common_args gives TrainingArguments, as DeepSpeed's blocks: the
# Trainer must fill the JSON's "auto" values with exactly these (checked below).
ADAMW = {"lr": LR, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
ACCUMULATION, CLIPPING, WARMUP_STEPS = 2, 1.0, 2
LOSS_TOLERANCE, WEIGHT_TOLERANCE = 1e-4, 5e-4

# name: (the fp16 block's changes to the template, Trainer steps).
CASES = {"shipped": ({}, 8), "scale_too_high": ({"initial_scale_power": 32}, 26)}


def fp16_block(changes: dict[str, Any]) -> dict[str, Any]:
    """The template's ``fp16`` block with ``changes``, as the Trainer fills it for ``--fp16``."""
    block = json.loads(ZERO3_CONFIG.read_text(encoding="utf-8"))["fp16"]
    assert block == {"enabled": "auto"}, "the template's fp16 block changed: review this test"
    return {**block, **changes, "enabled": True}


def replay_on_the_reference(run: Run, model_dir: Path, fp16: dict[str, Any], steps: int) -> dict[str, Any]:
    """Train :class:`Fp16Reference` on the micro-batches ``run`` recorded; what it did per step."""
    from deepspeed.runtime.lr_schedules import WarmupDecayLR

    batches = load_weights(run.output_dir / "batches.safetensors")
    micro_batches = json.loads((run.output_dir / "steps.json").read_text(encoding="utf-8"))["micro_batches"]
    assert len(micro_batches) == batches["input_ids"].shape[0] == steps * ACCUMULATION
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = {"fp16": fp16, "gradient_accumulation_steps": ACCUMULATION, "gradient_clipping": CLIPPING}
    reference = Fp16Reference(model, config, adamw=ADAMW)
    # The template's scheduler block, filled as the Trainer fills it (checked by the caller).
    scheduler = WarmupDecayLR(
        reference.optimizer,
        total_num_steps=steps,
        warmup_min_lr=0,
        warmup_max_lr=LR,
        warmup_num_steps=WARMUP_STEPS,
    )
    reference.compute.train()
    replay: dict[str, list[Any]] = {"losses": [], "skipped": [], "scales": [], "lrs": [], "grad_norms": []}
    for index, record in enumerate(micro_batches):
        # The Trainer passed num_items_in_batch (the step's label tokens): the model's loss is
        # normalised over the whole step already and backward must not divide it again.
        assert record["num_items_in_batch"] is not None
        batch = {
            "input_ids": batches["input_ids"][index],
            "labels": batches["labels"][index],
            "num_items_in_batch": record["num_items_in_batch"],
        }
        replay["losses"].append(reference.micro_step(batch, divide_by_accumulation=False))
        if (index + 1) % ACCUMULATION == 0:
            skipped = reference.step()
            if not skipped:
                scheduler.step()  # DeepSpeed's engine: not after a skipped step
            replay["skipped"].append(skipped)
            replay["scales"].append(float(reference.scaler.loss_scale))
            replay["lrs"].append(reference.optimizer.param_groups[0]["lr"])
            replay["grad_norms"].append(reference.grad_norm)
    replay["weights"] = reference.master.state_dict()
    return replay


def assert_close(ours: list[float], reference: list[float], what: str) -> None:
    assert len(ours) == len(reference), what
    for index, (a, b) in enumerate(zip(ours, reference)):
        assert a == pytest.approx(b, rel=LOSS_TOLERANCE), f"{what} {index}: {a} != {b}"


def check_run(run: Run, model_dir: Path, changes: dict[str, Any], steps: int) -> None:
    fp16 = fp16_block(changes)
    result = run.result()
    assert result["engine_mro"][0] == MEGATRAIN_ENGINE
    assert (result["zero_stage"], result["built_partitioned"]) == (0, False)  # stage 3 read as 0
    # What the Trainer filled from TrainingArguments(fp16=True, ...): the reference's settings.
    filled = result["deepspeed_config"]
    assert filled["fp16"] == fp16
    assert filled["optimizer"] == {"type": "AdamW", "params": {**ADAMW, "betas": list(ADAMW["betas"])}}
    assert filled["scheduler"]["params"] == {
        "warmup_min_lr": 0,
        "warmup_max_lr": LR,
        "warmup_num_steps": WARMUP_STEPS,
        "total_num_steps": steps,
    }
    assert (filled["gradient_accumulation_steps"], filled["gradient_clipping"]) == (ACCUMULATION, CLIPPING)

    trainer_steps = json.loads((run.output_dir / "steps.json").read_text(encoding="utf-8"))["steps"]
    micro_losses = [m["loss"] for m in json.loads((run.output_dir / "steps.json").read_text())["micro_batches"]]
    reference = replay_on_the_reference(run, model_dir, fp16, steps)
    skipped = reference["skipped"]
    if changes:  # scale_too_high exercises what it names: skips from the first step, then training
        assert skipped[0] and not all(skipped), skipped
    assert result["global_steps"] == len(trainer_steps) == steps  # a skipped step is still a step

    # Skips and scales: identical.
    assert [s["overflow"] for s in trainer_steps] == skipped
    assert [s["cur_scale"] for s in trainer_steps] == reference["scales"]
    assert [s["loss_scale"] for s in trainer_steps] == reference["scales"]
    # The Trainer's bookkeeping: Accelerate reports the skip (so the Trainer does not step its
    # scheduler wrapper), the engine counts it and does not step the scheduler either.
    assert [s["optimizer_step_was_skipped"] for s in trainer_steps] == skipped
    assert [s["global_step"] for s in trainer_steps] == list(range(1, steps + 1))
    assert [s["engine_global_steps"] for s in trainer_steps] == list(range(1, steps + 1))
    applied_so_far = [sum(not s for s in skipped[: i + 1]) for i in range(steps)]
    assert [s["engine_skipped_steps"] for s in trainer_steps] == [i + 1 - a for i, a in enumerate(applied_so_far)]
    assert [s["scheduler_iteration"] for s in trainer_steps] == [a - 1 for a in applied_so_far]
    assert [s["lr"] for s in trainer_steps] == reference["lrs"]
    assert result["learning_rates"] == reference["lrs"]  # what the Trainer logged
    assert max(reference["lrs"]) == LR  # the schedule got past its warm-up: the lrs say something

    # Losses, norms and weights: within fp16 rounding (module docstring).
    assert_close(micro_losses, reference["losses"], "micro-batch loss")
    for index, (logged, norm) in enumerate(zip(result["grad_norms"], reference["grad_norms"])):
        if norm is None:  # skipped: the Trainer logs the engine's non-finite norm
            assert not math.isfinite(logged), f"step {index + 1}"
        else:
            assert logged == pytest.approx(norm, rel=LOSS_TOLERANCE), f"grad norm of step {index + 1}"
    saved, weights = load_weights(run.output_dir / "model"), reference["weights"]
    assert saved.keys() == weights.keys()
    initial = load_weights(model_dir)
    diff = sum(float(((saved[k].double() - weights[k].double()) ** 2).sum()) for k in weights)
    moved = sum(float(((initial[k].double() - weights[k].double()) ** 2).sum()) for k in weights)
    norm = sum(float((weights[k].double() ** 2).sum()) for k in weights)
    assert math.sqrt(diff / norm) <= WEIGHT_TOLERANCE
    assert math.sqrt(moved / norm) > 100 * WEIGHT_TOLERANCE  # the applied steps trained: the check can fail


def test_trainer_fp16_on_a_zero3_offload_json_matches_the_fp16_reference(model_dir: Path, tmp_path: Path) -> None:
    runs = []
    for name, (changes, steps) in CASES.items():
        config = json.loads(ZERO3_CONFIG.read_text(encoding="utf-8"))
        config["fp16"].update(changes)
        json_path = tmp_path / f"{name}.json"
        json_path.write_text(json.dumps(config), encoding="utf-8")
        args = ["--client", "pretrained", "--model-dir", str(model_dir), "--deepspeed-config", str(json_path)]
        args += ["--fp16", "--max-steps", str(steps), "--record-steps"]
        runs.append(Run(name, HERE / "trainer_clients.py", tmp_path / name, args, accelerate=False))
    done = run_side_by_side(runs)
    # The launched runs use one thread: so does the reference, for its float sums to be theirs.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for name, (changes, steps) in CASES.items():
            check_run(done[name], model_dir, changes, steps)
    finally:
        torch.set_num_threads(threads)
