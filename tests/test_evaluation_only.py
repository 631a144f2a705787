"""The evaluation-only engine under every placement and precision: one process, 2 ranks, 2 nodes.

``deepspeed.initialize(model=..., config=...)`` with no optimizer, no ``"optimizer"`` block
and no ``model_parameters`` -- what the HF Trainer's ``evaluate()`` before ``train()`` calls
(``integration/deepspeed_hook.py``: [Note: evaluation before training]) -- builds an engine
that holds every weight as a frozen one (optimizer/facade.py: [Note: evaluation-only
engines]). ``tests/test_deepspeed_adapter.py`` checks its answers in one process, fp32, in
host memory; here the rest: the NVMe tier holding nothing (``"optimizer"``: no optimizer
state to put there, so no tier is opened) or the weights (``"all"``), bf16 and fp16 compute,
and data parallel: one node of 2 ranks and 2 bf16 nodes, each a forked launch of
``tests/eval_only_worker.py`` building its placements in turn (together about 5 s); and
the same ``"optimizer"`` rule for a training run whose blocks are all frozen.

Reference: plain PyTorch on the same weights, the parameters cast to the compute dtype and
the buffers kept, as the engine holds them -- and as DeepSpeed's own ZeRO-3 engine built
without an optimizer evaluates (checked with DeepSpeed 0.19.8 on this CPU, 2026-11-28: it
casts the module to fp16 or bf16, ``module.half()``/``bfloat16()``, returns its parameter
offload object as the optimizer, and its evaluation loss of a tiny Llama was bit-equal to
this engine's in both precisions; not run here: it needs a process group of its own).
Evaluation runs the model's forward unchanged (``eval()`` and ``no_grad``: the chunked loss
of ``model/causal_lm_loss.py`` is for labelled training calls alone), each block's modules
on the weights in the compute dtype -- the same ops on the same values in the same shapes
as the reference's, so the losses are bit-equal (with ``"all"`` the fp32 weights are rounded
as they are read from the tier: the same round-to-nearest as the reference's cast).
Memory: the weights alone (no moment, no held gradient, no NVMe window), and the engine's
buffers agree with its placement, preflight's estimate (read from the model, before the
build) and the planner's.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import tiny_models
import torch
from eval_only_worker import EVAL_SEEDS, PLACEMENTS
from placement_check import node_preflight_disagreements, placement_disagreements, planner_disagreements
from placement_check import preflight_disagreements as engine_preflight_disagreements
from test_data_parallel import launch, launch_nodes

from megatrain_ds import parse_engine_config
from megatrain_ds.engine import STAGING_CHUNK_ELEMENTS
from megatrain_ds.optimizer.facade import MegatrainOptimizer
from megatrain_ds.planning import preflight

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
WORKER = Path(__file__).resolve().parent / "eval_only_worker.py"


def cast_like_the_engine(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """A deep copy of ``model`` in ``eval()`` with its parameters (not its buffers) in ``dtype``."""
    reference = copy.deepcopy(model).eval()
    for param in reference.parameters():
        param.data = param.data.to(dtype)
    return reference


def _no_optimizer_state(host: dict[str, int]) -> None:
    assert host["exp_avg"] == host["exp_avg_sq"] == host["grad"] == host.get("nvme_window", 0) == 0, host


def _config(nvme: str, precision: str, swap: Path) -> dict:
    settings = {"engine": "megatrain", "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0}
    if precision != "fp32":
        settings[precision] = {"enabled": True}
    if nvme != "none":
        settings["megatrain"] = {"nvme_offload": nvme, "nvme_path": str(swap), "nvme_aio": {"engine": "threads"}}
    return settings


@pytest.mark.parametrize("precision", list(DTYPES))
@pytest.mark.parametrize("nvme", ["none", "optimizer", "all"])
def test_one_process_evaluates_as_pytorch_and_holds_the_weights_alone(
    nvme: str, precision: str, tmp_path: Path, cpu_single_thread: None
) -> None:
    """Every NVMe level and precision: the losses bit-equal to plain PyTorch's on the
    parameters cast to the compute dtype (see the module's docstring), the weights alone in
    memory, the placement, preflight and the planner in agreement; ``"optimizer"`` opens no
    tier (there is no optimizer state), ``"all"`` holds the blocks' weights on it, apart, and
    its swap files of optimizer state are empty; the state dict is the weights as given."""
    import deepspeed

    torch.manual_seed(0)
    model = tiny_models.llama(num_layers=2)
    reference = cast_like_the_engine(model, DTYPES[precision])
    given = {key: value.clone() for key, value in model.state_dict().items()}
    settings = _config(nvme, precision, tmp_path / "swap")
    # Preflight reads the model before the build (the engine takes its parameters over), with
    # the optimizer the engine builds for this call.
    run = preflight.PreflightInputs(
        model,
        parse_engine_config(settings),
        MegatrainOptimizer.for_evaluation(),
        torch.device("cpu"),
        STAGING_CHUNK_ELEMENTS,
    )
    resolved = preflight.wants_nvme_tier(run)
    need = preflight.preflight(run, available=preflight.AvailableMemory(host=1 << 50), nvme=resolved)
    engine, *_ = deepspeed.initialize(model=model, config=settings)
    try:
        assert resolved == engine.placement.nvme == ("none" if nvme == "optimizer" else nvme)
        assert (engine.nvme_tier is not None) is (nvme == "all") is (tmp_path / "swap").exists()
        assert placement_disagreements(engine) == []
        assert engine_preflight_disagreements(engine, need) == []
        assert planner_disagreements(engine) == []
        _no_optimizer_state(engine.host_bytes())
        if nvme == "all":  # the tier: the blocks' weights apart, no byte of optimizer state
            tier = engine.placement.tier
            assert tier is not None and set(tier.numels) == {0} and all(tier.frozen_numels)
        engine.eval()
        for seed in (0, 1):
            batch = tiny_models.make_batch(seed)
            with torch.no_grad():
                ours, theirs = engine(**batch).loss, reference(**batch).loss
            assert torch.equal(ours, theirs), (float(ours), float(theirs))
        state = engine.module.state_dict()
        assert state.keys() == given.keys() and all(torch.equal(state[key], value) for key, value in given.items())
    finally:
        engine.destroy()


def _reference_losses(world_size: int) -> dict[str, list[list[torch.Tensor]]]:
    """Plain PyTorch's loss of every rank's rows of each global batch, per precision, on
    rank 0's weights (the engine keeps the first node's)."""
    from data_parallel_worker import MICRO, global_batch

    torch.manual_seed(0)
    model = tiny_models.llama(num_layers=4)
    losses: dict[str, list[list[torch.Tensor]]] = {}
    for precision, dtype in DTYPES.items():
        reference = cast_like_the_engine(model, dtype)
        per_rank: list[list[torch.Tensor]] = [[] for _ in range(world_size)]
        for seed in EVAL_SEEDS:
            batch = global_batch(seed, MICRO * world_size)
            for rank in range(world_size):
                with torch.no_grad():
                    rows = {key: value[rank * MICRO : (rank + 1) * MICRO] for key, value in batch.items()}
                    per_rank[rank].append(reference(**rows).loss.float())
        losses[precision] = per_rank
    return losses


def _assert_evaluated(out: Path, placements: tuple[str, ...], world_size: int) -> list[list[dict]]:
    """The checks every rank's report of ``eval_only_worker.py`` passes (see the tests'
    docstrings), for ``placements`` in launch order; returns the reports, placement by placement."""
    assert placements[-1].startswith("all") and not list((out / "swap").iterdir())  # closed at exit too
    torch.manual_seed(0)
    given = tiny_models.llama(num_layers=4).state_dict()
    expected_losses = _reference_losses(world_size)
    reports = {
        p: [torch.load(out / f"{p}.rank{r}.pt", weights_only=False) for r in range(world_size)] for p in placements
    }
    for placement, ranks in reports.items():
        level, _, precision = placement.partition("-")
        for rank, report in enumerate(ranks):
            where = (placement, rank)
            assert report["returned"] == (None, None), where
            assert report["disagreements"] == [], (where, report["disagreements"])
            _no_optimizer_state(report["host_bytes"])
            assert report["nvme"] == ("all" if level == "all" else "none"), where
            # Gathered from the ranks' windows on the tier; else every node holds the weights whole.
            assert report["tier"] is (level == "all") and report["collective"] is (level == "all"), where
            if level == "optimizer":  # nothing for the tier: the same memory as without one
                assert report["host_bytes"] == reports[placement.replace("optimizer", "ram")][rank]["host_bytes"]
            for ours, theirs in zip(report["losses"], expected_losses[precision or "fp32"][rank], strict=True):
                assert torch.equal(ours, theirs), (where, float(ours), float(theirs))
            assert set(report["answers"]) == {
                "module.state_dict",
                "engine.state_dict",
                "_zero3_consolidated_16bit_state_dict",
                *(["save_16bit_model"] if rank == 0 else []),
            }, where
            for source, state in report["answers"].items():
                assert state.keys() == given.keys(), (where, source)
                for key, value in given.items():
                    assert state[key].dtype == value.dtype and torch.equal(state[key], value), (where, source, key)
    return list(reports.values())


def test_two_ranks_evaluate_their_rows_and_every_entry_point_returns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One node of 2 ranks, one launch, every placement of ``eval_only_worker.PLACEMENTS``
    in turn (in host memory, ``"optimizer"``, ``"all"``; fp32, bf16, fp16): no optimizer and
    no scheduler returned; each rank's loss on its rows bit-equal to plain PyTorch's on the
    first rank's weights (see the module's docstring: data parallel changes no forward op);
    the state dicts and the 16-bit model, on every rank, the first rank's weights as given,
    bit for bit (each weight held exactly, in fp32, whatever the compute dtype: the default
    ``"frozen_weights": "exact"``); the weights alone in memory, each rank's buffers as its
    placement says and the node's two ranks together as preflight estimates; ``"optimizer"``
    opens no tier and holds what host memory alone holds; the last engine, left to the exit
    handlers (with its weights on the tier), leaves no swap directory behind."""
    import test_data_parallel

    monkeypatch.setattr(test_data_parallel, "WORKER", WORKER)
    launch("evaluate", tmp_path, "--placements", *PLACEMENTS)
    for placement, ranks in zip(PLACEMENTS, _assert_evaluated(tmp_path, PLACEMENTS, world_size=2), strict=True):
        assert node_preflight_disagreements([rank["node_share"] for rank in ranks]) == [], placement


def test_two_bf16_nodes_evaluate_on_the_weights_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """2 simulated nodes of one rank, bf16 compute, in host memory, ``"optimizer"`` and
    ``"all"``: where nodes training in bf16 shard the fp32 master (each node its span), an
    evaluation-only engine has no master of trained elements to shard, so each node holds
    every weight whole and exact (no collective takes the state dict in host memory); the
    checks of the one-node test, each rank against preflight's estimate for its node."""
    import test_data_parallel

    monkeypatch.setattr(test_data_parallel, "WORKER", WORKER)
    placements = ("ram-bf16", "optimizer-bf16", "all-bf16")
    launch_nodes(2, tmp_path, "evaluate", "--placements", *placements)
    for ranks in _assert_evaluated(tmp_path, placements, world_size=2):
        assert [rank["node_share"] for rank in ranks] == [None, None]  # each rank its node: checked in the rank


@pytest.mark.parametrize("nvme", ["none", "all"])
def test_frozen_weights_in_the_compute_dtype_hold_two_bytes_a_parameter(
    nvme: str, tmp_path: Path, cpu_single_thread: None
) -> None:
    """bf16 with ``"frozen_weights": "compute_dtype"``: every weight cast once, in place, and
    held once in bf16 (2 B/param in host memory, or on the tier with ``"all"``; no fp32 copy),
    as DeepSpeed's ZeRO-3 evaluates (it casts the module); the default ``"exact"`` holds the
    fp32 weights beside the streamed bf16 copy (6 B/param, the one-process test above). The
    losses bit-equal to plain PyTorch's on the same rounding (the reference is cast before the
    engine casts the module: round-to-nearest both), the state dict the rounded weights, the
    placement, preflight and the planner in agreement."""
    import deepspeed

    torch.manual_seed(0)
    model = tiny_models.llama(num_layers=2)
    reference = cast_like_the_engine(model, torch.bfloat16)
    settings = _config(nvme, "bf16", tmp_path / "swap")
    settings.setdefault("megatrain", {})["frozen_weights"] = "compute_dtype"
    engine, *_ = deepspeed.initialize(model=model, config=settings)
    try:
        assert placement_disagreements(engine) == []
        assert engine_preflight_disagreements(engine) == []
        assert planner_disagreements(engine) == []
        host = engine.host_bytes()
        _no_optimizer_state(host)
        assert host["master"] == 0 and all(param.dtype == torch.bfloat16 for param in model.parameters())
        if nvme == "none":
            assert host["shadow"] < 2.02 * sum(param.numel() for param in model.parameters())  # each block padded
        engine.eval()
        batch = tiny_models.make_batch(0)
        with torch.no_grad():
            assert torch.equal(engine(**batch).loss, reference(**batch).loss)
        state = engine.module.state_dict()
        assert all(torch.equal(state[key], value) for key, value in reference.state_dict().items())
    finally:
        engine.destroy()


def test_a_training_run_with_every_block_frozen_opens_no_optimizer_tier(
    tmp_path: Path, cpu_single_thread: None
) -> None:
    """The same rule while training: every block frozen (the resident head, norm and
    embedding trained), ``"optimizer"`` has no block state to put on the tier, opens none,
    and two steps give the weights of the same run with ``"none"`` bit for bit (the same
    placement: the same ops on the same values)."""
    import deepspeed

    def trained(nvme: str) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = tiny_models.llama(num_layers=2)
        model.model.layers.requires_grad_(False)
        settings = _config(nvme, "fp32", tmp_path / "swap")
        settings["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3}}
        engine, *_ = deepspeed.initialize(model=model, config=settings)
        try:
            assert engine.placement.nvme == "none" and engine.nvme_tier is None
            for step in range(2):
                engine.backward(engine(**tiny_models.make_batch(step)).loss)
                engine.step()
            return {key: value.clone() for key, value in engine.module.state_dict().items()}
        finally:
            engine.destroy()

    on_tier, in_memory = trained("optimizer"), trained("none")
    assert all(torch.equal(on_tier[key], value) for key, value in in_memory.items())
    assert not (tmp_path / "swap").exists()  # nothing was made under nvme_path
