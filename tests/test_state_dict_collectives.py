"""Every entry point that takes the weights, called on every rank of a data-parallel run.

``state_dict()``, Accelerate's ``get_state_dict`` (``_zero3_consolidated_16bit_state_dict``),
``save_16bit_model``, ``save_pretrained``, ``save_checkpoint`` and ``load_checkpoint`` run
collectives where no process holds the masters whole (``checkpoint/whole_masters.py``:
[Note: one answer from state_dict]). Called on every rank, in the same order, each must
return (a collective skipped or reordered would leave a rank waiting: the runs set
``collective_timeout_s`` to 60 s, and the launches time out), and each must give the
trained masters. One launch per topology, running ``tests/entry_points_worker.py`` over every
placement in turn -- fp32 and bf16 compute, each with the state in host memory (``ram``),
the optimizer on the NVMe tier (``"optimizer"``: the masters on disk) and the weights too
(``"all"``: each rank's windows, gathered when used):

- one node of 2 ranks (plain data parallel);
- 2 simulated nodes of one rank: with bf16 compute the fp32 master is sharded across the
  nodes (each holds its span, the parameters view the bf16 shadow);
- 2 simulated nodes of 2 ranks: the same, with data parallel inside each node.

Reference: the masters as the ``ram`` run of the same precision trained them, read
directly from each rank's host state (each node's span, joined), not through a state dict.
Every answer is bit-equal to it: the tier and the gather only move bytes, and with
``"optimizer"`` and bf16 the parameters are rounded compute copies, so an answer read from
them would fail. The one-node fp32 masters are also checked against plain PyTorch with both
ranks' batches in one process, relative error < 2e-6 (the bound of
``tests/test_data_parallel.py``: the same arithmetic but the gradient reduce's order).

Every rank also checks its buffers against its placement, and against preflight's estimate
for its node (``tests/placement_check.py``): a rank alone on its node directly, a node's two
ranks added up (each node-shared buffer once, each rank's windows, tiers and gather
buffers). These launches are the agreement check's multi-rank combinations: every
precision and placement on each of the three topologies.
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
    return {p: [torch.load(out / f"{p}.rank{rank}.pt", weights_only=True) for rank in range(ranks)] for p in placements}


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


EVERY_PLACEMENT = ("ram", "optimizer", "all", "ram-bf16", "optimizer-bf16", "all-bf16")


def _collective(placement: str, nodes: int) -> bool:
    """Whether the state dict gathers: the weights in ranks' windows (``"all"``), or the fp32
    master sharded across several nodes (bf16 compute); else every rank holds it whole."""
    return placement.startswith("all") or (nodes > 1 and placement.endswith("-bf16"))


def _check_every_rank(reports: dict[str, list[dict]], nodes: int, per_node: int) -> None:
    """Every placement of one launch: each rank's buffers against its placement (and against
    preflight where a rank is its node), each node's ranks together against preflight's node
    estimate, and every entry point on every rank bit-equal to the masters as trained (the
    ``ram`` run of the same precision, read directly: the tier and the gather only move bytes)."""
    masters = {"fp32": _masters_as_trained(reports["ram"]), "bf16": _masters_as_trained(reports["ram-bf16"])}
    for placement, ranks in reports.items():
        expected = masters["bf16" if placement.endswith("-bf16") else "fp32"]
        assert [rank["collective"] for rank in ranks] == [_collective(placement, nodes)] * len(ranks), placement
        if per_node > 1:
            by_node: dict[int, list[dict]] = {}
            for rank in ranks:
                by_node.setdefault(rank["node_share"]["node"], []).append(rank["node_share"])
            assert sorted(len(shares) for shares in by_node.values()) == [per_node] * nodes, placement
            for node, shares in by_node.items():
                disagreements = node_preflight_disagreements(shares)
                assert disagreements == [], (placement, node, disagreements)
        for rank, report in enumerate(ranks):
            assert report["disagreements"] == [], (placement, rank, report["disagreements"])
            _assert_every_answer_is(expected, report, rank, placement)


def test_one_node_every_entry_point_on_every_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    args = ("entry-points", tmp_path, "--placements", *EVERY_PLACEMENT, "--steps", str(STEPS))
    _launch_worker(monkeypatch, lambda: launch(*args))
    reports = _reports(tmp_path, EVERY_PLACEMENT)
    reference, _ = reference_training(STEPS, 1, world_size=2)
    assert relative_error(_masters_as_trained(reports["ram"]), reference) < 2e-6
    _check_every_rank(reports, nodes=1, per_node=2)


@pytest.mark.parametrize("per_node", [1, 2], ids=["one-rank-each", "two-ranks-each"])
def test_two_nodes_every_entry_point_on_every_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, per_node: int
) -> None:
    args = ("entry-points", "--placements", *EVERY_PLACEMENT, "--steps", str(STEPS))
    _launch_worker(monkeypatch, lambda: launch_nodes(2, tmp_path, *args, per_node=per_node))
    _check_every_rank(_reports(tmp_path, EVERY_PLACEMENT, ranks=2 * per_node), nodes=2, per_node=per_node)
