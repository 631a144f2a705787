"""The engine as a ``DeepSpeedEngine``: what Accelerate and the HF Trainer check and call."""

import contextlib

import pytest
import tiny_models
import torch
from side_by_side import ds_config

from megatrain_ds import ConfigError, MegatrainEngine


@pytest.fixture
def engine():
    import deepspeed

    engine, *_ = deepspeed.initialize(model=tiny_models.llama(), config=ds_config())
    yield engine
    engine.destroy()


def _train_step(engine, seed=0):
    loss = engine(**tiny_models.make_batch(seed)).loss
    engine.backward(loss)
    engine.step()
    return loss


def test_passes_accelerates_and_the_trainers_type_checks(engine):
    from accelerate.utils import extract_model_from_parallel
    from deepspeed.runtime.engine import DeepSpeedEngine

    assert isinstance(engine, DeepSpeedEngine) and isinstance(engine, MegatrainEngine)
    assert extract_model_from_parallel(engine) is engine.module  # accelerator.unwrap_model


def test_no_deepspeed_engine_code_runs_on_state_it_never_built():
    """Every method of DeepSpeedEngine resolves to the engine, this adapter, nn.Module, or a
    stub that names itself: DeepSpeedEngine.__init__ never ran, so its own code cannot."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    from megatrain_ds.integration.deepspeed_adapter import MegatrainDeepSpeedEngine

    kept = {"__getattr__", "__del__", "__module__", "__doc__"}  # DeepSpeed behaviour that needs no state
    for name, value in vars(DeepSpeedEngine).items():
        if name in kept or isinstance(value, (staticmethod, classmethod)):
            continue
        owner = next(cls for cls in MegatrainDeepSpeedEngine.__mro__ if name in vars(cls))
        assert owner is not DeepSpeedEngine, name


def test_unsupported_deepspeed_api_raises_naming_it(engine):
    """The stubs' error is an AttributeError too: ``hasattr`` answers False for a stubbed
    property (a method stub exists until called), and the message still names it."""
    from megatrain_ds.integration.deepspeed_adapter import UnsupportedEngineAPIError

    with pytest.raises(NotImplementedError, match=r"DeepSpeedEngine.allreduce_gradients is not supported"):
        engine.allreduce_gradients()
    assert not hasattr(engine, "communication_data_type")
    assert getattr(engine, "communication_data_type", "missing") == "missing"
    with pytest.raises(UnsupportedEngineAPIError, match=r"DeepSpeedEngine.communication_data_type is not supported"):
        _ = engine.communication_data_type
    assert issubclass(UnsupportedEngineAPIError, AttributeError)
    with pytest.raises(NotImplementedError, match=r"engine.compile is not supported"):
        engine.compile()


def test_train_and_eval_are_nn_modules(engine):
    engine.eval()
    assert not engine.training and not engine.module.training
    engine.train()
    assert engine.training and engine.module.training


def test_deepspeed_api_values(engine):
    _train_step(engine)
    assert engine.zero_optimization_stage() == 0 and not engine.zero_optimization()
    assert engine.get_batch_info() == (2, 2, 1)
    assert engine.gradient_clipping() == 1.0 and not engine.fp16_enabled() and not engine.bfloat16_enabled()
    assert engine.get_mom() == [group["betas"] for group in engine.optimizer.param_groups]
    assert engine.global_steps == 1 and engine.skipped_steps == 0
    assert engine.config.get("train_micro_batch_size_per_gpu") == 2  # the Trainer reads engine.config so
    assert engine.get_global_grad_norm() > 0
    assert not engine.is_compiled
    with engine.no_sync():  # Accelerate's no_sync path: backward inside, step outside (tests/test_deepspeed_keys.py)
        engine.backward(engine(**tiny_models.make_batch(1)).loss)
    engine.step()
    assert engine.global_steps == 2


def test_deepspeed_getattr_reaches_the_model(engine):
    """DeepSpeed's __getattr__ is kept: unknown attributes are the model's."""
    assert engine.can_generate() == engine.module.can_generate()
    assert engine.get_input_embeddings() is engine.module.get_input_embeddings()


def test_state_dicts_for_saving_are_the_masters(engine):
    """What Accelerate's get_state_dict and the Trainer's save_model take under ZeRO-3
    (``zero_gather_16bit_weights_on_model_save``): the full fp32 state, as copies."""
    _train_step(engine)
    reference = engine.module.state_dict()
    assert engine.zero_gather_16bit_weights_on_model_save()
    for state in (engine._zero3_consolidated_16bit_state_dict(), engine.module_state_dict()):
        assert state.keys() == reference.keys()
        for key in reference:
            assert torch.equal(state[key], reference[key]) and state[key].dtype == torch.float32
    copied = engine._zero3_consolidated_16bit_state_dict()
    assert all(copied[key].data_ptr() != reference[key].data_ptr() for key in reference)


def test_frozen_parameters_can_be_excluded():
    import deepspeed

    model = tiny_models.llama()
    model.model.embed_tokens.weight.requires_grad_(False)
    engine, *_ = deepspeed.initialize(model=model, config=ds_config())
    try:
        state = engine._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=True)
        assert "model.embed_tokens.weight" not in state and "lm_head.weight" in state
    finally:
        engine.destroy()


def test_batch_rule_counts_the_launchers_ranks_and_model_parallel_is_rejected(monkeypatch):
    """Checked before any process group is joined (data parallel: tests/test_data_parallel.py).

    As before a group is joined even where another test on this pytest worker left one (a
    DeepSpeed reference run, ``tests/test_deepspeed_keys.py``, joins a one-rank group that
    cannot be left without DeepSpeed's own group caches going stale): the batch rule, the
    first thing ``initialize`` reads, then counts the launcher's ``WORLD_SIZE``."""
    import deepspeed

    monkeypatch.setenv("WORLD_SIZE", "2")
    with monkeypatch.context() as no_group:
        no_group.setattr(torch.distributed, "is_initialized", lambda: False)
        with pytest.raises(ConfigError, match=r"2 != 2 \* 1 \* 2"):
            deepspeed.initialize(model=tiny_models.llama(), config={**ds_config(), "train_batch_size": 2})
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ConfigError, match=r"model parallelism \(mpu=, mesh_param=\) is not supported"):
        deepspeed.initialize(model=tiny_models.llama(), config=ds_config(), mpu=object())


def zero3_offload(config: dict) -> dict:
    """``config`` with a ZeRO-3 offload block, as users copy it from DeepSpeed's docs."""
    offload = {"device": "cpu", "pin_memory": True}
    zero = {"stage": 3, "offload_param": offload, "offload_optimizer": offload}
    return {**config, "zero_optimization": {**zero, "stage3_gather_16bit_weights_on_model_save": True}}


def test_a_model_built_under_zero_init_with_the_config_trains_as_one_built_without():
    """``deepspeed.zero.Init(config_dict_or_path=<megatrain stage-3 config>)`` builds the model
    whole (the hook's [Note: ZeRO-3 configs]): same initial weights and the same losses, bit
    for bit, as the same seed built outside it; DeepSpeed's own config still partitions."""
    import deepspeed

    config = zero3_offload(ds_config())
    losses = {}
    for name in ("zero_init", "plain"):
        torch.manual_seed(0)
        context = deepspeed.zero.Init(config_dict_or_path=config) if name == "zero_init" else contextlib.nullcontext()
        with context:
            model = tiny_models.llama()
        assert not any(hasattr(p, "ds_id") for p in model.parameters())
        engine, *_ = deepspeed.initialize(model=model, config=config)
        losses[name] = [float(_train_step(engine).detach()) for _ in range(3)]  # one batch: the loss falls
        engine.destroy()
    assert losses["zero_init"] == losses["plain"]
    assert losses["plain"][-1] < losses["plain"][0]
    with deepspeed.zero.Init(config_dict_or_path={**config, "engine": "deepspeed", "train_batch_size": 2}):
        partitioned = torch.nn.Linear(4, 4)
    assert hasattr(partitioned.weight, "ds_id") and partitioned.weight.numel() == 0


def test_a_model_partitioned_by_zero_init_is_rejected():
    """A model built under a zero.Init that was not given the megatrain config has empty
    placeholders for parameters; DeepSpeed marks each with ds_id (simulated here)."""
    import deepspeed

    model = tiny_models.llama()
    param = next(model.parameters())
    param.ds_id = 0
    with pytest.raises(ConfigError, match=r"partitioned by deepspeed.zero.Init.*config_dict_or_path=config"):
        deepspeed.initialize(model=model, config=zero3_offload(ds_config()))


def test_save_16bit_model_writes_the_full_fp32_model(engine, tmp_path):
    """DeepSpeed's ``save_16bit_model`` (what DeepSpeed scripts call at stage 3): one file with
    the trained model's whole state dict, as ``module_state_dict``; ``exclude_frozen_parameters``
    leaves out what does not train."""
    _train_step(engine)
    assert engine.save_16bit_model(tmp_path / "out") is True
    saved = torch.load(tmp_path / "out" / "pytorch_model.bin", weights_only=True)
    expected = engine.module_state_dict()
    assert saved.keys() == expected.keys()
    assert all(torch.equal(saved[k], expected[k]) for k in expected)
    engine.module.model.embed_tokens.weight.requires_grad_(False)
    engine.save_16bit_model(tmp_path / "out", "frozen.bin", exclude_frozen_parameters=True)
    assert set(expected) - set(torch.load(tmp_path / "out" / "frozen.bin", weights_only=True)) == {
        "model.embed_tokens.weight"
    }


def test_without_an_optimizer_the_engine_evaluates_only():
    """``deepspeed.initialize`` given no optimizer, no ``"optimizer"`` block and no
    ``model_parameters`` (what the HF Trainer's ``evaluate()`` before ``train()`` calls):
    DeepSpeed's answer, no optimizer and no scheduler (the ``"scheduler"`` block is not built);
    every weight held once, no master, moment or gradient; the model's ``requires_grad``
    untouched; the evaluation loss of plain PyTorch on the same weights; ``backward`` and
    ``step`` refused with the way out. Tolerance: fp32, the same matmuls on the same weights;
    the engine may sum the loss over sequence chunks (``model/causal_lm_loss.py``), another
    summation order of at most 12 fp32 terms: 1e-6 relative."""
    import copy

    import deepspeed

    model = tiny_models.llama()
    reference = copy.deepcopy(model).eval()
    config = ds_config()
    del config["optimizer"]
    config["scheduler"] = {"type": "WarmupLR", "params": {"warmup_num_steps": 1}}
    engine, optimizer, loader, scheduler = deepspeed.initialize(model=model, config=config)
    try:
        assert (optimizer, loader, scheduler, engine.lr_scheduler) == (None, None, None, None)
        host = engine.host_bytes()
        assert host["exp_avg"] == host["exp_avg_sq"] == host["grad"] == 0
        weights = sum(p.numel() * p.element_size() for p in reference.parameters())
        assert weights <= host["master"] < 1.01 * weights  # once, each block's flat buffer padded
        assert all(p.requires_grad for p in model.parameters())
        engine.eval()
        for seed in (0, 1):
            batch = tiny_models.make_batch(seed)
            with torch.no_grad():
                ours, theirs = engine(**batch).loss, reference(**batch).loss
            assert float(ours) == pytest.approx(float(theirs), rel=1e-6)
        engine.train()
        loss = engine(**tiny_models.make_batch(2)).loss
        refusal = r"needs an optimizer: .* for evaluation only .* call trainer\.train\(\) before"
        for call in (lambda: engine.backward(loss), engine.step):
            with pytest.raises(RuntimeError, match=refusal):
                call()
    finally:
        engine.destroy()
    with pytest.raises(ConfigError, match=r'no optimizer: add an "optimizer" block'):  # meant to train
        deepspeed.initialize(model=tiny_models.llama(), config=config, model_parameters=model.parameters())
