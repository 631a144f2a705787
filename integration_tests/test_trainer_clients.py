"""The clients a user swaps in first, on this engine and on DeepSpeed's own, side by side.

Each client of ``trainer_clients.py`` (gradient checkpointing, TRL's ``SFTTrainer`` with its
defaults and with packing, PEFT LoRA, a minimal hand-written JSON, save and resume, and the
clients a LoRA user arrives with under a ZeRO-3 offload JSON: the Trainer with
``get_peft_model``, ``SFTTrainer`` with ``peft_config``, Accelerate with a PEFT model; and
the Trainer given that JSON with a ``from_pretrained`` model, which transformers builds under
``deepspeed.zero.Init`` on DeepSpeed, as ``test_zero3_offload.py``'s other clients) runs
twice, each time in a process of its own: routed to this engine, and with
``MEGATRAIN_DISABLE_HOOK=1`` on DeepSpeed's ``DeepSpeedEngine`` (stage 0, fp32; ZeRO-3
with CPU offload and CPU Adam for the ZeRO-3 JSON), the reference. Per engine one launched
script imports the libraries and forks a child per client (the imports are most of a run's
time; a child starts with no Trainer, Accelerate or DeepSpeed state in it). The scripts
never import ``megatrain_ds``. Losses and evaluation losses must agree to 1e-5 relative, as
in ``test_accelerate.py`` (fp32 on both sides: room for summation order only).
"""

from __future__ import annotations

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
    launched_once,
    load_weights,
    run_side_by_side,
    skip_if_deepspeed_refused_a_zero_warmup,
)
from tiny_clm import TRAINER_LOSS_FRACTION, byte_blocks, corpus, tiny_llama_config

SCRIPT = Path(__file__).with_name("trainer_clients.py")
MEGATRAIN_ENGINE = "megatrain_ds.integration.deepspeed_adapter.MegatrainDeepSpeedEngine"
DEEPSPEED_ENGINE = "deepspeed.runtime.engine.DeepSpeedEngine"


def readme_minimal_config() -> dict:
    """The first JSON block of the README's quick start: the config it tells users to write."""
    text = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    quick_start = text[text.index("## Quick start") :]
    return json.loads(quick_start.split("```json", 1)[1].split("```", 1)[0])


MINIMAL = readme_minimal_config()
# What the start-up hook gives the minimal config when Accelerate or the Trainer reads it
# (README, docs/integration.md): DeepSpeed's own engine needs it spelled out.
MINIMAL_SPELLED_OUT = {
    **MINIMAL,
    "zero_optimization": {"stage": 0},
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
}


CLIENT_NAMES = ("checkpointing", "sft", "sft_packing", "lora", "minimal", "resume", "evaluate_first")
# The LoRA user's clients, the Trainer with a pretrained model and the Trainer evaluating
# before it trains, each given the shipped ZeRO-3 offload JSON (with "engine": "megatrain",
# which DeepSpeed's own engine, the hook disabled, ignores).
ZERO3_CONFIG = REPO_ROOT / "configs" / "ds_zero3_offload_megatrain.json"
ZERO3_CLIENT_NAMES = ("lora_zero3", "sft_lora", "accelerate_lora", "pretrained", "evaluate_first_zero3")


@pytest.fixture(scope="module")
def clients(tmp_path_factory: pytest.TempPathFactory, model_dir: Path):
    """``clients(name)``: the client's runs on both engines. One process per engine, side by
    side, runs every client, each in a child forked after the imports (``trainer_clients.py``):
    two launches instead of twenty, each of which spent most of its time importing torch,
    transformers, TRL and PEFT. A client that failed fails its own test, with its log. The
    ``pretrained`` client loads ``model_dir`` (the launching worker's; the runs' outputs are
    all a test reads)."""
    with launched_once(tmp_path_factory, "clients") as (root, done):  # once, whichever worker asks first
        sides = {}
        # DeepSpeed's engine loads its optimizer ops in every client: loaded once before the forks.
        for engine, minimal, env, preload in (
            ("megatrain", MINIMAL, {}, []),
            ("deepspeed", MINIMAL_SPELLED_OUT, {"MEGATRAIN_DISABLE_HOOK": "1"}, ["--preload-deepspeed-optimizers"]),
        ):
            path = root / f"{engine}_minimal.json"
            configs = {"minimal": path, "evaluate_first": path} | dict.fromkeys(ZERO3_CLIENT_NAMES, ZERO3_CONFIG)
            args = [
                arg
                for client in CLIENT_NAMES + ZERO3_CLIENT_NAMES
                for arg in ("--client", f"{client}={configs[client]}" if client in configs else client)
            ]
            args += ["--model-dir", str(model_dir), *preload]
            sides[engine] = Run(engine, SCRIPT, root / engine, accelerate=False, args=args, env=env)
            if not done:
                path.write_text(json.dumps(minimal), encoding="utf-8")
        if not done:
            run_side_by_side(list(sides.values()))
    exit_codes = {engine: side.result("exit_codes.json") for engine, side in sides.items()}

    def runs(client: str) -> dict[str, Run]:
        done = {name: Run(name, SCRIPT, side.output_dir / client, accelerate=False) for name, side in sides.items()}
        logs = {
            engine: run.log_path.read_text(encoding="utf-8", errors="replace")
            for engine, run in done.items()
            if exit_codes[engine][client] != 0
        }
        skip_if_deepspeed_refused_a_zero_warmup(list(logs.values()), runs=len(done))
        if logs:
            engine, log = next(iter(logs.items()))
            code = exit_codes[engine][client]
            raise AssertionError(f"client {client!r} on {engine} exited with {code}:\n{log[-4000:]}")
        return done

    return runs


def assert_same_training(runs: dict[str, Run], steps: int) -> dict:
    """The engines are the ones asked for, and they trained alike; the megatrain result."""
    ours, reference = runs["megatrain"].result(), runs["deepspeed"].result()
    assert ours["engine_mro"][0] == MEGATRAIN_ENGINE and DEEPSPEED_ENGINE in ours["engine_mro"]
    assert reference["engine_mro"][0] == DEEPSPEED_ENGINE
    assert ours["global_steps"] == reference["global_steps"] == steps
    assert len(ours["losses"]) == len(reference["losses"]) == steps
    assert all(math.isfinite(loss) for loss in ours["losses"])
    for step, (a, b) in enumerate(zip(ours["losses"], reference["losses"])):
        assert a == pytest.approx(b, rel=1e-5), f"step {step + 1}"
    assert ours["eval_loss"] == pytest.approx(reference["eval_loss"], rel=1e-5)
    return ours


def test_trainer_with_gradient_checkpointing(clients) -> None:
    result = assert_same_training(clients("checkpointing"), steps=6)
    assert result["is_gradient_checkpointing"]  # HF's own checkpointing was asked for, and skipped in blocks
    assert result["losses"][-1] < result["losses"][0] - 0.5


def test_sft_trainer_with_its_defaults(clients) -> None:
    result = assert_same_training(clients("sft"), steps=6)
    assert result["gradient_checkpointing"]  # SFTConfig's default
    assert "attention_mask" in result["first_batch"]  # padded, not packed
    assert result["losses"][-1] < result["losses"][0] - 0.5


def test_sft_trainer_with_packing(clients) -> None:
    """Best-fit packing, padding-free: one row of several sequences, longer than the model's
    32 positions, with ``position_ids`` restarting per sequence."""
    result = assert_same_training(clients("sft_packing"), steps=6)
    batch = result["first_batch"]
    assert "attention_mask" not in batch and batch["position_ids"] == batch["input_ids"]
    assert batch["input_ids"][0] == 1 and batch["input_ids"][1] > 32 >= batch["max_length_q"]
    assert result["losses"][-1] < result["losses"][0] - 0.5


def reloaded_eval_loss(out: Path) -> float:
    """The evaluation loss of the base model (``initial.safetensors``) plus the adapter saved
    under ``out/model``, in plain PEFT, on the client's evaluation batches."""
    import peft
    import transformers

    base = transformers.LlamaForCausalLM(tiny_llama_config())
    base.load_state_dict(load_weights(out / "initial.safetensors"))
    model = peft.PeftModel.from_pretrained(base, out / "model").eval()
    batches = torch.load(out / "eval_batches.pt")
    with torch.no_grad():
        return sum(float(model(input_ids=b, labels=b).loss) for b in batches) / len(batches)


def assert_trained_only_the_adapter(runs: dict[str, Run], result: dict) -> None:
    """Only LoRA's matrices trained; the frozen base weights are bit for bit the initial ones;
    the model directory holds the adapter alone (lora_B starts at zero: it moved), and it is the
    same adapter as DeepSpeed saved (to the losses' 1e-5, relative Frobenius over all tensors)."""
    assert result["trainable"] and all(".lora_A." in n or ".lora_B." in n for n in result["trainable"])
    out = runs["megatrain"].output_dir
    initial = load_weights(out / "initial.safetensors")
    base_after = load_weights(out / "base_after.safetensors")
    assert base_after.keys() == initial.keys()
    for name in initial:
        assert torch.equal(base_after[name], initial[name]), name
    for run in runs.values():
        assert sorted(p.name for p in (run.output_dir / "model").glob("*.safetensors")) == ["adapter_model.safetensors"]
    adapter = load_weights(out / "model" / "adapter_model.safetensors")
    assert any("lora_B" in name and bool(value.abs().max() > 0) for name, value in adapter.items())
    reference = load_weights(runs["deepspeed"].output_dir / "model" / "adapter_model.safetensors")
    assert adapter.keys() == reference.keys()
    diff = sum(float(((adapter[k].double() - reference[k].double()) ** 2).sum()) for k in adapter)
    assert math.sqrt(diff / sum(float((reference[k].double() ** 2).sum()) for k in adapter)) < 1e-5


def test_peft_lora_trains_and_reloads_only_the_adapter(clients) -> None:
    """The stage-0 JSON's LoRA run: as DeepSpeed's stage-0 engine trains it, and the saved
    adapter on the base model gives the Trainer's evaluation loss."""
    runs = clients("lora")
    result = assert_same_training(runs, steps=6)
    assert_trained_only_the_adapter(runs, result)
    # The base model plus the saved adapter, in plain PEFT, gives the Trainer's eval loss.
    assert reloaded_eval_loss(runs["megatrain"].output_dir) * TRAINER_LOSS_FRACTION == pytest.approx(
        result["eval_loss"], rel=1e-5
    )


@pytest.mark.parametrize("client", ["lora_zero3", "accelerate_lora"])
def test_peft_lora_with_a_zero3_offload_json(clients, client: str) -> None:
    """The Trainer with ``get_peft_model``, and a plain Accelerate loop over a PEFT model, each
    given the ZeRO-3 offload JSON: as DeepSpeed's ZeRO-3 offload engine trains it, and the
    saved adapter on the base model gives the evaluation loss the run reported (the Trainer's
    scaled by ``TRAINER_LOSS_FRACTION``; the Accelerate loop's is the mean token loss)."""
    runs = clients(client)
    result = assert_same_training(runs, steps=6)
    assert_trained_only_the_adapter(runs, result)
    fraction = TRAINER_LOSS_FRACTION if client == "lora_zero3" else 1.0
    assert reloaded_eval_loss(runs["megatrain"].output_dir) * fraction == pytest.approx(result["eval_loss"], rel=1e-5)


def test_sft_trainer_with_peft_config(clients) -> None:
    """TRL wraps the model itself (``peft_config``), under the ZeRO-3 offload JSON. Its
    evaluation set is SFT's own, so the saved adapters are compared through the client's
    byte-block evaluation batches: the same loss from either engine's adapter."""
    runs = clients("sft_lora")
    result = assert_same_training(runs, steps=6)
    assert result["gradient_checkpointing"]  # SFTConfig's default, with PEFT's input-gradient hook
    assert_trained_only_the_adapter(runs, result)
    ours, reference = (reloaded_eval_loss(run.output_dir) for run in (runs["megatrain"], runs["deepspeed"]))
    assert ours == pytest.approx(reference, rel=1e-5)


def test_minimal_json_under_the_trainer(clients) -> None:
    """The README's ``{"engine": "megatrain", "optimizer": ...}``: no ZeRO block, no batch sizes."""
    assert set(MINIMAL) == {"engine", "optimizer"}
    result = assert_same_training(clients("minimal"), steps=6)
    assert result["losses"][-1] < result["losses"][0] - 0.5


def test_trainer_save_and_resume(clients) -> None:
    """Six steps with a checkpoint every three; a fresh model and Trainer resumed from the
    first checkpoint continue as the uninterrupted run and as DeepSpeed's resume."""
    runs = clients("resume")
    result = assert_same_training(runs, steps=6)
    reference = runs["deepspeed"].result()
    assert len(result["losses_after_resume"]) == 3
    for a, b, c in zip(
        result["losses_after_resume"], reference["losses_after_resume"], result["uninterrupted_losses"][3:]
    ):
        assert a == pytest.approx(b, rel=1e-5) and a == pytest.approx(c, rel=1e-5)
    # Resumed, not restarted: step 4's loss is not step 1's.
    assert result["losses_after_resume"][0] < result["uninterrupted_losses"][0] - 0.1
    assert {"latest", "global_step3", "trainer_state.json"} <= set(result["checkpoint_files"])


def test_trainer_with_a_zero3_offload_json(clients) -> None:
    """``TrainingArguments(deepspeed=<the ZeRO-3 JSON>)``, then ``from_pretrained``: transformers
    builds the model under zero.Init on DeepSpeed, whole on the engine; ``save_model`` writes
    the trained weights, the same as DeepSpeed's (``assert_same_weights``), which plain
    transformers reloads to the Trainer's evaluation loss. (fp32; ``--fp16`` is
    ``test_zero3_fp16_trainer.py``.)"""
    runs = clients("pretrained")
    ours = assert_same_training(runs, steps=6)
    reference = runs["deepspeed"].result()
    assert (reference["zero_stage"], reference["built_partitioned"]) == (3, True)
    assert (ours["zero_stage"], ours["built_partitioned"]) == (0, False)
    assert ours["losses"][-1] < ours["losses"][0] - 0.5  # it trained
    assert_same_weights(runs["megatrain"].output_dir / "model", runs["deepspeed"].output_dir / "model")
    eval_batches = [torch.stack([e["input_ids"] for e in byte_blocks(corpus(), 8, start=48 + 8 * i)]) for i in (0, 1)]
    reloaded = eval_loss_of_saved_model(runs["megatrain"].output_dir / "model", eval_batches)
    assert reloaded * TRAINER_LOSS_FRACTION == pytest.approx(ours["eval_loss"], rel=1e-5)  # the Trainer scales it


def plain_eval_loss(out: Path) -> float:
    """The Trainer's evaluation loss computed in plain PyTorch: the client's initial model
    (``initial.safetensors``), ``eval()``, on its two evaluation batches, the mean of their
    losses (scaled as the Trainer scales it: ``TRAINER_LOSS_FRACTION``)."""
    import transformers

    model = transformers.LlamaForCausalLM(tiny_llama_config())
    model.load_state_dict(load_weights(out / "initial.safetensors"))
    model.eval()
    batches = torch.load(out / "eval_batches.pt")
    with torch.no_grad():
        loss = sum(float(model(input_ids=b, labels=b).loss) for b in batches) / len(batches)
    return loss * TRAINER_LOSS_FRACTION


def test_evaluate_and_predict_before_training(clients) -> None:
    """A fresh Trainer's ``evaluate()``, ``predict()`` and ``save_model``, no ``train()``, given
    the ZeRO-3 offload JSON and the minimal JSON ([Note: evaluation before training] in
    ``deepspeed_hook.py``): the engine is built without an optimizer (no Adam moments, no
    gradients in host memory), gives the evaluation loss of DeepSpeed's ZeRO-3 inference on
    the same JSON and of plain PyTorch's ``model.eval()`` on the same weights, and saves the
    initial weights. DeepSpeed has no answer for the minimal JSON (spelled out, stage 0):
    transformers refuses ZeRO inference below stage 3. Tolerance: fp32 forward passes of the
    same weights, the same matmuls, 1e-5 relative as the other clients (room for summation
    order only)."""
    zero3 = clients("evaluate_first_zero3")
    ours, reference = zero3["megatrain"].result(), zero3["deepspeed"].result()
    assert ours["engine_mro"][0] == MEGATRAIN_ENGINE and reference["engine_mro"][0] == DEEPSPEED_ENGINE
    assert ours["eval_loss"] == pytest.approx(reference["eval_loss"], rel=1e-5)
    minimal = clients("evaluate_first")
    assert "ZeRO inference only makes sense with ZeRO Stage 3" in minimal["deepspeed"].result()["refused"]
    for runs in (zero3, minimal):
        result = runs["megatrain"].result()
        assert result["engine_mro"][0] == MEGATRAIN_ENGINE and result["global_steps"] == 0
        host = result["host_bytes"]
        assert host["master"] > 0 and host["exp_avg"] == host["exp_avg_sq"] == host["grad"] == 0
        plain = plain_eval_loss(runs["megatrain"].output_dir)
        assert result["eval_loss"] == pytest.approx(plain, rel=1e-5)
        assert result["predict_loss"] == pytest.approx(result["eval_loss"], rel=1e-5)
        # save_model after the evaluation writes the untrained weights, bit for bit: copies.
        out = runs["megatrain"].output_dir
        saved, initial = load_weights(out / "model"), load_weights(out / "initial.safetensors")
        assert saved.keys() == initial.keys() and all(torch.equal(saved[k], initial[k]) for k in initial)
