"""LoRA (peft) and other frozen weights: trained like plain PyTorch, held at their own size.

A frozen parameter (``requires_grad=False``) costs its weights alone, in its own dtype, in
one process with its state in host memory (``state/host_store.py``: [Note: frozen weights]):
no master beside a bf16 shadow (when it arrives in bf16), no Adam moments, no gradient
buffer, no journal slot, and backward computes no gradient for it. With the weights on the
NVMe tier (``"nvme_offload": "all"``) a block's frozen weights are a read-only file of their
own, in their dtype, never written back (``state/frozen_files.py``).
"""

import copy
import math
import os

import pytest
import tiny_models
import torch
from placement_check import placement_disagreements, planner_disagreements, preflight_disagreements
from safetensors import safe_open
from side_by_side import LR, WEIGHT_DECAY, ds_config, relative_weight_error, train_side_by_side

from megatrain_ds import MegatrainEngine, parse_engine_config
from megatrain_ds.cli import shape_of
from megatrain_ds.optimizer.facade import build_optimizer
from megatrain_ds.planning import preflight
from megatrain_ds.planning.planner import RunSettings, host_bytes

peft = pytest.importorskip("peft")

pytestmark = pytest.mark.usefixtures("cpu_single_thread")


def lora_llama(
    frozen_dtype: torch.dtype = torch.float32, seed: int = 0, layers: tuple[int, ...] | None = None
) -> torch.nn.Module:
    """A tiny Llama with peft's LoRA (r=4) on q_proj and v_proj (of the blocks ``layers`` alone,
    peft's ``layers_to_transform``, where given): every base weight frozen. lora_B starts at
    zero in peft (the adapted model equals the base); random here, so that lora_A gets
    gradients from the first step. Frozen weights cast to ``frozen_dtype``."""
    torch.manual_seed(seed)
    config = peft.LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj"],
        lora_dropout=0.0,
        layers_to_transform=list(layers) if layers is not None else None,
    )
    model = peft.get_peft_model(tiny_models.llama(), config)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.02)
        if not param.requires_grad:
            param.data = param.data.to(frozen_dtype)
    return model


def _frozen(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: param.detach().clone() for name, param in model.named_parameters() if not param.requires_grad}


def _assert_matches_reference(engine, reference, trace) -> None:
    """test_parity.py's tolerances: 1e-5 relative per loss and norm, 2e-6 relative weight error."""
    for ours, theirs in zip(trace.engine_losses, trace.reference_losses):
        assert math.isclose(ours, theirs, rel_tol=1e-5)
    for ours, theirs in zip(trace.engine_norms, trace.reference_norms):
        assert math.isclose(ours, theirs, rel_tol=1e-5)
    assert relative_weight_error(engine, reference) < 2e-6


def _assert_frozen_unchanged(engine: MegatrainEngine, frozen: dict[str, torch.Tensor]) -> None:
    state = engine.module.state_dict()
    for name, value in frozen.items():
        assert state[name].dtype == value.dtype and torch.equal(state[name], value), name


def _assert_trained_only_buffers(engine: MegatrainEngine) -> None:
    """Moments and gradients of every state cover its trained prefix alone."""
    for state in engine.states:
        trained = state.layout.trained_numel
        assert trained < state.layout.numel  # every state has frozen parameters (the resident ones all)
        assert state.exp_avg.numel() == state.exp_avg_sq.numel() == trained
        assert state.grad is not None and state.grad.numel() == trained


def _swap(nvme: str, path) -> dict:
    """The ``"megatrain"`` keys of an NVMe level (the thread pool: the alignment preflight assumes)."""
    if nvme == "none":
        return {}
    return {"nvme_offload": nvme, "nvme_path": str(path), "nvme_window_blocks": 2, "nvme_aio": {"engine": "threads"}}


@pytest.mark.parametrize("nvme", ["none", "all"])
def test_fp32_lora_matches_plain_pytorch_with_accumulation_and_clipping(nvme, tmp_path):
    """Tolerances as tests/test_parity.py (fp32, the same matmuls, norm summed per block):
    1e-5 relative per-step loss and norm, 2e-6 global relative weight error after 5 steps.
    The loss is the chunked one, in chunks of 5 tokens, through peft's wrapper
    (``causal_lm_inside``), against the reference's own Hugging Face loss. With the weights
    on the NVMe tier, the frozen fp32 base weights are read from files of their own, every
    block's 12 times in 3 steps (fewer steps: this variant also runs under the race checker)."""
    frozen = _frozen(lora_llama())
    config = ds_config(accumulation=2, clipping=1.0, megatrain={"loss_chunk_tokens": 5, **_swap(nvme, tmp_path)})
    engine, reference, trace = train_side_by_side(lora_llama, config, steps=3 if nvme == "all" else 5)
    try:
        assert engine.causal_loss is not None
        _assert_matches_reference(engine, reference, trace)
        _assert_frozen_unchanged(engine, frozen)
        _assert_trained_only_buffers(engine)
        if nvme == "all":
            _assert_frozen_apart_on_the_tier(engine, torch.float32)
        for state in engine.states[-1:] if nvme == "all" else engine.states:
            # fp32 compute: the master is what is streamed, whole, where it is in host memory
            assert state.shadow is None and state.master.numel() == state.layout.numel
    finally:
        engine.destroy()


def test_fp32_lora_with_states_on_the_device_matches_plain_pytorch():
    """The GPU tier (the default on a GPU, ``"auto"``) with frozen weights: the resident state
    and the first blocks on the "device" (Triton's interpreter here), their moments and held
    gradients the trained prefix's alone, the frozen weights untouched; test_parity.py's
    tolerances (the tier's kernel rounds < 1 ulp per step: tests/test_device_state.py)."""
    frozen = _frozen(lora_llama())
    config = ds_config(accumulation=2, clipping=1.0, megatrain={"device_state": 0.6})
    engine, reference, trace = train_side_by_side(lora_llama, config, steps=3)
    try:
        on_device = engine.placement.device_indices
        assert 0 < len(on_device) < len(engine.states)
        _assert_matches_reference(engine, reference, trace)
        _assert_frozen_unchanged(engine, frozen)
        _assert_trained_only_buffers(engine)
    finally:
        engine.destroy()


def _assert_frozen_apart_on_the_tier(
    engine: MegatrainEngine, dtype: torch.dtype, written: dict[str, int] | None = None
) -> dict[str, int]:
    """With the weights on the NVMe tier: each block's swap file holds its trained prefix's
    master, m and v alone, its frozen weights a file of their own at ``dtype``'s size (padded
    to the alignment); the host holds no master, moment or gradient element of them. Returns
    the frozen files' modification times; with ``written`` (those after construction), checks
    that training wrote none of them (the tier's window written back first)."""
    tier = engine.nvme_tier
    assert tier is not None and engine.nvme_weights is not None
    alignment = tier.io.alignment
    files = tier.directory.files
    for index, state in enumerate(engine.states[:-1]):
        trained, numel = state.layout.trained_numel, state.layout.numel
        assert state.frozen is not None and state.frozen.is_meta and state.frozen.dtype == dtype
        assert state.frozen.numel() == numel - trained and state.shadow is None
        assert state.exp_avg.numel() == state.exp_avg_sq.numel() == state.master.numel() == trained
        assert state.grad is not None and state.grad.numel() == trained
        padded = -(-4 * trained // alignment) * alignment
        assert os.path.getsize(files[f"block{index:05d}.swap"]) == 3 * padded
        frozen_file = files[f"block{index:05d}.frozen"]
        frozen_bytes = (numel - trained) * dtype.itemsize
        assert os.path.getsize(frozen_file) == -(-frozen_bytes // alignment) * alignment
    assert tier.numels == [state.layout.trained_numel for state in engine.states[:-1]]
    if written is not None:
        engine.settle_optimizer()
        tier.flush()  # every changed block written back: its swap file, never its frozen weights
    mtimes = {name: os.stat(path).st_mtime_ns for name, path in files.items() if name.endswith(".frozen")}
    assert len(mtimes) == len(engine.states) - 1 and mtimes == (written or mtimes)
    return mtimes


def test_the_chunked_loss_looks_through_peft_wrappers_that_keep_the_inputs():
    """LoRA hands a labelled call to the causal LM inside unchanged: its loss can be chunked.
    Prompt tuning prepends virtual tokens and pads the labels to match, so it is not looked
    through, and a chunked loss is refused (``"auto"`` leaves the loss to the model)."""
    from megatrain_ds.model.causal_lm_loss import causal_lm_inside, unsupported_reason

    lora = lora_llama()
    assert causal_lm_inside(lora) is lora.get_base_model() and unsupported_reason(lora) is None
    prompt = peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=2)
    tuned = peft.get_peft_model(tiny_models.llama(), prompt)
    assert causal_lm_inside(tuned) is tuned and unsupported_reason(tuned) is not None


def _train(engine: MegatrainEngine, steps: int, first: int = 0, accumulation: int = 2) -> list[float]:
    losses = []
    for micro in range(first * accumulation, (first + steps) * accumulation):
        loss = engine(**tiny_models.make_batch(micro)).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize(
    "frozen_dtype, nvme", [(torch.bfloat16, "none"), (torch.float32, "optimizer")], ids=["bf16", "fp32-optimizer"]
)
def test_bf16_lora_tracks_fp32_training_and_holds_frozen_weights_once(frozen_dtype, nvme, tmp_path):
    """bf16 compute, adapters fp32. The reference is the same model in fp32 (the frozen
    values exactly), trained by torch.optim.AdamW with clip_grad_norm_. Tolerances as
    tests/test_bf16.py: bf16 compute rounds relatively 2^-9 per value, so per-step losses
    agree to ~1e-4 and the weights after a few steps to ~1e-3: we allow 1e-3 and 5e-3.
    Frozen weights in bf16 are held in the streamed bf16 shadow alone, bit for bit, and the
    fp32 master covers only the adapters. An fp32 base with the optimizer state on the NVMe
    tier (the blocks' fp32 master cut onto it, issue 44): its frozen weights are held once
    in fp32, exact, apart in host memory, the shadow streaming their rounding; no master,
    moment, gradient or swap-file byte of them (:func:`_assert_fp32_frozen_apart`)."""
    model = lora_llama(frozen_dtype)
    frozen = _frozen(model)
    reference = copy.deepcopy(model).float()
    planned = host_bytes(shape_of(model), RunSettings(seq_len=12, micro_batch=2, accumulation=2))
    config = parse_engine_config(ds_config(accumulation=2, clipping=1.0, bf16=True, megatrain=_swap(nvme, tmp_path)))
    estimated = preflight.preflight(
        preflight.PreflightInputs(model, config, _optimizer(model, config), torch.device("cpu"), 1 << 20), nvme=nvme
    )
    trainable = [p for p in reference.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=LR, weight_decay=WEIGHT_DECAY)
    engine = MegatrainEngine(model, config)
    try:
        losses = _train(engine, 3)
        for step in range(3):
            for micro in range(2):
                reference_loss = reference(**tiny_models.make_batch(step * 2 + micro)).loss
                (reference_loss / 2).backward()
                assert math.isclose(losses[step * 2 + micro], reference_loss.item(), rel_tol=1e-3)
            torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
        ours = engine.module.state_dict()
        trained = [name for name, p in reference.named_parameters() if p.requires_grad]
        diff = sum(((ours[n].double() - reference.state_dict()[n].double()) ** 2).sum() for n in trained)
        norm = sum((reference.state_dict()[n].double() ** 2).sum() for n in trained)
        assert float((diff / norm).sqrt()) < 5e-3
        _assert_frozen_unchanged(engine, frozen)
        _assert_trained_only_buffers(engine)
        if nvme != "none":
            _assert_fp32_frozen_apart(engine, estimated)
            return
        for state in engine.states:
            assert state.placement.frozen_in == "shadow" and state.master.numel() == state.layout.trained_numel
            assert state.shadow is not None and state.shadow.numel() == state.layout.numel
        _assert_host_bytes_per_param(engine, model)
        _assert_accounting_agrees(engine, planned, estimated)
    finally:
        engine.destroy()


def _assert_fp32_frozen_apart(engine: MegatrainEngine, estimated: preflight.MemoryNeed) -> None:
    """fp32 frozen weights under bf16 compute with the optimizer state on the NVMe tier: each
    block's frozen weights apart in host memory in fp32, their rounding in its whole bf16
    shadow, its swap file its trained prefix's master, m and v alone (no master, moment,
    gradient or swap byte of a frozen element); the resident state (in host memory) keeps
    them in its whole fp32 master. 6 B a frozen parameter of the blocks: 4 apart, 2 in the
    shadow. The placement, preflight and the planner count what the engine holds."""
    assert placement_disagreements(engine) == [] and planner_disagreements(engine) == []
    assert preflight_disagreements(engine, estimated) == []
    tier = engine.nvme_tier
    assert tier is not None
    apart = 0
    for index, state in enumerate(engine.states[:-1]):
        trained, numel = state.layout.trained_numel, state.layout.numel
        assert state.placement.frozen_in == "frozen" and state.frozen is not None and state.frozen_for_tier is None
        assert state.frozen.dtype == torch.float32 and state.frozen.numel() == numel - trained
        assert state.shadow is not None and torch.equal(state.shadow[trained:], state.frozen.bfloat16())
        assert state.master.is_meta and state.master.numel() == trained  # on the tier, the trained prefix's
        padded = -(-4 * trained // tier.io.alignment) * tier.io.alignment
        assert os.path.getsize(tier.directory.files[f"block{index:05d}.swap"]) == 3 * padded
        apart += numel - trained
    assert not any(name.endswith(".frozen") for name in tier.directory.files)
    resident = engine.states[-1]
    assert resident.placement.frozen_in == "master" and resident.master.numel() == resident.layout.numel
    host = engine.host_bytes()
    assert host["frozen"] == 4 * apart
    assert host["master"] == 4 * resident.layout.numel and host["grad"] == 4 * sum(
        state.layout.trained_numel for state in engine.states
    )


def _assert_host_bytes_per_param(engine: MegatrainEngine, model: torch.nn.Module) -> None:
    """Kind by kind from the layouts (trained prefix: fp32 master, m, v and fp32 gradient,
    as accumulation holds them; every element: the bf16 shadow), and per parameter against
    the theoretical 16 B per trained and 2 B per frozen parameter (within the alignment
    padding: 64-element slots, the tiny model's norms are 32 wide)."""
    host = engine.host_bytes()
    trained = sum(state.layout.trained_numel for state in engine.states)
    numel = sum(state.layout.numel for state in engine.states)
    assert host["master"] == host["exp_avg"] == host["exp_avg_sq"] == host["grad"] == 4 * trained
    assert host["shadow"] == 2 * numel
    params = list(model.parameters())
    theory = sum(16 * p.numel() if p.requires_grad else 2 * p.numel() for p in params)
    state_bytes = sum(nbytes for kind, nbytes in host.items() if kind != "journal")
    assert theory <= state_bytes <= 1.05 * theory
    # The journal (speculative steps) holds trained elements only: 14 B each at most.
    assert host.get("journal", 0) <= 14 * trained


def _optimizer(model: torch.nn.Module, config) -> torch.optim.Optimizer:
    return build_optimizer(model, None, config.optimizer, None)


def _assert_accounting_agrees(engine: MegatrainEngine, planned: dict[str, int], estimated) -> None:
    """The planner (``megatrain plan``) and the preflight check count what the engine holds:
    the planner exactly for the trained-only kinds (the adapters' slots need no padding
    here), the preflight exactly up to the page each host buffer is over-allocated by."""
    host = engine.host_bytes()
    assert planned["master"] == host["master"] and planned["gradients"] == host["grad"]
    assert planned["adam_m_v"] == host["exp_avg"] + host["exp_avg_sq"]
    assert planned.get("journal", 0) == host.get("journal", 0)
    pages = len(engine.states) * preflight.PAGE_BYTES
    for kind, measured in (("master", host["master"]), ("shadow", host["shadow"]), ("gradients", host["grad"])):
        assert measured <= estimated.host[kind] <= measured + pages, kind
    assert host["exp_avg"] * 2 <= estimated.host["adam_m_v"] <= host["exp_avg"] * 2 + 2 * pages
    assert estimated.host.get("journal", 0) == host.get("journal", 0)


@pytest.mark.parametrize(
    "nvme, frozen_dtype",
    [("none", torch.bfloat16), ("optimizer", torch.bfloat16), ("all", torch.bfloat16), ("optimizer", torch.float32)],
    ids=["none", "optimizer", "all", "optimizer-fp32"],
)
def test_frozen_weights_are_saved_once_in_their_dtype_and_resume_exactly(tmp_path, nvme, frozen_dtype):
    """Train 2 steps, save, train 2 more; a second engine (other adapter initialisation)
    loads the checkpoint and trains the same 2 steps: identical losses and host state, bit
    for bit (same ops on the same values). The model file holds each frozen weight once, in
    bf16; the optimizer file holds nothing of them. With the optimizer state on the NVMe
    tier (issue 44) its swap files hold the blocks' trained prefixes alone (fp32 master, m
    and v of the adapters), the frozen weights stay in the bf16 shadow, and the state the
    two engines hold is compared through ``state_dict()`` and the tier's files. With the
    weights on the tier too the blocks' frozen weights are files of their own, in bf16 (2 B
    each), never written after construction; the second engine starts from other frozen
    weights, which the load overwrites (in its shadow, or in its frozen files). An fp32 base
    with the optimizer state on the tier: its frozen weights saved once, in fp32, read back
    exactly into their buffer apart in host memory, and their rounding into the shadow."""
    config = ds_config(accumulation=2, clipping=1.0, bf16=True, megatrain=_swap(nvme, tmp_path / "swap"))
    model = lora_llama(frozen_dtype)
    frozen = _frozen(model)
    engine = MegatrainEngine(model, parse_engine_config(config))
    try:
        written = _assert_frozen_apart_on_the_tier(engine, torch.bfloat16) if nvme == "all" else None
        _train(engine, 2)
        engine.save_checkpoint(tmp_path, tag="step2")
        losses = _train(engine, 2, first=2)
        _assert_frozen_unchanged(engine, frozen)
        engine.save_checkpoint(tmp_path, tag="adapters", exclude_frozen_parameters=True)
        if written is not None:
            _assert_frozen_apart_on_the_tier(engine, torch.bfloat16, written)
        torch.manual_seed(1)
        other_model = lora_llama(frozen_dtype)
        for param in other_model.parameters():
            # Other adapters, and other frozen weights: the checkpoint's are read in over them.
            torch.nn.init.normal_(param, std=0.05)
        other = MegatrainEngine(other_model, parse_engine_config(config))
        try:
            other.load_checkpoint(tmp_path, tag="step2")
            assert _train(other, 2, first=2) == losses
            engine.settle_optimizer(), other.settle_optimizer()  # the host state is read directly
            _assert_same_state(engine, other)
            _assert_frozen_unchanged(other, frozen)
        finally:
            other.destroy()
    finally:
        engine.destroy()
    with safe_open(str(tmp_path / "step2" / "model-00001-of-00001.safetensors"), "pt") as weights:
        dtypes = {name: weights.get_slice(name).get_dtype() for name in weights.keys()}  # noqa: SIM118 (not a dict)
    with safe_open(str(tmp_path / "step2" / "optimizer-00001-of-00001.safetensors"), "pt") as moments:
        saved = {name.rsplit(".", 1)[0] for name in moments.keys()}  # noqa: SIM118 (not a dict)
    saved_as = "BF16" if frozen_dtype == torch.bfloat16 else "F32"
    assert {name: dtypes[name] for name in frozen} == {name: saved_as for name in frozen}
    assert all(dtypes[name] == "F32" for name in dtypes if "lora_" in name)
    assert saved and all("lora_" in name for name in saved)
    with safe_open(str(tmp_path / "adapters" / "model-00001-of-00001.safetensors"), "pt") as adapters:
        assert {name for name in adapters.keys() if "lora_" not in name} == set()  # noqa: SIM118 (not a dict)


def _assert_same_state(engine: MegatrainEngine, other: MegatrainEngine) -> None:
    """The two engines' masters, shadows and moments are equal bit for bit, in host memory or
    in the NVMe tier's files (whose blocks hold their trained prefix alone; a block with
    nothing trained has none there unless its frozen weights are)."""
    ours, theirs = engine.module.state_dict(), other.module.state_dict()
    assert all(torch.equal(value, theirs[name]) for name, value in ours.items())
    for mine, its in zip(engine.states, other.states):
        if mine.shadow is not None or its.shadow is not None:  # none with the weights on the tier
            assert mine.shadow is not None and its.shadow is not None and torch.equal(mine.shadow, its.shadow)
        if mine.frozen is not None and mine.frozen_for_tier is None:  # apart in host memory (fp32, exact)
            assert its.frozen is not None and torch.equal(mine.frozen, its.frozen)
    if engine.nvme_tier is None or other.nvme_tier is None:
        for mine, its in zip(engine.states, other.states):
            for kind in ("master", "exp_avg", "exp_avg_sq"):
                assert torch.equal(getattr(mine, kind), getattr(its, kind)), kind
        return
    tier = engine.nvme_tier
    assert tier.numels == [state.layout.trained_numel for state in engine.states[:-1] if tier.holds(state)]
    with tier.file_views() as on_mine, other.nvme_tier.file_views() as on_its:
        for mine, its in zip(engine.states[:-1], other.states[:-1]):
            files, other_files = on_mine(mine), on_its(its)
            if files is None:  # a block with nothing trained, its weights in host memory: nothing on the tier
                assert other_files is None and mine.layout.trained_numel == 0 and engine.placement.nvme != "all"
                assert torch.equal(mine.master, its.master) and mine.exp_avg.numel() == 0
                continue
            assert other_files is not None
            for kind in ("master", "exp_avg", "exp_avg_sq"):
                assert files[kind].numel() == mine.layout.trained_numel
                assert torch.equal(files[kind], other_files[kind]), kind
            assert ("frozen" in files) == ("frozen" in other_files) == (engine.placement.nvme == "all")
            if "frozen" in files:  # the frozen weights apart, in their dtype, read in by the load
                assert mine.frozen is not None and files["frozen"].dtype == mine.frozen.dtype
                assert torch.equal(files["frozen"], other_files["frozen"])


def test_parameters_in_no_optimizer_group_are_frozen_though_they_require_grad():
    """A client optimizer over q_proj and the final norm only: every other parameter still
    requires grad (the embedding and lm_head's gradients reach their hooks) yet is frozen:
    unchanged, with no optimizer state (an out-of-range gradient would fail the step)."""
    torch.manual_seed(0)
    model = tiny_models.llama()
    trained = {n for n, _ in model.named_parameters() if "q_proj" in n or n == "model.norm.weight"}
    params = [p for n, p in model.named_parameters() if n in trained]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    config = ds_config(accumulation=2, clipping=1.0)
    del config["optimizer"]
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    engine = MegatrainEngine(model, parse_engine_config(config), model_parameters=params, optimizer=optimizer)
    try:
        _train(engine, 2)
        state = engine.module.state_dict()
        assert {n for n in before if not torch.equal(state[n], before[n])} == trained
        _assert_trained_only_buffers(engine)
    finally:
        engine.destroy()


def llama_with_frozen_embedding() -> torch.nn.Module:
    """Full fine-tuning of a tiny Llama whose input embedding and first block's MLP are
    frozen (``requires_grad=False``): one frozen resident parameter, frozen slots in a block."""
    model = tiny_models.llama()
    model.get_input_embeddings().weight.requires_grad_(False)
    model.model.layers[0].mlp.requires_grad_(False)
    return model


def test_frozen_parameters_in_full_fine_tuning_cost_their_weights_alone():
    """Frozen parameters of a fully fine-tuned fp32 model: trained as plain PyTorch trains
    them (torch.optim.AdamW skips a parameter without a gradient; tolerances as the fp32 LoRA
    test above: the same matmuls, 1e-5 relative per-step loss and norm, 2e-6 weights), left
    bit for bit as they were, and given no optimizer state: the moments and gradients of the
    resident state and of block 0 stop at their trained prefix, past which the frozen slots lie."""
    torch.manual_seed(0)
    frozen = _frozen(llama_with_frozen_embedding())
    config = ds_config(accumulation=2, clipping=1.0)
    engine, reference, trace = train_side_by_side(llama_with_frozen_embedding, config)
    try:
        _assert_matches_reference(engine, reference, trace)
        _assert_frozen_unchanged(engine, frozen)
        for index, state in enumerate(engine.states):  # the blocks', then the resident parameters'
            trained = state.layout.trained_numel
            assert state.exp_avg.numel() == state.exp_avg_sq.numel() == trained
            assert state.grad is not None and state.grad.numel() == trained
            frozen_slots = [slot for slot, param in zip(state.layout.slots, state.params) if not param.requires_grad]
            assert all(slot.offset >= trained for slot in frozen_slots)
            has_frozen = index in (0, len(engine.states) - 1)  # block 0's MLP, the embedding
            assert (trained < state.layout.numel) == has_frozen == bool(frozen_slots)
        trained_elements = sum(state.layout.trained_numel for state in engine.states)
        host = engine.host_bytes()
        assert host["exp_avg"] == host["exp_avg_sq"] == host["grad"] == 4 * trained_elements
        assert trained_elements < sum(p.numel() for p in reference.parameters() if p.requires_grad) * 1.05
    finally:
        engine.destroy()


@pytest.mark.parametrize("nvme", ["none", "optimizer"])
def test_frozen_weights_cast_to_the_compute_dtype_train_as_the_model_cast_by_hand(tmp_path, nvme):
    """``"frozen_weights": "compute_dtype"``: an fp32 LoRA base under bf16 compute is cast to
    bf16 once, in place, before the engine reads the model. The reference is the engine on
    the same model cast to bf16 by hand (default ``"exact"``, nothing left to cast): the same
    ops on the same values, so losses and weights agree bit for bit. The frozen weights then
    cost 2 B each, in the streamed shadow alone (no fp32 master of them), stay the rounded
    originals bit for bit, and the model's own parameters are those. With the optimizer state
    on the NVMe tier (the fp32 master cut), where an exact fp32 frozen weight gives its state
    every buffer, each block's swap files hold its trained prefix alone. The planner, fed the
    uncast model with ``frozen_weights="compute_dtype"``, and preflight count what the engine holds."""
    rounded = {name: value.to(torch.bfloat16) for name, value in _frozen(lora_llama()).items()}
    swap = _swap(nvme, tmp_path / "cast")
    cast_config = parse_engine_config(ds_config(bf16=True, megatrain={**swap, "frozen_weights": "compute_dtype"}))
    by_hand_config = parse_engine_config(ds_config(bf16=True, megatrain=_swap(nvme, tmp_path / "by_hand")))
    model, by_hand_model = lora_llama(), lora_llama(torch.bfloat16)
    planned = host_bytes(
        shape_of(model), RunSettings(seq_len=12, micro_batch=2, nvme=nvme != "none", frozen_weights="compute_dtype")
    )
    estimated = preflight.preflight(
        preflight.PreflightInputs(
            by_hand_model, by_hand_config, _optimizer(by_hand_model, by_hand_config), torch.device("cpu"), 1 << 20
        ),
        nvme=nvme,
    )
    engine = MegatrainEngine(model, cast_config)
    by_hand = MegatrainEngine(by_hand_model, by_hand_config)
    try:
        assert _train(engine, 2, accumulation=1) == _train(by_hand, 2, accumulation=1)
        ours, theirs = engine.module.state_dict(), by_hand.module.state_dict()
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[name], theirs[name]) for name in theirs)
        _assert_frozen_unchanged(engine, rounded)
        assert all(p.dtype == torch.bfloat16 for p in model.parameters() if not p.requires_grad)
        for state in engine.states:
            assert state.placement.frozen_in == "shadow"
            assert state.shadow is not None and state.shadow.numel() == state.layout.numel
        host = engine.host_bytes()
        assert host == by_hand.host_bytes()
        assert host["shadow"] == 2 * sum(state.layout.numel for state in engine.states)
        trained = [state.layout.trained_numel for state in engine.states]
        assert host["master"] == 4 * (trained[-1] if nvme == "optimizer" else sum(trained))
        assert planned["master"] == host["master"] and planned["adam_m_v"] == host["exp_avg"] + host["exp_avg_sq"]
        for kind, measured in (("master", host["master"]), ("shadow", host["shadow"])):
            assert measured <= estimated.host[kind] <= measured + len(engine.states) * preflight.PAGE_BYTES, kind
        if nvme == "optimizer":
            assert engine.nvme_tier is not None and engine.nvme_tier.numels == trained[:-1]
    finally:
        engine.destroy()
        by_hand.destroy()
