"""Models built on the meta device, filled from Hugging Face safetensors shards (load_from).

The reference is the same directory loaded by ``from_pretrained`` in fp32 and trained
with plain ``torch.optim.AdamW`` + ``clip_grad_norm_``; tolerances as in test_parity.py.
"""

import logging
import math

import accelerate
import pytest
import tiny_models
import torch
import transformers
from safetensors.torch import load_file, save_file
from side_by_side import LR, WEIGHT_DECAY, ds_config, relative_weight_error

from megatrain_ds import ConfigError, MegatrainEngine, parse_engine_config
from megatrain_ds.checkpoint import safetensors_source

pytestmark = pytest.mark.usefixtures("cpu_single_thread")


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A tiny Llama saved by save_pretrained in bf16, in several shards."""
    directory = tmp_path_factory.mktemp("llama_bf16")
    torch.manual_seed(0)
    tiny_models.llama().to(torch.bfloat16).save_pretrained(directory, max_shard_size="20KB")
    assert len(list(directory.glob("model-*.safetensors"))) > 2
    return directory


def _meta_llama(how):
    context = torch.device("meta") if how == "torch.device" else accelerate.init_empty_weights()
    with context:
        return tiny_models.llama()


@pytest.mark.parametrize("how", ["torch.device", "init_empty_weights"])
def test_meta_model_trains_like_from_pretrained(pretrained, how):
    model = _meta_llama(how)
    assert all(p.is_meta for p in model.parameters())
    engine = MegatrainEngine(model, parse_engine_config(ds_config(megatrain={"load_from": str(pretrained)})))
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        pretrained, dtype=torch.float32, attn_implementation="eager"
    )
    try:
        ours, theirs = engine.module.state_dict(), reference.state_dict()
        assert ours.keys() == theirs.keys()
        for key, value in theirs.items():  # bf16 files, upcast exactly to the fp32 masters
            assert ours[key].dtype == torch.float32 and torch.equal(ours[key], value), key
        assert torch.equal(engine.module.model.rotary_emb.inv_freq, reference.model.rotary_emb.inv_freq)
        optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
        for seed in range(3):
            batch = tiny_models.make_batch(seed)
            loss = engine(**batch).loss
            engine.backward(loss)
            engine.step()
            reference_loss = reference(**batch).loss
            reference_loss.backward()
            torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            assert math.isclose(loss.item(), reference_loss.item(), rel_tol=1e-5)
        assert relative_weight_error(engine, reference) < 2e-6
    finally:
        engine.destroy()


def test_a_checkpoint_tag_directory_is_a_load_from_directory(tmp_path):
    """Tied embeddings saved once (qwen2); the fp32 files give the masters bit for bit."""
    torch.manual_seed(0)
    engine = MegatrainEngine(tiny_models.qwen2(), parse_engine_config(ds_config()))
    with torch.device("meta"):
        model = tiny_models.qwen2()
    try:
        engine.save_checkpoint(tmp_path, tag="t")
        other = MegatrainEngine(model, parse_engine_config(ds_config(megatrain={"load_from": str(tmp_path / "t")})))
        for ours, theirs in zip(other.states, engine.states):
            assert torch.equal(ours.master, theirs.master)
        assert model.lm_head.weight is model.model.embed_tokens.weight
        other.destroy()
    finally:
        engine.destroy()


def test_a_tied_weight_saved_under_its_other_name_is_found(tmp_path):
    torch.manual_seed(0)
    source = tiny_models.qwen2()
    tensors = {name: t.contiguous() for name, t in source.state_dict().items() if name != "model.embed_tokens.weight"}
    tensors["lm_head.weight"] = source.lm_head.weight.detach().clone()
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with torch.device("meta"):
        model = tiny_models.qwen2()
    engine = MegatrainEngine(model, parse_engine_config(ds_config(megatrain={"load_from": str(tmp_path)})))
    try:
        assert torch.equal(engine.module.state_dict()["model.embed_tokens.weight"], source.lm_head.weight)
    finally:
        engine.destroy()


def test_big_tensors_are_read_in_pieces(pretrained, monkeypatch):
    """With a piece of 256 bytes every matrix crosses in several pieces; the result is the same."""
    monkeypatch.setattr(safetensors_source, "CHUNK_BYTES", 256)
    engine = MegatrainEngine(
        _meta_llama("torch.device"), parse_engine_config(ds_config(megatrain={"load_from": str(pretrained)}))
    )
    try:
        files = {}
        for path in pretrained.glob("model-*.safetensors"):
            files.update(load_file(path))
        state = engine.module.state_dict()
        for name, value in files.items():
            assert torch.equal(state[name], value.float()), name
    finally:
        engine.destroy()


def test_missing_tensor_names_it_and_the_directory(tmp_path):
    source = tiny_models.llama()
    tensors = {n: t.contiguous() for n, t in source.state_dict().items() if n != "model.layers.2.mlp.up_proj.weight"}
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        ValueError,
        match=rf"{tmp_path} has no tensor 'model.layers.2.mlp.up_proj.weight' "
        r"\(this model's has shape \[48, 32\]\)",
    ):
        MegatrainEngine(
            _meta_llama("torch.device"), parse_engine_config(ds_config(megatrain={"load_from": str(tmp_path)}))
        )


def test_wrong_shape_names_the_tensor_and_both_shapes(tmp_path):
    config = transformers.LlamaConfig(**{**tiny_models._common(4), "intermediate_size": 40})
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    with pytest.raises(
        ValueError,
        match=r"tensor 'model.layers.0.mlp.gate_proj.weight': model.safetensors in .* "
        r"has shape \[40, 32\], this model has \[48, 32\]",
    ):
        MegatrainEngine(
            _meta_llama("torch.device"), parse_engine_config(ds_config(megatrain={"load_from": str(tmp_path)}))
        )


def test_meta_model_without_load_from_is_rejected():
    with pytest.raises(ConfigError, match=r"parameter model.embed_tokens.weight is on the meta device.*load_from"):
        MegatrainEngine(_meta_llama("torch.device"), parse_engine_config(ds_config()))


def test_load_from_must_be_a_directory_of_safetensors(tmp_path):
    with pytest.raises(ConfigError, match=r"megatrain.load_from: .*missing is not a directory"):
        MegatrainEngine(
            _meta_llama("torch.device"),
            parse_engine_config(ds_config(megatrain={"load_from": str(tmp_path / "missing")})),
        )
    with pytest.raises(ConfigError, match=r"has no model.safetensors.index.json, model.safetensors"):
        MegatrainEngine(
            _meta_llama("torch.device"), parse_engine_config(ds_config(megatrain={"load_from": str(tmp_path)}))
        )


def test_unused_tensors_are_reported(tmp_path, caplog):
    source = tiny_models.llama()
    tensors = {n: t.contiguous() for n, t in source.state_dict().items()}
    tensors["model.layers.9.extra.weight"] = torch.zeros(3)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level(logging.WARNING):
        engine = MegatrainEngine(
            _meta_llama("init_empty_weights"), parse_engine_config(ds_config(megatrain={"load_from": str(tmp_path)}))
        )
    engine.destroy()
    assert "has 1 tensor(s) this model does not use: model.layers.9.extra.weight" in caplog.text
