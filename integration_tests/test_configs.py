"""Every shipped config must still be accepted by the code that reads it.

DeepSpeed JSONs with ``"engine": "megatrain"`` go through the engine's own parser; model
configs under ``configs/models`` through ``transformers.AutoConfig``, and are built into
a model (random init) so a key the model code no longer understands shows up here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers

import megatrain_ds

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def _load(path: Path) -> dict:
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


ENGINE_CONFIGS = sorted(p for p in CONFIGS.rglob("*.json") if _load(p).get("engine") == "megatrain")
MODEL_CONFIGS = sorted((CONFIGS / "models").glob("*.json"))


def test_shipped_configs_are_found() -> None:
    """Guards the parametrised tests below against a glob that silently matches nothing."""
    names = {p.name for p in ENGINE_CONFIGS}
    assert {"ds_megatrain.json", "ds_megatrain_fp32.json"} <= names
    assert "tiny_llama.json" in {p.name for p in MODEL_CONFIGS}


@pytest.mark.parametrize("path", ENGINE_CONFIGS, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_engine_config_parses(path: Path) -> None:
    config = megatrain_ds.parse_engine_config(_load(path))
    # Unknown top-level keys are only warned about by the parser; a shipped config has none.
    assert config.ignored_keys == (), f"{path.name}: keys the engine ignores: {config.ignored_keys}"
    assert config.optimizer is not None, f"{path.name}: no optimizer block"


@pytest.mark.parametrize("path", MODEL_CONFIGS, ids=lambda p: p.name)
def test_model_config_builds(path: Path) -> None:
    config = transformers.AutoConfig.for_model(**_load(path))
    model = transformers.AutoModelForCausalLM.from_config(config)
    assert model.config.model_type == config.model_type
    assert sum(p.numel() for p in model.parameters()) > 0
