"""Every shipped config must still be accepted by the code that reads it.

DeepSpeed JSONs with ``"engine": "megatrain"`` go through the engine's own parser, after
their ``"auto"`` values are filled by the code that fills them in real runs (the HF
Trainer's ``HfTrainerDeepSpeedConfig``, Accelerate's ``DeepSpeedPlugin``); Accelerate
YAMLs through Accelerate's loader; model configs under ``configs/models`` through
``transformers.AutoConfig``, and are built into a model (random init) so a key the model
code no longer understands shows up here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from accelerate.commands.config.config_args import load_config_from_file
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.utils import DeepSpeedPlugin
from accelerate.utils.launch import prepare_deepspeed_cmd_env
from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

import megatrain_ds

REPO_ROOT = Path(__file__).resolve().parents[1]
CONFIGS = REPO_ROOT / "configs"


def _load(path: Path) -> dict:
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def _has_auto(value) -> bool:
    if isinstance(value, dict):
        return any(_has_auto(v) for v in value.values())
    return value == "auto"


ENGINE_CONFIGS = sorted(p for p in CONFIGS.rglob("*.json") if _load(p).get("engine") == "megatrain")
MODEL_CONFIGS = sorted((CONFIGS / "models").glob("*.json"))
ACCELERATE_CONFIGS = sorted(CONFIGS.rglob("*.yaml"))
TWO_NODES = "accelerate_megatrain_2nodes.yaml"  # the 2-machine recipe of docs/data-parallel.md


def test_shipped_configs_are_found() -> None:
    """Guards the parametrised tests below against a glob that silently matches nothing,
    and every file in configs/ against being parsed by none of them."""
    names = {p.name for p in ENGINE_CONFIGS}
    assert {
        "ds_megatrain.json",
        "ds_megatrain_fp32.json",
        "ds_megatrain_hf.json",
        "ds_megatrain_accelerate.json",
        ZERO3_TEMPLATE,
    } <= names
    assert "tiny_llama.json" in {p.name for p in MODEL_CONFIGS}
    assert {"accelerate_megatrain.yaml", TWO_NODES} <= {p.name for p in ACCELERATE_CONFIGS}
    parsed = set(ENGINE_CONFIGS) | set(MODEL_CONFIGS) | set(ACCELERATE_CONFIGS)
    assert {p for p in CONFIGS.rglob("*") if p.is_file()} == parsed


def _filled_by_trainer(path: Path, tmp_path: Path) -> tuple[dict, transformers.TrainingArguments]:
    """The config as the HF Trainer hands it to deepspeed.initialize (no global state set)."""
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        learning_rate=5e-4,
        weight_decay=0.1,
        warmup_steps=3,
        report_to=[],
    )
    config = HfTrainerDeepSpeedConfig(str(path))
    config.trainer_config_process(args)
    config.trainer_config_finalize(
        args,
        transformers.LlamaForCausalLM(
            transformers.LlamaConfig(
                vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
            )
        ),
        num_training_steps=100,
    )
    return config.config, args


def _filled_by_accelerate(path: Path) -> dict:
    """The config as Accelerate's _prepare_deepspeed hands it over (micro-batch 8 from the
    DataLoader, accumulation 2, no mixed precision)."""
    plugin = DeepSpeedPlugin(hf_ds_config=str(path), gradient_accumulation_steps=2)
    plugin.set_mixed_precision("no")
    plugin.deepspeed_config_process(
        must_match=False, train_micro_batch_size_per_gpu=8, train_batch_size=16, gradient_clipping=1.0
    )
    return plugin.deepspeed_config


# The tuning keys of a typical ZeRO-3 offload JSON (configs/ds_zero3_offload_megatrain.json,
# copied as users have it): no meaning to the engine, ignored with one warning. The config
# is read as stage 0 (docs/integration.md), so the Trainer leaves the two "auto" ones that
# it fills only at stage 3.
ZERO3_TEMPLATE = "ds_zero3_offload_megatrain.json"
ZERO3_TUNING = {
    "overlap_comm",
    "contiguous_gradients",
    "sub_group_size",
    "reduce_bucket_size",
    "stage3_prefetch_bucket_size",
    "stage3_param_persistence_threshold",
    "stage3_max_live_parameters",
    "stage3_max_reuse_distance",
}


def _without_zero3_tuning(config: dict) -> dict:
    zero = {k: v for k, v in config.get("zero_optimization", {}).items() if k not in ZERO3_TUNING}
    return {**config, "zero_optimization": zero}


@pytest.mark.parametrize("path", ENGINE_CONFIGS, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_engine_config_parses(path: Path, tmp_path: Path) -> None:
    raw = _load(path)
    if _has_auto(raw):
        raw, args = _filled_by_trainer(path, tmp_path)
        assert not _has_auto(_without_zero3_tuning(raw)), f"{path.name}: the Trainer leaves 'auto' values"
    if path.name == ZERO3_TEMPLATE:  # a ZeRO-3 JSON, read as stage 0 by the Trainer (the hook)
        assert (_load(path)["zero_optimization"]["stage"], raw["zero_optimization"]["stage"]) == (3, 0)
    config = megatrain_ds.parse_engine_config(raw)
    # Unknown keys are only warned about by the parser; a shipped config has none but the
    # ZeRO-3 template's tuning keys.
    expected = {f"zero_optimization.{k}" for k in ZERO3_TUNING} if path.name == ZERO3_TEMPLATE else set()
    assert set(config.ignored_keys) == expected, f"{path.name}: keys the engine ignores: {config.ignored_keys}"
    assert (config.optimizer is not None) == ("optimizer" in raw)
    if _has_auto(_load(path)):
        assert (config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps) == (4, 2)
        if config.optimizer is not None:
            assert (config.optimizer.lr, config.optimizer.weight_decay) == (5e-4, 0.1)
        if config.scheduler is not None:
            assert config.scheduler.params["total_num_steps"] == 100
            assert config.scheduler.params["warmup_num_steps"] == 3


def test_hf_config_is_auto_throughout() -> None:
    """Every value the HF Trainer can fill is "auto", so no TrainingArguments mismatch it."""
    raw = _load(CONFIGS / "ds_megatrain_hf.json")
    for key in (
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "gradient_clipping",
    ):
        assert raw[key] == "auto", key
    assert raw["bf16"]["enabled"] == raw["fp16"]["enabled"] == "auto"
    assert set(raw["optimizer"]["params"].values()) == {"auto"}
    assert raw["scheduler"]["type"] == "WarmupDecayLR"


@pytest.mark.parametrize("path", ACCELERATE_CONFIGS, ids=lambda p: p.name)
def test_accelerate_config_loads_and_names_an_engine_config(path: Path) -> None:
    config = load_config_from_file(str(path))
    assert config.distributed_type == "DEEPSPEED"
    assert config.num_processes == (16 if path.name == TWO_NODES else 1)
    # Accelerate refuses mixed_precision in the YAML next to a DeepSpeed config file; it
    # comes from `--mixed_precision` into the JSON's "bf16": {"enabled": "auto"}.
    assert config.mixed_precision is None
    json_path = REPO_ROOT / config.deepspeed_config["deepspeed_config_file"]  # relative to the repo root
    raw = _load(json_path)
    assert megatrain_ds.config.is_megatrain_config(raw)
    # Typical Accelerate scripts pass their own optimizer and scheduler; Accelerate refuses
    # a config that has either too.
    assert "optimizer" not in raw and "scheduler" not in raw
    parsed = megatrain_ds.parse_engine_config(_filled_by_accelerate(json_path))
    assert parsed.ignored_keys == ()
    assert (parsed.train_micro_batch_size_per_gpu, parsed.gradient_accumulation_steps) == (8, 2)
    assert parsed.gradient_clipping == 1.0 and not parsed.bf16


def test_accelerate_two_node_config_starts_torchrun_on_each_machine() -> None:
    """The 2-machine YAML of docs/data-parallel.md: `accelerate launch --machine_rank 1` on
    the second machine must start torchrun there (8 ranks, node rank 1, which the engine
    reads as GROUP_RANK), not the pdsh `deepspeed` launcher Accelerate uses by default."""
    path = CONFIGS / TWO_NODES
    config = load_config_from_file(str(path))
    assert config.distributed_type == "DEEPSPEED" and config.num_machines == 2
    assert config.num_processes % config.num_machines == 0 and config.machine_rank == 0
    assert config.deepspeed_config["deepspeed_multinode_launcher"] == "standard"
    assert _load(REPO_ROOT / config.deepspeed_config["deepspeed_config_file"])["engine"] == "megatrain"
    # What `accelerate launch` makes of it, without starting anything (machine rank 1:
    # no check of the port on this machine).
    args = launch_command_parser().parse_args(["--config_file", str(path), "--machine_rank", "1", "train.py"])
    args, defaults, _ = _validate_launch_command(args)
    args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config)  # as launch_command sets it
    cmd, _env = prepare_deepspeed_cmd_env(args)
    assert cmd is None  # None: torchrun in this process; the pdsh path returns a `deepspeed ...` command
    assert (args.nnodes, args.node_rank, args.nproc_per_node) == ("2", 1, "8")
    assert (args.rdzv_backend, args.rdzv_endpoint) == ("static", f"{config.main_process_ip}:{config.main_process_port}")
    # The recipes in the doc name this file and both machine ranks.
    doc = (REPO_ROOT / "docs" / "data-parallel.md").read_text(encoding="utf-8")
    for machine_rank in (0, 1):
        assert f"--config_file configs/{TWO_NODES} --machine_rank {machine_rank}" in doc


@pytest.mark.parametrize("path", MODEL_CONFIGS, ids=lambda p: p.name)
def test_model_config_builds(path: Path) -> None:
    config = transformers.AutoConfig.for_model(**_load(path))
    with torch.device("meta"):  # the structure, not 940M random weights (15 s here)
        model = transformers.AutoModelForCausalLM.from_config(config)
    assert model.config.model_type == config.model_type
    assert sum(p.numel() for p in model.parameters()) > 0
