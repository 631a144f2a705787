"""A ZeRO-3 offload config plus ``"engine": "megatrain"``, run unchanged by the usual clients.

The user's habit: a ZeRO-3 offload JSON (``configs/ds_zero3_offload_megatrain.json``: stage
3, ``offload_param`` and ``offload_optimizer`` on the CPU, ``"auto"`` batch and optimizer
values) and a pretrained model loaded with ``from_pretrained``, which transformers builds
under ``deepspeed.zero.Init`` at stage 3. Two clients here, each twice in processes of
their own: on this engine, and with ``MEGATRAIN_DISABLE_HOOK=1`` on DeepSpeed's own ZeRO-3
offload engine (fp32, CPU Adam), the reference:

1. an Accelerate script (``accelerate_clm.py --model-dir``) under ``accelerate launch`` with
   ``zero3_init_flag: true`` and the JSON without its optimizer and scheduler blocks
   (Accelerate refuses them next to the script's own);
2. TRL's ``trl sft`` console script on a local model directory and JSON-lines dataset.

The third, the HF Trainer with the JSON (``trainer_clients.py``'s ``pretrained`` client), is
``test_trainer_clients.py``'s ``test_trainer_with_a_zero3_offload_json``: it runs in that
file's shared launch, forked after the imports beside the other Trainer clients.

On DeepSpeed the model is built partitioned; on the engine whole ([Note: ZeRO-3 configs] in
``megatrain_ds/integration/deepspeed_hook.py``). Losses agree to 1e-5 relative (fp32 on both
sides, DeepSpeed's CPU Adam on both: room for summation order only), and the saved Hugging
Face checkpoints (``get_state_dict``/``save_pretrained``, ``trainer.save_model``) hold the
same weights, which plain transformers reloads to the same evaluation loss.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
from pathlib import Path

import pytest
import torch
from launching import (
    REPO_ROOT,
    Run,
    assert_same_weights,
    eval_loss_of_saved_model,
    run_side_by_side,
    skip_if_deepspeed_refused_a_zero_warmup,
)
from trainer_clients import sft_examples

HERE = Path(__file__).parent
ZERO3_CONFIG = REPO_ROOT / "configs" / "ds_zero3_offload_megatrain.json"
MEGATRAIN_ENGINE = "megatrain_ds.integration.deepspeed_adapter.MegatrainDeepSpeedEngine"
DEEPSPEED_ENGINE = "deepspeed.runtime.engine.DeepSpeedEngine"
DEEPSPEED = {"MEGATRAIN_DISABLE_HOOK": "1"}


def assert_same_losses(ours: list[float], reference: list[float], count: int, min_drop: float = 0.5) -> None:
    assert len(ours) == len(reference) == count
    assert all(math.isfinite(loss) for loss in ours)
    for step, (a, b) in enumerate(zip(ours, reference)):
        assert a == pytest.approx(b, rel=1e-5), f"step {step + 1}"
    assert ours[-1] < ours[0] - min_drop  # it trained


def test_accelerate_with_zero3_init_flag(model_dir: Path, tmp_path: Path) -> None:
    config = json.loads(ZERO3_CONFIG.read_text(encoding="utf-8"))
    del config["optimizer"], config["scheduler"]  # the script brings its own
    json_path = tmp_path / "zero3_offload.json"
    json_path.write_text(json.dumps(config), encoding="utf-8")
    shipped = (REPO_ROOT / "configs" / "accelerate_megatrain.yaml").read_text(encoding="utf-8")
    yaml = shipped.replace("configs/ds_megatrain_accelerate.json", str(json_path))
    yaml = yaml.replace("zero3_init_flag: false", "zero3_init_flag: true")
    assert str(json_path) in yaml and "zero3_init_flag: true" in yaml
    accelerate_config = tmp_path / "accelerate.yaml"
    accelerate_config.write_text(yaml, encoding="utf-8")
    args = ["--model-dir", str(model_dir)]
    runs = run_side_by_side(
        [Run(name, HERE / "accelerate_clm.py", tmp_path / name, args, accelerate_config=accelerate_config, env=env)
         for name, env in (("megatrain", {}), ("deepspeed", DEEPSPEED))]
    )  # fmt: skip
    ours, reference = runs["megatrain"].result(), runs["deepspeed"].result()
    assert ours["engine_mro"][0] == MEGATRAIN_ENGINE and reference["engine_mro"][0] == DEEPSPEED_ENGINE
    # DeepSpeed built it under zero.Init (so the comparison is with real ZeRO-3); the engine whole.
    assert (reference["zero_stage"], reference["built_partitioned"]) == (3, True)
    assert (ours["zero_stage"], ours["built_partitioned"]) == (0, False)
    assert_same_losses(ours["losses"], reference["losses"], count=24)
    assert ours["learning_rates"] == reference["learning_rates"]
    assert ours["eval_loss"] == pytest.approx(reference["eval_loss"], rel=1e-5)
    # accelerator.get_state_dict + unwrap_model(...).save_pretrained: a correct HF checkpoint.
    assert_same_weights(runs["megatrain"].output_dir / "model", runs["deepspeed"].output_dir / "model")
    batches = torch.load(runs["megatrain"].output_dir / "eval_batches.pt")
    reloaded = eval_loss_of_saved_model(runs["megatrain"].output_dir / "model", batches)
    assert reloaded == pytest.approx(ours["eval_loss"], rel=1e-5)


def console_script(package: str, name: str) -> Path:
    """The console script ``name`` that ``package``'s installation wrote: beside this
    interpreter, or, in a virtualenv made with ``--system-site-packages`` (as CI's), beside
    the base interpreter that installed the package."""
    distribution = importlib.metadata.distribution(package)
    for file in distribution.files or []:
        if file.name == name and file.parent.name in ("bin", "Scripts"):
            path = Path(str(distribution.locate_file(file))).resolve()
            if path.is_file():
                return path
    raise AssertionError(f"{package} installed no console script {name!r}")


def test_trl_sft_cli(model_dir: Path, tmp_path: Path) -> None:
    """``trl sft --model_name_or_path DIR --dataset_name DIR --deepspeed JSON``: TRL's own
    script loads the model (under zero.Init on DeepSpeed) and saves it with ``save_model``."""
    data = tmp_path / "data"
    data.mkdir()
    with open(data / "train.jsonl", "w", encoding="utf-8") as handle:
        handle.writelines(json.dumps(example) + "\n" for example in sft_examples(48))
    trl_script = console_script("trl", "trl")
    steps = 6
    args = [
        "sft",
        *("--model_name_or_path", str(model_dir), "--dataset_name", str(data)),
        *("--deepspeed", str(ZERO3_CONFIG), "--bf16", "false", "--max_length", "32"),
        *("--per_device_train_batch_size", "4", "--learning_rate", "3e-3", "--max_steps", str(steps)),
        *("--logging_steps", "1", "--save_strategy", "steps", "--save_steps", str(steps), "--save_only_model", "true"),
        *("--report_to", "none", "--seed", "0", "--disable_tqdm", "true", "--dataloader_num_workers", "0"),
    ]
    # `trl sft` builds its TrainingArguments (which join the rendezvous) in the CLI process
    # too, before `accelerate launch` starts the script with the same environment: port 0
    # lets each of the two one-rank groups bind a free port of its own.
    # The CLI only launches: the script that trains is a new interpreter (launching.Run.launcher).
    rendezvous = {"MASTER_PORT": "0"}
    sides = [Run(name, trl_script, tmp_path / name, args, accelerate=False, env={**env, **rendezvous}, launcher=True)
             for name, env in (("megatrain", {}), ("deepspeed", DEEPSPEED))]  # fmt: skip
    for run in sides:
        run.start()
    failures = []
    for run in sides:
        try:
            run.wait()
        except AssertionError as failure:
            failures.append((failure, run.log_path.read_text(encoding="utf-8", errors="replace")))
    skip_if_deepspeed_refused_a_zero_warmup([log for _, log in failures], runs=len(sides))
    if failures:
        raise failures[0][0]
    runs = {run.name: run for run in sides}

    def losses(run: Run) -> list[float]:
        state = json.loads((run.output_dir / f"checkpoint-{steps}" / "trainer_state.json").read_text())
        return [entry["loss"] for entry in state["log_history"] if "loss" in entry]

    # Which engine ran: only the engine's config parser names the ZeRO-3 keys it has no use for.
    marker = "megatrain: ignoring DeepSpeed config keys without meaning here: "
    assert marker in runs["megatrain"].log_path.read_text(encoding="utf-8")
    assert marker not in runs["deepspeed"].log_path.read_text(encoding="utf-8")
    assert_same_losses(losses(runs["megatrain"]), losses(runs["deepspeed"]), count=steps, min_drop=0.3)
    assert_same_weights(runs["megatrain"].output_dir, runs["deepspeed"].output_dir)
