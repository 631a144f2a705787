"""Every entry point that takes the weights, called on every rank of a data-parallel run.

``state_dict()``, Accelerate's ``get_state_dict`` (``_zero3_consolidated_16bit_state_dict``),
``save_16bit_model``, ``save_pretrained``, ``save_checkpoint`` and ``load_checkpoint`` run
collectives where no process holds the masters whole (``checkpoint/whole_masters.py``:
[Note: one answer from state_dict]). Called on every rank, in the same order, each must
return (a collective skipped or reordered would leave a rank waiting: the runs set
``collective_timeout_s`` to 60 s, and the launches time out), and each must give the
trained masters. One launch per topology, running ``tests/entry_points_worker.py`` over its
placements in turn:

- one node of 2 ranks, fp32: the state in host memory (plain data parallel), then the
  optimizer on the NVMe tier (``"optimizer"``: the masters on disk), then the weights too
  (``"all"``: each rank's windows, gathered); then bf16 compute in host memory and with
  ``"all"``, each bit-equal to the bf16 run's masters as its ranks hold them. Reference: plain
  PyTorch with both ranks' batches in one process, relative error < 2e-6 (the bound of
  ``tests/test_data_parallel.py``: the same arithmetic but the gradient reduce's order),
  and the three placements bit-equal to each other (the same ops on the same values: the
  tier and the gather only move bytes).
- 2 simulated nodes of one rank, bf16 compute: the fp32 master sharded across the nodes
  (each holds its span, the parameters view the bf16 shadow), then the weights on the
  tier. Reference: each node's own span of the master, read directly from its host state
  and joined: bit-equal (the state dict moves those bytes, nothing else); the two tier
  placements bit-equal to it (with ``"optimizer"`` the parameters are bf16 compute copies
  and the masters on disk: an answer read from the parameters would be rounded).

Every rank of both launches also checks its buffers against its placement, and against
preflight's estimate for its node (``tests/placement_check.py``): a bf16 node's rank is its
node; the one node's two ranks are added up (each node-shared buffer once, each rank's
windows, tiers and gather buffers). These are the agreement check's multi-rank
combinations: fp32 and bf16 on one node of two ranks, bf16 on two nodes of one rank and
on two nodes of two ranks (the sharded master, with data parallel inside each node: a third
launch), each in host memory and with the tier.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from placement_check import node_preflight_disagreements
from test_data_parallel import launch, launch_nodes, reference_training, relative_error

WORKER = str(Path(__file__).resolve().parent / "entry_points_worker.py")
STEPS = 2
ENTRY_POINTS_ON_RANK0 = ("save_16bit_model", "save_pretrained")  # files written by the first rank


def _reports(out: Path, placements: tuple[str, ...], ranks: int = 2) -> dict[str, list[dict]]:
    return {
        p: [torch.load(out / f"{p}.rank{rank}.pt", weights_only=False) for rank in range(ranks)] for p in placements
    }


def _assert_every_answer_is(expected: dict[str, torch.Tensor], report: dict, rank: int, where: str) -> None:
    """Every entry point's answer on this rank: the same keys, fp32, the same bits as ``expected``."""
    answers = report["answers"]
    names = set(answers)
    assert {"module.state_dict", "_zero3_consolidated_16bit_state_dict", "state_dict after load_checkpoint"} <= names
    assert (set(ENTRY_POINTS_ON_RANK0) <= names) is (rank == 0), names
    for source, state in answers.items():
        assert state.keys() == expected.keys(), (where, source)
        for key, value in expected.items():
            assert state[key].dtype == torch.float32 and torch.equal(state[key], value), (where, rank, source, key)


def _launch_worker(monkeypatch: pytest.MonkeyPatch, run) -> None:
    """``run`` launches ``test_data_parallel``'s worker: point it at this module's instead."""
    import test_data_parallel

    monkeypatch.setattr(test_data_parallel, "WORKER", Path(WORKER))
    run()


def _masters_as_trained(ranks: list[dict]) -> dict[str, torch.Tensor]:
    """The trained masters by state-dict name, read from the ranks' host states (not through
    a state dict): each state's whole master where a rank holds it, else the nodes' spans
    joined in order; the buffers (no masters) from the first rank's state dict."""
    expected: dict[str, torch.Tensor] = {}
    for held in zip(*(rank["masters"] for rank in ranks)):
        spans = {tuple(part["master_held"]): part["master"] for part in held}  # a node's ranks: one copy
        bounds = sorted(spans)
        assert bounds[0][0] == 0 and all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))  # tiled
        whole = torch.cat([spans[bound] for bound in bounds])
        for name, offset, shape in held[0]["slots"]:
            expected[name] = whole[offset : offset + torch.Size(shape).numel()].view(shape)
    for key, value in ranks[0]["answers"]["module.state_dict"].items():
        expected.setdefault(key, value)
    return expected


def test_one_node_every_entry_point_on_every_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    placements = ("ram", "optimizer", "all", "ram-bf16", "all-bf16")
    args = ("entry-points", tmp_path, "--placements", *placements, "--steps", str(STEPS))
    _launch_worker(monkeypatch, lambda: launch(*args))
    reports = _reports(tmp_path, placements)
    masters = {"fp32": _masters_as_trained(reports["ram"]), "bf16": _masters_as_trained(reports["ram-bf16"])}
    reference, _ = reference_training(STEPS, 1, world_size=2)
    assert relative_error(masters["fp32"], reference) < 2e-6
    for placement, ranks in reports.items():
        expected = masters["bf16" if placement.endswith("-bf16") else "fp32"]
        assert [rank["collective"] for rank in ranks] == [placement.startswith("all")] * 2
        # The node's two ranks together against preflight's estimate for the node.
        node = node_preflight_disagreements([rank["node_share"] for rank in ranks])
        assert node == [], (placement, node)
        for rank, report in enumerate(ranks):
            assert report["disagreements"] == [], (placement, rank, report["disagreements"])
            _assert_every_answer_is(expected, report, rank, placement)


def test_two_nodes_every_entry_point_on_every_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    placements = ("ram", "optimizer", "all")
    args = ("entry-points", "--placements", *placements, "--bf16", "--steps", str(STEPS))
    _launch_worker(monkeypatch, lambda: launch_nodes(2, tmp_path, *args))
    reports = _reports(tmp_path, placements)
    expected = _masters_as_trained(reports["ram"])  # each node's span of the fp32 masters, joined
    for placement, ranks in reports.items():
        assert [rank["collective"] for rank in ranks] == [True, True]  # sharded, or gathered
        for rank, report in enumerate(ranks):
            # bf16 nodes, in host memory or "all": placement = allocations = preflight on each rank.
            assert report["disagreements"] == [], (placement, rank, report["disagreements"])
            _assert_every_answer_is(expected, report, rank, placement)


def test_two_nodes_of_two_ranks_every_entry_point_on_every_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16 on 2 nodes of 2 ranks: the fp32 master sharded across the nodes, data parallel
    inside each, in host memory and with the weights on the tier. Each node's two ranks
    against preflight's estimate for the node, and every entry point on every rank bit-equal
    to the nodes' spans of the masters, joined (as in the two-node test)."""
    placements = ("ram-bf16", "all-bf16")
    args = ("entry-points", "--placements", *placements, "--steps", str(STEPS))
    _launch_worker(monkeypatch, lambda: launch_nodes(2, tmp_path, *args, per_node=2))
    reports = _reports(tmp_path, placements, ranks=4)
    expected = _masters_as_trained(reports["ram-bf16"])
    for placement, ranks in reports.items():
        assert [rank["collective"] for rank in ranks] == [True] * 4
        nodes: dict[int, list[dict]] = {}
        for rank in ranks:
            nodes.setdefault(rank["node_share"]["node"], []).append(rank["node_share"])
        assert sorted(len(shares) for shares in nodes.values()) == [2, 2], placement
        for node, shares in nodes.items():
            assert node_preflight_disagreements(shares) == [], (placement, node, node_preflight_disagreements(shares))
        for rank, report in enumerate(ranks):
            assert report["disagreements"] == [], (placement, rank, report["disagreements"])
            _assert_every_answer_is(expected, report, rank, placement)
