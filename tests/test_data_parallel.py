"""Data parallel over gloo on the CPU: 2 ranks vs one plain-PyTorch process with both batches.

Each test launches ``tests/data_parallel_worker.py``: its ranks forked after the imports
with torchrun's variables (``tests/forked_ranks.py``: one interpreter's imports instead of
one per rank and launcher), or with those of a launch by hand where no launcher may be the
one that notices a dead rank, and under ``torchrun`` and the ``deepspeed`` launcher where
the launcher is what is tested.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import fork_server
import pytest
import safetensors.torch
import tiny_models
import torch
import transformers
from data_parallel_worker import BF16_FROZEN_STEPS, CLIPPING, FREEZERS, LENGTH, LR, MICRO, WEIGHT_DECAY, global_batch
from data_parallel_worker import config as worker_config
from placement_check import node_preflight_disagreements
from side_by_side import relative_error

from megatrain_ds import MegatrainEngine, parse_engine_config
from megatrain_ds.config import ConfigError
from megatrain_ds.distributed.data_parallel import NodeIdentity, group_into_nodes, node_identity
from megatrain_ds.distributed.ownership import Ownership
from megatrain_ds.optimizer.journal import AUTO_JOURNAL_BYTES_PER_PARAM
from megatrain_ds.state.flat_layout import ALIGN_ELEMENTS, build_flat_layout

WORKER = Path(__file__).resolve().parent / "data_parallel_worker.py"
FORKED_RANKS = Path(__file__).resolve().parent / "forked_ranks.py"
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration_tests"))
from launching import free_port  # noqa: E402

TIMEOUT_S = 300


def _env(**extra: str) -> dict[str, str]:
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT")
    }
    env.update({"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}, **extra)
    return fork_server.with_this_checkout(env)


def launch(mode: str, out: Path, *args: str, nproc: int = 2, launcher: str = "fork") -> None:
    """``nproc`` ranks of the worker on one node: forked (``tests/forked_ranks.py``), or
    started by the ``deepspeed`` launcher."""
    prefix = {
        "fork": [sys.executable, str(FORKED_RANKS), "--per-node"],
        "deepspeed": [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus"],
    }[launcher]
    port = ("--port" if launcher == "fork" else "--master_port", str(free_port()))
    command = [*prefix, str(nproc), *port, str(WORKER), mode, "--out", str(out), *args]
    result = fork_server.run(command, env=_env(), timeout=TIMEOUT_S)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]


@functools.cache  # several tests compare with the same run; callers only read it
def reference_training(
    steps: int,
    accumulation: int,
    world_size: int,
    length: int = LENGTH,
    frozen: str | None = None,
    frozen_dtype: torch.dtype = torch.float32,
) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Plain PyTorch, one process, every rank's rows in one batch of MICRO * world_size
    (``frozen``: the worker's ``FREEZERS`` of that name, so AdamW and clipping skip those
    weights, their values rounded to ``frozen_dtype`` and kept in fp32)."""
    torch.manual_seed(0)  # rank 0's model: the engine keeps the node writer's weights
    model = tiny_models.llama(num_layers=4)
    if frozen:
        parameters = dict(model.named_parameters())
        for name in FREEZERS[frozen](model):
            parameters[name].data = parameters[name].data.to(frozen_dtype).float()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    norms = []
    for step in range(steps):
        for micro in range(accumulation):
            loss = model(**global_batch(step * accumulation + micro, MICRO * world_size, length)).loss
            (loss / accumulation).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIPPING)))
        optimizer.step()
        optimizer.zero_grad()
    return model.state_dict(), norms


# -- pure rules (no processes) ------------------------------------------------------------


@pytest.mark.parametrize("numel", [1, 63, 64, 1000, 4096 + 17])
@pytest.mark.parametrize("nodes", [[[0]], [[0, 1, 2]], [[0, 1], [2, 3]], [[0], [1], [2], [3]], [[1, 0], [3, 2, 4]]])
def test_windows_and_spans_split_a_state_exactly_on_aligned_bounds(numel: int, nodes: list[list[int]]) -> None:
    """Every element has one owner; a node's span is exactly its ranks' windows, contiguous."""
    world = sum(len(members) for members in nodes)
    views = {rank: Ownership.of(nodes, rank) for rank in range(world)}
    windows = [(rank, *views[rank].window(numel)) for members in nodes for rank in members]  # position order
    assert windows[0][1] == 0 and windows[-1][2] == numel
    for (_, _, end), (_, start, _) in zip(windows, windows[1:]):
        assert end == start  # disjoint and covering
    assert all(start % ALIGN_ELEMENTS == 0 or start == numel for _, start, _ in windows)  # empty at the end
    assert views[0].windows(numel) == [window for window in windows if window[1] < window[2]]
    sizes = {end - start for _, start, end in windows if end < numel}
    assert len(sizes) <= 1  # one size but the last (the reduce's parts are alike)
    for members in nodes:
        mine = [window for window in windows if window[0] in members]
        span = views[members[0]].span(numel)
        assert span == (mine[0][1], mine[-1][2])
        assert all(views[rank].span(numel) == span for rank in members)
    assert [(start, end) for _, start, end in views[0].spans(numel)] == [
        views[members[0]].span(numel) for members in nodes
    ]


def test_layout_window_keeps_the_group_runs_inside_it() -> None:
    layout = build_flat_layout([("a", torch.Size([100]), 0), ("b", torch.Size([50]), 1), ("c", torch.Size([30]), 0)])
    window = layout.window(64, 200)
    assert window.numel == 136
    whole = [(r.group, r.start, r.end) for r in layout.runs]
    shifted = [(r.group, r.start + 64, r.end + 64) for r in window.runs]
    assert shifted == [(g, max(a, 64), min(b, 200)) for g, a, b in whole if min(b, 200) > max(a, 64)]


def test_batch_rules_count_every_rank() -> None:
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 3,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    }
    assert parse_engine_config(config, world_size=4).train_batch_size == 24
    with pytest.raises(ConfigError, match="torchrun"):
        parse_engine_config({**config, "train_batch_size": 6}, world_size=2)


# What each launcher exports to a process (rank 5, on its second node of 4 ranks each):
# torch/distributed/elastic/agent/server/local_elastic_agent.py, deepspeed/launcher/launch.py.
TORCHRUN = {"RANK": "5", "LOCAL_RANK": "1", "GROUP_RANK": "1", "LOCAL_WORLD_SIZE": "4", "GROUP_WORLD_SIZE": "2"}
DEEPSPEED = {"RANK": "5", "LOCAL_RANK": "1", "CROSS_RANK": "1", "CROSS_SIZE": "2", "LOCAL_SIZE": "4"}
NODE_RANK_ONLY = {"RANK": "5", "LOCAL_RANK": "1", "NODE_RANK": "1"}  # Accelerate's forked launcher, job scripts


@pytest.mark.parametrize(
    "environ, node, local_world_size",
    [
        (TORCHRUN, "GROUP_RANK=1", 4),
        (DEEPSPEED, "CROSS_RANK=1", 4),
        (NODE_RANK_ONLY, "NODE_RANK=1", None),
        ({**TORCHRUN, "NODE_RANK": "7"}, "GROUP_RANK=1", 4),  # the launcher's own variable wins
        ({"RANK": "5", "LOCAL_RANK": "1", "GROUP_RANK": " "}, "host-a", None),  # blank: not set
        ({"RANK": "5", "WORLD_SIZE": "8"}, "host-a", None),  # no launcher variable: the hostname
    ],
    ids=["torchrun", "deepspeed", "NODE_RANK", "GROUP_RANK before NODE_RANK", "blank", "none"],
)
def test_node_identity_comes_from_the_launcher(
    environ: dict[str, str], node: str, local_world_size: int | None
) -> None:
    identity = node_identity(environ, hostname="host-a")
    assert identity.node == node and identity.hostname == "host-a"
    assert identity.source == (node.split("=")[0] if "=" in node else "hostname")
    assert identity.local_world_size == local_world_size
    assert identity.local_rank == (1 if "LOCAL_RANK" in environ else None)


def test_node_identity_rejects_launcher_variables_that_are_no_integers() -> None:
    with pytest.raises(ValueError, match="GROUP_RANK='node-a' is not an integer"):
        node_identity({"GROUP_RANK": "node-a"}, hostname="host-a")
    with pytest.raises(ValueError, match="LOCAL_SIZE='four' is not an integer"):
        node_identity({**DEEPSPEED, "LOCAL_SIZE": "four"}, hostname="host-a")


def _launched(node_rank: int, local_rank: int, host: str, per_node: int = 2) -> NodeIdentity:
    environ = {
        **TORCHRUN,
        "GROUP_RANK": str(node_rank),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(per_node),
    }
    return node_identity(environ, hostname=host)


def test_nodes_on_one_host_stay_apart_and_one_node_on_two_hosts_is_refused() -> None:
    # Simulated nodes (or containers) on one host: two nodes, each its own copy.
    same_host = [_launched(0, 0, "h"), _launched(0, 1, "h"), _launched(1, 0, "h"), _launched(1, 1, "h")]
    assert group_into_nodes(same_host) == {"GROUP_RANK=0": [0, 1], "GROUP_RANK=1": [2, 3]}
    # The hostname alone would have merged two machines called alike; the launcher does not.
    twins = [_launched(0, 0, "gpu", per_node=1), _launched(1, 0, "gpu", per_node=1)]
    assert group_into_nodes(twins) == {"GROUP_RANK=0": [0], "GROUP_RANK=1": [1]}
    # One claimed node on two hosts cannot share memory.
    with pytest.raises(
        ValueError, match=r"ranks \[0, 1\] claim the same node \(GROUP_RANK=0\) but run on different hosts"
    ):
        group_into_nodes([_launched(0, 0, "host-a"), _launched(0, 1, "host-b")])


def test_inconsistent_launcher_claims_are_refused() -> None:
    with pytest.raises(ValueError, match="name their node differently"):  # two launchers
        group_into_nodes([_launched(0, 0, "h"), node_identity({"CROSS_RANK": "1"}, hostname="h")])
    with pytest.raises(ValueError, match=r"the launcher says \[2\] per node"):  # two launches, one node rank
        group_into_nodes([_launched(0, 0, "h"), _launched(0, 1, "h"), _launched(0, 0, "h")])
    with pytest.raises(ValueError, match="repeat a LOCAL_RANK"):
        group_into_nodes([_launched(0, 0, "h"), _launched(0, 0, "h")])
    # By hand, with no launcher variable, the hostname groups them.
    by_hand = [node_identity({"LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": "2"}, hostname="h") for r in range(2)]
    assert group_into_nodes(by_hand) == {"h": [0, 1]}


# -- launched ranks ---------------------------------------------------------------------------


def test_two_ranks_match_one_process_with_both_batches(
    tmp_path: Path, cpu_single_thread: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One node of 2 ranks, as torchrun (GROUP_RANK) names it, the gradient all-reduce on its
    own stream started while backward runs.

    Under the race checker only (the ranks inherit ``MEGATRAIN_STREAM_CHECK=1``): the same
    ranks' work on the plain path is the ``deepspeed`` launcher's test below (the same
    worker command), and the forked 2-rank runs after it. Forked with torchrun's variables
    (``forked_ranks.py``), not under ``torchrun``: the ranks' work is the subject here, and
    ``torchrun`` itself, its variables naming the nodes, is the two-node test's below (a
    launch under it is two fresh ranks' imports and teardown, 20 of this test's 25 s of CPU)."""
    monkeypatch.setenv("MEGATRAIN_STREAM_CHECK", "1")
    ranks = _two_ranks_on_one_node(tmp_path, "fork")
    assert all(rank["stream_checked"] for rank in ranks)  # the ranks ran under the checker


def test_the_deepspeed_launcher_runs_the_ranks_as_torchrun_does(tmp_path: Path, cpu_single_thread: None) -> None:
    """The same run started by the deepspeed launcher, which names the node by CROSS_RANK
    (the ranks' work is the same as under torchrun, whose run is the checked one: this is the plain path),
    with frozen weights (issue 44; ``freeze_some``) and Adam's moments on each rank's NVMe
    tier: the node holds the frozen weights once, at their own size, and no optimizer state,
    each rank's swap files its windows of the trained prefix (``_assert_frozen_held_once``)."""
    ranks = _two_ranks_on_one_node(tmp_path, "deepspeed", frozen="some")
    assert not any(rank["stream_checked"] for rank in ranks)  # the plain path


def _two_ranks_on_one_node(tmp_path: Path, launcher: str, frozen: str | None = None) -> list[dict]:
    """The worker's 2-rank parity run on one node, checked against one process; what each rank reported."""
    steps, accumulation = 5, 2
    args = ["--steps", str(steps), "--accumulation", str(accumulation)]
    if frozen:
        # The tier's thread I/O engine: each fresh rank would load DeepSpeed's async I/O op
        # (2.6 s of CPU: its builder probes the CPU in two child interpreters). Both engines
        # give the same run (test_nvme_tier.py); the forked runs below use the aio op.
        args += ["--frozen", "--nvme", str(tmp_path / "swap"), "--nvme-io", "threads"]
    launch("parity", tmp_path, *args, launcher=launcher)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert [(rank["node_size"], rank["node_index"], rank["leader"]) for rank in ranks] == [(2, 0, False), (2, 1, False)]
    _assert_parity(ranks, steps, accumulation, frozen=frozen)
    if frozen:
        _assert_frozen_held_once(ranks, nodes=1, per_node=2, tier=True)
    return ranks


def launch_nodes(nodes: int, out: Path, *args: str, per_node: int = 1, launcher: str = "fork") -> None:
    """``nodes`` simulated nodes on this host of ``per_node`` ranks each, meeting at one
    rendezvous (gloo): forked ranks told their node by ``GROUP_RANK`` as torchrun does
    (``tests/forked_ranks.py``), or (``launcher="torchrun"``) a ``torchrun --nnodes`` launch each."""
    if launcher == "fork":
        command = [sys.executable, str(FORKED_RANKS), "--nodes", str(nodes), "--per-node", str(per_node)]
        command += ["--port", str(free_port()), str(WORKER), "--out", str(out), *args]
        result = fork_server.run(command, env=_env(), timeout=TIMEOUT_S)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
        return
    endpoint = f"127.0.0.1:{free_port()}"
    launches = [
        fork_server.popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--node-rank", str(node)]
            + ["--nproc-per-node", str(per_node), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint]
            + ["--rdzv-conf", f"is_host={int(node == 0)}"]  # node 0 hosts the rendezvous store
            + [str(WORKER), "--out", str(out), *args],
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for node in range(nodes)
    ]
    try:
        outputs = [launched.communicate(timeout=TIMEOUT_S) for launched in launches]
    finally:
        for launched in launches:
            launched.kill()
    for launched, (stdout, stderr) in zip(launches, outputs):
        assert launched.returncode == 0, stdout[-3000:] + stderr[-6000:]


def test_two_simulated_nodes_from_two_torchrun_launches_match_one_process(
    tmp_path: Path, cpu_single_thread: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two ``torchrun --nnodes 2`` launches on this one host, a rank each: torchrun's
    GROUP_RANK makes them 2 nodes (the hostname would have made them one), each with its own
    host copy, and they still train as one process with both batches, with frozen weights
    (issue 44: ``_assert_frozen_held_once``, each node its span of the trained prefix); their
    checkpoint (a span file per node, of the trained prefix) loads back exactly.

    Under the race checker only (the ranks inherit ``MEGATRAIN_STREAM_CHECK=1``): nodes of
    one rank on the plain path run in the resharding test below (its 4-node resume)."""
    monkeypatch.setenv("MEGATRAIN_STREAM_CHECK", "1")
    steps, accumulation = 5, 2
    # Buckets of a few parameters: a block's gradients reach the reducer in several buckets,
    # in backward order, which is not the layout's (the MLP before the attention, the norms last).
    checkpoint = tmp_path / "checkpoint"
    saved = ("--save-to", str(checkpoint), "--save-at", str(steps), "--load-after", str(checkpoint))
    common = ("--steps", str(steps), "--accumulation", str(accumulation), "--bucket-elements", "3000")
    launch_nodes(2, tmp_path, "parity", *common, "--frozen", *saved, launcher="torchrun")
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    # One rank per node, each its node's leader: the leaders' group (the weight broadcast) exists.
    assert [(rank["node_size"], rank["node_index"], rank["leader"]) for rank in ranks] == [(1, 0, True)] * 2
    assert all(rank["stream_checked"] for rank in ranks)  # the ranks ran under the checker
    _assert_parity(ranks, steps, accumulation, frozen="some")
    _assert_frozen_held_once(ranks, nodes=2, per_node=1)
    for rank in ranks:  # the saved state, loaded back, is the state it was saved from
        for saved_state, loaded in zip(rank["flat_states"], rank["loaded_states"]):
            for kind in ("master", "exp_avg"):
                assert torch.equal(saved_state[kind], loaded[kind]), kind
        for key, value in rank["state_dict"].items():
            assert torch.equal(value, rank["loaded_state_dict"][key]), key


def _assert_placement_agrees(ranks: list[dict]) -> None:
    """Every rank's buffers are where and what its placement says, and what preflight
    estimates for its node: the rank's own where it is its node, else its node's ranks'
    together (``tests/placement_check.py``; the one-process combinations are
    ``tests/test_placement.py``'s)."""
    nodes: dict[int, list[dict]] = {}
    for rank, report in enumerate(ranks):
        assert report["placement_disagreements"] == [], (rank, report["placement_disagreements"])
        assert report["preflight_disagreements"] == [], (rank, report["preflight_disagreements"])
        if report.get("node_share") is not None:
            nodes.setdefault(report["node_share"]["node"], []).append(report["node_share"])
    for node, shares in nodes.items():
        assert len(shares) > 1 and node_preflight_disagreements(shares) == [], (
            node,
            node_preflight_disagreements(shares),
        )


def _assert_node_shares(ranks: list[dict], nodes: int, per_node: int, tier: bool = False) -> None:
    """Each node holds the whole weights and its span of Adam's moments and of the held
    gradients, 1/N of them (W + S/N, ``engine.host_bytes()``), each element on one node.
    With the NVMe tier (one rank per node) the blocks' moments of the span are in the
    rank's swap files instead, the resident parameters' in host memory."""
    _assert_placement_agrees(ranks)
    world = nodes * per_node
    numels = ranks[0]["numels"]
    numel = sum(numels)
    ownership = Ownership.of([range(node * per_node, (node + 1) * per_node) for node in range(nodes)], 0)
    slack = len(numels) * world * ALIGN_ELEMENTS * 4  # per state: windows of one size, the last ones short
    in_memory = ("grad",) if tier else ("exp_avg", "exp_avg_sq", "grad")
    for node, leader in enumerate(ranks[::per_node]):  # one report per node: its ranks map one copy
        held = leader["host_bytes"]
        assert held["master"] == 4 * numel  # W: the weights, whole on every node
        spans = [end - start for _, start, end in (ownership.spans(n)[node] for n in numels)]
        for kind in in_memory:  # S: this node's share of them
            assert held[kind] == 4 * sum(spans), kind
            assert abs(held[kind] - 4 * numel / nodes) <= slack, (kind, held[kind], numel)
        if tier:
            assert leader["tier"]["numels"] == [span for span in spans[:-1] if span > 0]
            assert leader["tier"]["planned_disk"] == leader["tier"]["disk"]
            assert held["exp_avg"] == held["exp_avg_sq"] == 4 * spans[-1]
        assert sum(held.values()) - held.get("nvme_window", 0) <= (4 + 12 / nodes) * numel + 3 * slack  # W + S/N
    for kind in in_memory:  # together the nodes hold each element once
        assert sum(leader["host_bytes"][kind] for leader in ranks[::per_node]) == 4 * numel


def _assert_frozen_held_once(ranks: list[dict], nodes: int, per_node: int, tier: bool = False) -> None:
    """Frozen weights cost their own bytes once per node (issue 44): every state's moments
    and held gradients cover this node's span of its trained prefix alone (the frozen
    elements after it have none), together each trained element once; the fp32 master
    holds every weight once (node-shared: one copy per node). ``tier``: the blocks' moments
    are on each rank's NVMe tier instead, its swap files its windows of the trained prefixes."""
    trained, numels = ranks[0]["trained_numels"], ranks[0]["numels"]
    assert sum(trained) < sum(numels)  # the worker froze weights in blocks and resident state
    nodes_ranks = [list(range(node * per_node, (node + 1) * per_node)) for node in range(nodes)]
    ownership = Ownership.of(nodes_ranks, 0)
    in_memory = ("grad",) if tier else ("exp_avg", "exp_avg_sq", "grad")
    for node, leader in enumerate(ranks[::per_node]):
        spans = [end - start for _, start, end in (ownership.spans(t)[node] for t in trained)]
        for index, state in enumerate(leader["flat_states"]):
            assert state["held"] == ownership.spans(trained[index])[node][1:]
            if state["exp_avg"] is not None:  # None: on the tier
                assert state["exp_avg"].numel() == spans[index]
        for kind in in_memory:
            assert leader["host_bytes"][kind] == 4 * sum(spans), kind
        if tier:  # the resident state's moments in host memory
            assert leader["host_bytes"]["exp_avg"] == 4 * spans[-1]
        assert leader["host_bytes"]["master"] == 4 * sum(numels)
    for kind in in_memory:
        assert sum(leader["host_bytes"][kind] for leader in ranks[::per_node]) == 4 * sum(trained)
    for rank, report in enumerate(ranks):
        if tier:
            windows = [Ownership.of(nodes_ranks, rank).window(t) for t in trained[:-1]]
            assert report["tier"]["numels"] == [end - start for start, end in windows if end > start]


def _assert_parity(ranks: list[dict], steps: int, accumulation: int, frozen: str | None = None) -> None:
    """Both ranks' weights and norms are plain PyTorch's with both batches in one process
    (``frozen``: with the worker's frozen weights, ``FREEZERS[frozen]``, which stay bit for
    bit as they started)."""
    _assert_placement_agrees(ranks)
    expected, expected_norms = reference_training(steps, accumulation, world_size=2, frozen=frozen)
    assert min(expected_norms) > CLIPPING  # clipping is active in every step
    for rank in ranks:
        assert relative_error(rank["state_dict"], expected) < 2e-6
        assert rank["norms"] == pytest.approx(expected_norms, rel=1e-5)
    if frozen:
        torch.manual_seed(0)
        initial = tiny_models.llama(num_layers=4).state_dict()
        names = FREEZERS[frozen](tiny_models.llama(num_layers=4))
        for rank in ranks:
            for name in names:
                assert torch.equal(rank["state_dict"][name], initial[name]), name
    for key, value in ranks[0]["state_dict"].items():  # every rank (every node) holds the same weights
        assert torch.equal(value, ranks[1]["state_dict"][key]), key


def test_two_ranks_with_chunked_loss_and_tiled_mlp_match_one_process(tmp_path: Path, cpu_single_thread: None) -> None:
    """Long sequences (issue 23): each rank's 2 x 40 tokens go through the loss in chunks of
    13 and every block's MLP in tiles of 9 (odd sizes: a ragged last piece), and the two
    ranks still train as one process with both batches does (tolerances as above: chunks and
    tiles only reorder fp32 additions, test_long_context.py)."""
    steps, accumulation, length, chunk, tile = 5, 2, 40, 13, 9
    launch(
        "parity",
        tmp_path,
        "--steps",
        str(steps),
        "--accumulation",
        str(accumulation),
        "--length",
        str(length),
        "--loss-chunk-tokens",
        str(chunk),
        "--mlp-tile-tokens",
        str(tile),
    )
    expected, expected_norms = reference_training(steps, accumulation, world_size=2, length=length)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert min(expected_norms) > CLIPPING
    rows = MICRO * length  # one rank's tokens per micro-batch
    for rank in ranks:
        # Every micro-batch's loss ran in ceil(80 / 13) = 7 chunks; every tiled MLP call
        # (4 blocks: forward, recompute, backward) in ceil(80 / 9) = 9 tiles.
        assert rank["loss_chunks"] == [-(-rows // chunk)] * (steps * accumulation) == [7] * 10
        assert len(rank["mlp_tiles"]) >= 4 * 2 * steps * accumulation
        assert set(rank["mlp_tiles"]) == {-(-rows // tile)} == {9}
        assert relative_error(rank["state_dict"], expected) < 2e-6
        assert rank["norms"] == pytest.approx(expected_norms, rel=1e-5)
    for key, value in ranks[0]["state_dict"].items():
        assert torch.equal(value, ranks[1]["state_dict"][key]), key


@pytest.mark.parametrize("layout", ["one node", "one rank per node"])
def test_fp16_overflow_on_one_rank_is_skipped_by_every_rank(tmp_path: Path, layout: str) -> None:
    """Only rank 1's gradients overflow at step 4; every rank skips it, lowers the scale the
    same way and keeps the same weights (the gradient all-reduce spreads the inf, and the
    norm the skip is decided on is summed over the ranks)."""
    launch(
        "fp16", tmp_path, "--steps", "7", "--poison-at", "4", *(["--one-rank-per-node"] if layout != "one node" else [])
    )
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert ranks[0]["skipped"] == ranks[1]["skipped"] and ranks[0]["scales"] == ranks[1]["scales"]
    skipped, scales = ranks[0]["skipped"], ranks[0]["scales"]
    assert skipped[4] and not skipped[3] and not skipped[5], skipped
    assert scales[4] == scales[3] / 2, scales
    for key, value in ranks[0]["state_dict"].items():
        assert torch.equal(value, ranks[1]["state_dict"][key]), key


def test_two_ranks_with_the_weights_on_the_nvme_tier_gather_each_block_from_its_owners(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One node of 2 ranks with the weights on the NVMe tier too (``"nvme_offload": "all"``,
    issue 34): each rank keeps only its window of every block -- its fp32 master, m and v --
    in its own swap files, no rank holds a block whole, and every block is gathered from
    the two windows each time it is used (``distributed/gathered_weights.py``). The run is
    plain PyTorch's with both batches. Network: a gather per block taken (forward and
    backward), the updated blocks never sent. Its checkpoint (a span file per rank with the
    masters, model files gathered a block at a time) resumes on 2 simulated nodes of one
    rank (two nodes as GROUP_RANK names them: the resident state sharded across them too)
    bit-identically to the uninterrupted run, and a one-process checkpoint loads into their
    windows exactly. The same 2 nodes then train again with frozen weights (issue 44:
    ``_assert_frozen_apart_on_rank_tiers``), then with bf16 compute, the fp32 frozen weights
    cast (``_assert_bf16_frozen_apart_on_rank_tiers``) and kept exact, with ``"all"`` and
    with ``"optimizer"`` (``_assert_exact_fp32_frozen_weights``), in the same launch.

    The first run is under the race checker (the ranks inherit ``MEGATRAIN_STREAM_CHECK=1``),
    which copies each gathered block to its device slot as a GPU does; the resumed one is
    the plain CPU path, whose slots are the gathered blocks themselves, held until released."""
    monkeypatch.setenv("MEGATRAIN_STREAM_CHECK", "1")
    straight, resumed, checkpoint = (tmp_path / name for name in ("straight", "resumed", "checkpoint"))
    for directory in (straight, resumed):
        directory.mkdir()
    on_tier = ("--nvme", str(tmp_path / "swap"), "--nvme-weights")
    launch("parity", straight, "--steps", "5", "--save-to", str(checkpoint), "--save-at", "3", *on_tier)
    ranks = [torch.load(straight / f"rank{rank}.pt") for rank in range(2)]
    _assert_parity(ranks, steps=5, accumulation=2)
    resident = ranks[0]["numels"][-1]
    for rank, report in enumerate(ranks):  # each rank's tier: its window of every block, nothing more
        windows = [Ownership.of([[0, 1]], rank).window(numel) for numel in report["numels"][:-1]]
        assert report["tier"]["numels"] == [end - start for start, end in windows]
        # In host memory only the resident state's master and moments: no block's weights.
        assert report["host_bytes"]["master"] == report["host_bytes"]["exp_avg"] == 4 * resident
        assert report["host_bytes"]["nvme_window"] == report["tier"]["window"] > 0
        # A gather per block taken by the streamer, one for the checkpoint's model files and one
        # for state_dict(); each sends this rank's window of the block.
        blocks = len(windows)
        assert report["gathers"] == report["transfers"] + 2 * blocks
        assert report["transfers"] == 2 * blocks * 5 * 2  # forward and backward, 5 steps of 2 micro-batches
        chunk = sum(Ownership.of([[0, 1]], rank).chunk(numel) for numel in report["numels"][:-1])
        assert report["collective_elements"]["all_gather"] == chunk * report["gathers"] // blocks
        # Broadcasts: the blocks' initial weights (rank 0's) once; no updated block ever.
        assert report["collective_elements"]["broadcast"] == sum(report["numels"][:-1])
    # Preflight plans the node's swap files and window slots: both ranks' (blocks of 7808
    # elements: the windows are half of each, so the plan is exact).
    for kind in ("disk", "window"):
        assert ranks[0]["tier"][f"planned_{kind}"] == sum(report["tier"][kind] for report in ranks), kind
    assert sorted(p.name for p in (checkpoint / "global_step3").glob("optimizer*")) == [
        "optimizer-spans-00001-of-00002.safetensors",  # one per rank: each wrote its own windows
        "optimizer-spans-00002-of-00002.safetensors",
    ]
    assert not list((tmp_path / "swap").iterdir())  # the swap directories go with the run

    one_process = tmp_path / "one_process"
    _save_one_process_checkpoint(one_process)
    resume = ("--resume-from", str(checkpoint), "--load-after", str(one_process))
    monkeypatch.delenv("MEGATRAIN_STREAM_CHECK")
    frozen_runs = ("--then-frozen-on-tier", "--then-bf16-frozen-on-tier")
    launch_nodes(2, resumed, "parity", "--steps", "5", *resume, *on_tier, *frozen_runs)
    expected_loaded = _one_process_weights(one_process)
    frozen_run = [torch.load(resumed / f"frozen{rank}.pt") for rank in range(2)]
    _assert_frozen_apart_on_rank_tiers(frozen_run, "some", steps=5, accumulation=2, loaded=expected_loaded)
    _assert_bf16_frozen_apart_on_rank_tiers([torch.load(resumed / f"frozen_bf16{rank}.pt") for rank in range(2)])
    exact_runs = {}
    for level in ("all", "optimizer"):
        exact_runs[level] = [torch.load(resumed / f"frozen_exact_{level}{rank}.pt") for rank in range(2)]
        _assert_exact_fp32_frozen_weights(exact_runs[level], level)
    _assert_older_spans_load_exact_in_one_process(resumed, exact_runs, tmp_path / "swap_one")
    for rank in range(2):
        report = torch.load(resumed / f"rank{rank}.pt")
        expected = ranks[rank]["state_dict"]
        for key, value in expected.items():
            assert torch.equal(value, report["state_dict"][key]), key
        for key, value in expected_loaded.items():  # the model files read into this rank's windows
            assert torch.equal(value, report["loaded_state_dict"][key]), key


def _assert_frozen_apart_on_rank_tiers(
    ranks: list[dict], frozen: str, steps: int, accumulation: int, loaded: dict[str, torch.Tensor] | None = None
) -> None:
    """The worker's frozen run (``frozen_on_tier_args``: ``FREEZERS[frozen]``, the weights on the
    tier, nodes of one rank each, in the launch of another run): plain PyTorch's LoRA-style
    run with the global batch to 2e-6 (``_assert_parity``, whose placement check also holds
    each rank's buffers, tier files and window to its placement and to preflight's plan of
    its node), the frozen weights bit for bit as they started. Frozen weights cost their own
    bytes alone: each rank's swap files hold its window of each block's trained prefix (its
    master, m and v; no block's master in host memory, the held gradients that window's),
    its window of the frozen weights a read-only file of their own (``state/frozen_files.py``)
    written at start-up and never after, and its checkpoint (model files gathered a block at a
    time, span files of the trained windows) loads back to the same weights: right after it
    is saved, or with ``loaded`` (a one-process checkpoint's weights, the frozen ones other
    than the run's) after that checkpoint was loaded, every weight exactly, frozen ones too."""
    _assert_parity(ranks, steps, accumulation, frozen=frozen)
    trained, numels = ranks[0]["trained_numels"], ranks[0]["numels"]
    assert all(t < n for t, n in zip(trained, numels))  # frozen weights in every block and the resident state
    for rank, report in enumerate(ranks):
        ownership = Ownership.of([[node] for node in range(len(ranks))], rank)
        windows = [ownership.window(t) for t in trained[:-1]]
        frozen_windows = [ownership.window(n - t) for t, n in zip(trained[:-1], numels[:-1])]
        assert report["tier"]["numels"] == [end - start for start, end in windows]
        assert report["tier"]["frozen_numels"] == [end - start for start, end in frozen_windows]
        assert report["tier"]["disk"] == report["tier"]["planned_disk"]
        resident = ownership.span(trained[-1])  # the resident state's moments: this node's span, in memory
        held = report["host_bytes"]
        assert held["master"] == 4 * numels[-1]  # the resident state's alone
        assert held["exp_avg"] == held["exp_avg_sq"] == 4 * (resident[1] - resident[0])
        assert held["grad"] == 4 * (sum(end - start for start, end in windows) + resident[1] - resident[0])
        files = report["frozen_files"]
        assert len(files["at_start"]) == len(windows) and files["after_training"] == files["at_start"]
        for key, value in (loaded or report["state_dict"]).items():
            assert torch.equal(value, report["loaded_state_dict"][key]), key
        for key, value in report["state_dict"].items() if loaded is not None else ():
            assert torch.equal(value, report["reloaded_state_dict"][key]), key


def _assert_bf16_frozen_apart_on_rank_tiers(ranks: list[dict], frozen: str = "some") -> None:
    """The worker's third run (``bf16_frozen_on_tier_args``: ``FREEZERS[frozen]``, the weights
    on the tier, nodes of one rank each, bf16 compute, the fp32 frozen weights cast to bf16 by
    ``"frozen_weights": "compute_dtype"``): every state trained-only, each block's frozen
    weights apart in each rank's bf16 files (its window of them), written at start-up only,
    the resident state's in the bf16 shadow; each rank's buffers, tier files and window as
    its placement and preflight say. The frozen weights stay the rounded originals bit for
    bit. Against fp32 plain PyTorch whose frozen weights are those rounded values, with both
    batches: ``tests/test_bf16.py``'s bound, 5e-3 relative weight error (bf16 forward and
    backward round relatively 2^-9 per value; after 2 steps ~1e-3), and the per-step
    norms, of the same gradients computed in bf16, to 1e-2 (measured on the CPU: 5.4e-4
    and 9.2e-4)."""
    _assert_placement_agrees(ranks)
    expected, expected_norms = reference_training(
        BF16_FROZEN_STEPS, 2, world_size=2, frozen=frozen, frozen_dtype=torch.bfloat16
    )
    torch.manual_seed(0)
    initial = tiny_models.llama(num_layers=4).state_dict()
    names = FREEZERS[frozen](tiny_models.llama(num_layers=4))
    for report in ranks:
        assert relative_error(report["state_dict"], expected) < 5e-3
        assert report["norms"] == pytest.approx(expected_norms, rel=1e-2)
        for name in names:
            assert torch.equal(report["state_dict"][name], initial[name].bfloat16()), name
        assert report["frozen_in"] == ["frozen"] * (len(report["numels"]) - 1) + ["shadow"]
        assert report["frozen_dtypes"] == ["torch.bfloat16"]
        assert report["tier"]["disk"] == report["tier"]["planned_disk"]
        files = report["frozen_files"]
        assert files["at_start"] and files["after_training"] == files["at_start"]
    for key, value in ranks[0]["state_dict"].items():
        assert torch.equal(value, ranks[1]["state_dict"][key]), key


def _assert_exact_fp32_frozen_weights(ranks: list[dict], level: str, frozen: str = "some") -> None:
    """The worker's last two runs (``exact_frozen_args``, after the cast run in the same
    ranks): bf16 compute on 2 nodes of one rank, the fp32 frozen weights kept exact beside
    the fp32 master the nodes cut, with the weights on the tier (``"all"``) and with Adam's
    moments alone there (``"optimizer"``). Every state is trained-only (issue 44): the
    moments, gradients and swap files cover the trained prefix alone; the frozen weights are
    held once, in fp32 -- each rank's window of them in its tier's files (``"all"``, rounded
    to bf16 as they are read), or apart, whole, in each node's host memory beside the shadow
    that streams their rounding (``"optimizer"``: 4 B each there, nothing on the tier). Each
    rank's buffers, tier files and window are as its placement and preflight say. The frozen
    weights stay their fp32 values bit for bit, and the run's checkpoint loads back to the
    same weights exactly (the frozen ones gathered exact from the ranks' files with
    ``"all"``), also rewritten in the form written before issue 44 (``checkpoint/
    optimizer_spans.py``: [Note: older span files]), its fp32 frozen weights exact only in the
    span files' masters, the model files holding them in bf16. Against fp32 plain PyTorch
    with the same fp32 frozen weights and both batches: the bounds of
    ``_assert_bf16_frozen_apart_on_rank_tiers`` (bf16 rounds the frozen weights as it rounds
    every streamed value)."""
    _assert_placement_agrees(ranks)
    expected, expected_norms = reference_training(BF16_FROZEN_STEPS, 2, world_size=2, frozen=frozen)
    torch.manual_seed(0)
    initial = tiny_models.llama(num_layers=4).state_dict()
    names = FREEZERS[frozen](tiny_models.llama(num_layers=4))
    trained, numels = ranks[0]["trained_numels"], ranks[0]["numels"]
    for rank, report in enumerate(ranks):
        assert relative_error(report["state_dict"], expected) < 5e-3
        assert report["norms"] == pytest.approx(expected_norms, rel=1e-2)
        for name in names:
            assert report["state_dict"][name].dtype == torch.float32
            assert torch.equal(report["state_dict"][name], initial[name]), name
        for key, value in report["state_dict"].items():
            assert torch.equal(value, report["loaded_state_dict"][key]), key
            # The same checkpoint in its form from before issue 44 (the worker's load_older_form).
            assert torch.equal(value, report["older_form_loaded_state_dict"][key]), key
        assert report["frozen_dtypes"] == ["torch.float32"]
        ownership = Ownership.of([[0], [1]], rank)
        tier = report["tier"]
        assert tier["numels"] == [end - start for start, end in map(ownership.window, trained[:-1])]
        if level == "all":  # each rank's window of them, in fp32 files
            frozen_windows = [ownership.window(n - t) for t, n in zip(trained[:-1], numels[:-1])]
            assert tier["frozen_numels"] == [end - start for start, end in frozen_windows]
            # In host memory only the resident state's (in host memory whatever the level), apart.
            resident = numels[-1] - trained[-1] if 0 < trained[-1] < numels[-1] else 0
            assert report["host_bytes"].get("frozen", 0) == 4 * resident
        else:  # "optimizer": whole in the node's host memory, every state with something trained
            assert not any(tier["frozen_numels"])
            apart = sum(n - t for t, n in zip(trained, numels) if 0 < t < n)
            assert apart > 0 and report["host_bytes"]["frozen"] == 4 * apart
            assert report["frozen_in"][:-1] == ["frozen"] * (len(numels) - 1)
    for key, value in ranks[0]["state_dict"].items():
        assert torch.equal(value, ranks[1]["state_dict"][key]), key


def _assert_older_spans_load_exact_in_one_process(resumed: Path, exact_runs: dict[str, list[dict]], swap: Path) -> None:
    """The exact-fp32 runs' checkpoints of 2 nodes (``"all"``: a span file per rank;
    ``"optimizer"``: one per node), each also in its form from before issue 44 (the worker's
    ``load_older_form``: the frozen weights exact only in the span files' masters, rounded to
    bf16 in the model files), loaded into one bf16 process at every level: ``"none"`` (the
    fp32 frozen weights in the whole master in host memory), ``"optimizer"`` (apart in host
    memory, the master cut: on the tier) and ``"all"`` (apart in their file on the tier).
    Each load gives the nodes' weights bit for bit (the same bytes read: the masters from the
    span files, the frozen weights from the model files or, in the older form, from the span
    files' masters); the older form's model files do hold the frozen weights rounded (so a
    load that read them would differ)."""
    settings = worker_config(1, world_size=1, micro=MICRO * 2)
    for one_process in ("none", "optimizer", "all"):
        nvme = {"nvme_offload": one_process, "nvme_path": str(swap), "nvme_aio": {"engine": "threads"}}
        model = tiny_models.llama(num_layers=4)
        frozen = FREEZERS["some"](model)
        config = {**settings, "bf16": {"enabled": True}, "megatrain": nvme if one_process != "none" else {}}
        engine = MegatrainEngine(model, parse_engine_config(config))
        try:
            apart = [state.frozen is not None for state in engine.states[:-1]]
            assert all(apart) if one_process != "none" else not any(apart), one_process
            for level, ranks in exact_runs.items():
                expected = ranks[0]["state_dict"]
                for form in ("checkpoint", "checkpoint_before_issue_44"):
                    engine.load_checkpoint(str(resumed / f"frozen_exact_{level}_{form}"))
                    loaded = engine.module.state_dict()
                    for key, value in expected.items():
                        assert torch.equal(value, loaded[key]), (one_process, level, form, key)
        finally:
            engine.destroy()
    for level, ranks in exact_runs.items():
        rounded = _one_process_weights(resumed / f"frozen_exact_{level}_checkpoint_before_issue_44")
        assert all(rounded[name].dtype == torch.bfloat16 for name in frozen)
        assert any(not torch.equal(rounded[name].float(), ranks[0]["state_dict"][name]) for name in frozen)


def _save_one_process_checkpoint(directory: Path) -> None:
    """A checkpoint of one process (fp32 model files, per-parameter optimizer files) after
    one step of the worker's model, seeded unlike the ranks' start."""
    torch.manual_seed(7)
    engine = MegatrainEngine(tiny_models.llama(num_layers=4), parse_engine_config(worker_config(1, 1)))
    try:
        engine.backward(engine(**global_batch(0, MICRO)).loss)
        engine.step()
        engine.save_checkpoint(str(directory))
    finally:
        engine.destroy()


def _one_process_weights(directory: Path) -> dict[str, torch.Tensor]:
    """The weights in the model files of ``directory``'s latest checkpoint."""
    tag = directory / (directory / "latest").read_text().strip()
    weights: dict[str, torch.Tensor] = {}
    for shard in sorted(tag.glob("model-*.safetensors")):
        weights.update(safetensors.torch.load_file(shard))
    return weights


def test_two_nodes_with_bf16_compute_shard_the_master_and_gather_the_shadow(tmp_path: Path) -> None:
    """bf16 compute, fp32 masters, 2 nodes (issue 34): each node holds the whole bf16 shadow
    it streams and only its span of the fp32 master, of Adam's moments and of the held
    gradients (2 + (12 + g)/N B/param, g the held gradients' bytes), the shadow is its
    master rounded in the span it stepped and what the other node sent in the other, both
    nodes stream the same shadow, and the nodes gather the shadow (2 B/param per step), not
    the master. They train as one bf16 process with both batches does (a one-process engine
    run here, the reference), and close to fp32 plain PyTorch. Checkpoints: the nodes' one
    (span files with the fp32 masters, bf16 model files) loads into one process with the
    masters exact; the one process's (fp32 model files) loads into each node's spans exactly.
    With the NVMe tier on each node the run is the same to the bit."""
    steps, accumulation = 2, 1
    by_one, by_nodes = tmp_path / "checkpoint_of_one", tmp_path / "checkpoint_of_nodes"
    single = _one_bf16_process(steps, accumulation, save_to=by_one)
    launch_nodes(
        2,
        tmp_path,
        "parity",
        "--steps",
        str(steps),
        "--accumulation",
        str(accumulation),
        "--bf16",
        "--save-to",
        str(by_nodes),
        "--save-at",
        str(steps),
        "--load-after",
        str(by_one),
    )
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert all(rank["shadows_match"] for rank in ranks)
    for key, value in ranks[0]["state_dict"].items():
        assert torch.equal(value, ranks[1]["state_dict"][key]), key
    for ours, theirs in zip(ranks[0]["flat_states"], ranks[1]["flat_states"]):
        assert torch.equal(ours["shadow"], theirs["shadow"])  # both nodes stream the same weights
    expected, _ = reference_training(steps, accumulation, world_size=2)
    assert relative_error(ranks[0]["state_dict"], expected) < 2e-2  # bf16 forward and backward
    _assert_bf16_node_shares(ranks, held_gradient_bytes=2)  # bf16 held gradients: no accumulation
    _assert_bf16_network(ranks, steps, accumulation)

    # The nodes' fp32 masters, joined from their spans, are the one process's.
    masters = _joined(ranks, "flat_states", "master")
    for joined, reference in zip(masters, single["states"]):
        assert (joined - reference["master"]).norm() / reference["master"].norm() < BF16_PARITY
    # The one process's checkpoint (fp32 model files, per-parameter optimizer files) loaded
    # into the nodes: each node's master and moments spans are exactly its values.
    for loaded, reference in zip(_joined(ranks, "loaded_states", "master"), single["states"]):
        assert torch.equal(loaded, reference["master"])
    for loaded, reference in zip(_joined(ranks, "loaded_states", "exp_avg"), single["states"]):
        assert torch.equal(loaded, reference["exp_avg"])
    for rank in ranks:
        for loaded, reference in zip(rank["loaded_states"], single["states"]):
            assert torch.equal(loaded["shadow"], reference["master"].bfloat16())
    _assert_nodes_checkpoint_loads_exactly(by_nodes / f"global_step{steps}", ranks)

    _assert_the_tier_changes_nothing(tmp_path, ranks, steps, accumulation)


def _assert_the_tier_changes_nothing(tmp_path: Path, ranks: list[dict], steps: int, accumulation: int) -> None:
    """The same bf16 run with Adam's moments on each node's NVMe tier: the same arithmetic,
    so the same weights and norms to the bit, and the same sharded master in host memory."""
    on_tier = tmp_path / "tier"
    on_tier.mkdir()
    common = ("parity", "--steps", str(steps), "--accumulation", str(accumulation), "--bf16")
    launch_nodes(2, on_tier, *common, "--nvme", str(tmp_path / "swap"))
    reports = [torch.load(on_tier / f"rank{r}.pt") for r in range(2)]
    _assert_placement_agrees(reports)  # bf16 nodes with "optimizer": placement = allocations = preflight
    for rank, report in enumerate(reports):
        assert report["norms"] == ranks[rank]["norms"]
        for key, value in report["state_dict"].items():
            assert torch.equal(value, ranks[rank]["state_dict"][key]), key
        for kind in ("master", "shadow", "grad"):
            assert report["host_bytes"][kind] == ranks[rank]["host_bytes"][kind], kind
        # The node's span of m: the blocks' on the tier, the resident state's in host memory.
        assert (
            4 * sum(report["tier"]["numels"]) + report["host_bytes"]["exp_avg"] == ranks[rank]["host_bytes"]["exp_avg"]
        )


BF16_PARITY = 1e-3
"""2 bf16 nodes against one bf16 process after 2 steps, relative error of the fp32 masters:
the same arithmetic but for the gradients (each node's bf16 gradient of its rows, averaged,
against one of all rows) and Adam normalises those differences into each update (lr 1e-3)."""


def _one_bf16_process(steps: int, accumulation: int, save_to: Path) -> dict:
    """One process, bf16 compute, the global batch of 2 ranks at once (rank 0's initial
    weights): its flat states after ``steps``, and its checkpoint saved then."""
    torch.manual_seed(0)
    settings = worker_config(accumulation, world_size=1, micro=MICRO * 2)
    engine = MegatrainEngine(
        tiny_models.llama(num_layers=4), parse_engine_config({**settings, "bf16": {"enabled": True}})
    )
    try:
        for step in range(steps):
            for micro in range(accumulation):
                engine.backward(engine(**global_batch(step * accumulation + micro, MICRO * 2)).loss)
                engine.step()
        engine.settle_optimizer()  # one process: the last update lands behind step(); read it landed
        states = [{"master": s.master.clone(), "exp_avg": s.exp_avg.clone()} for s in engine.states]
        engine.save_checkpoint(str(save_to))
        return {"states": states}
    finally:
        engine.destroy()


def _joined(ranks: list[dict], report: str, kind: str) -> list[torch.Tensor]:
    """Every state's ``kind``, joined from the nodes' spans (one rank per node)."""
    joined = []
    for index, numel in enumerate(ranks[0]["numels"]):
        states = sorted((rank[report][index] for rank in ranks), key=lambda state: state["held"])
        position = 0
        for state in states:  # the spans tile the state, and the master holds just the span
            assert state["held"][0] == position and state["master_held"] == state["held"], state["held"]
            position = state["held"][1]
        assert position == numel
        joined.append(torch.cat([state[kind] for state in states]))
    return joined


def _assert_bf16_node_shares(ranks: list[dict], held_gradient_bytes: int) -> None:
    """Per node (one rank each): the shadow whole, 2 B/param, and its span of the master and
    the moments (4 B/param each) and of the held gradients: 2 + (12 + g)/N B/param."""
    _assert_placement_agrees(ranks)
    nodes, numels = len(ranks), ranks[0]["numels"]
    numel = sum(numels)
    ownership = Ownership.of([[node] for node in range(nodes)], 0)
    for node, rank in enumerate(ranks):
        held = dict(rank["host_bytes"])
        # The speculative step's journal is sized by its budget (optimizer/journal.py), not per parameter.
        journal = held.pop("journal", 0)
        assert journal <= AUTO_JOURNAL_BYTES_PER_PARAM * numel
        span = sum(end - start for _, start, end in (ownership.spans(n)[node] for n in numels))
        expected = {"shadow": 2 * numel, "master": 4 * span, "exp_avg": 4 * span, "exp_avg_sq": 4 * span}
        assert held == {**expected, "grad": held_gradient_bytes * span}, held
        slack = len(numels) * nodes * ALIGN_ELEMENTS * 4  # spans aligned: at most this off 1/N
        bound = (2 + (12 + held_gradient_bytes) / nodes) * numel + slack
        assert sum(held.values()) <= bound, (sum(held.values()) / numel, bound / numel)
        print(f"node {node}: {sum(held.values()) / numel:.3f} B/param ({held})")  # the report's figure


def _assert_bf16_network(ranks: list[dict], steps: int, accumulation: int) -> None:
    """What each node leader hands the collectives: the bf16 gradients reduced once per
    micro-batch, the fp32 initial weights broadcast once, then per step the bf16 shadow
    (each element once): no more than one all-reduce of bf16 gradients per step. The
    worker's ``state_dict()`` adds the nodes' spans of the fp32 master, each element once."""
    numel = sum(ranks[0]["numels"])
    for rank in ranks:
        counted = rank["collective_elements"]
        # initial fp32 + a shadow per step + the fp32 masters of state_dict()
        assert counted["broadcast_bytes"] == 4 * numel + 2 * numel * steps + 4 * numel
        assert counted["broadcast"] == numel * (steps + 2)
        assert counted["reduce_bytes"] <= 2 * numel * steps * accumulation  # bf16 gradients


def _assert_nodes_checkpoint_loads_exactly(tag_dir: Path, ranks: list[dict]) -> None:
    """The nodes' checkpoint: bf16 model files (config.json says so, from_pretrained loads
    them as the shadow) and span files with the masters, which one process restores exactly.
    ``dtype="auto"`` reads the dtype from config.json; it is from_pretrained's default from
    transformers 5.0, below which the default is fp32 whatever the files hold."""
    assert json.loads((tag_dir / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tag_dir, dtype="auto")
    masters = ranks[0]["state_dict"]  # the fp32 masters: the shadow is them rounded (shadows_match)
    for name, value in loaded.state_dict().items():
        assert value.dtype == torch.bfloat16 and torch.equal(value, masters[name].bfloat16()), name
    torch.manual_seed(1)
    settings = worker_config(1, world_size=1, micro=MICRO * 2)
    engine = MegatrainEngine(
        tiny_models.llama(num_layers=4), parse_engine_config({**settings, "bf16": {"enabled": True}})
    )
    try:
        engine.load_checkpoint(str(tag_dir.parent))
        masters, moments = _joined(ranks, "flat_states", "master"), _joined(ranks, "flat_states", "exp_avg")
        for state, master, exp_avg, node in zip(engine.states, masters, moments, ranks[0]["flat_states"]):
            assert torch.equal(state.master, master) and torch.equal(state.exp_avg, exp_avg)
            assert state.shadow is not None and torch.equal(state.shadow, node["shadow"])
            state.master.zero_()
        engine.load_checkpoint(str(tag_dir.parent), load_module_only=True)  # the weights alone: exact too
        for state, master in zip(engine.states, masters):
            assert torch.equal(state.master, master)
    finally:
        engine.destroy()


def test_nodes_shard_the_optimizer_state_and_a_checkpoint_reshards(tmp_path: Path) -> None:
    """2 nodes of 2 ranks (as GROUP_RANK names them), one global batch of 4 rows: they
    train as one process with the whole batch does, each node holding its share of the
    optimizer state. The checkpoint they write at step 2 (each node its span file) resumes
    in one process with Adam's moments on the NVMe tier, which saves it again as soon as it
    has loaded it (per parameter, as one node does), and on 4 nodes of one rank, each
    keeping its quarter, its moments on its own NVMe tier. Both continue as the
    uninterrupted run. (Span files read by other partitions: tests/test_optimizer_spans.py;
    a one-process checkpoint loaded by several nodes: the bf16 test above.) The 4 nodes then
    train from the start with every weight frozen but the blocks' input norms, the weights on
    the tier (issue 44, ``_assert_frozen_apart_on_rank_tiers``): a block's trained prefix is
    one window, so 3 of the 4 ranks hold an empty window of it (an empty swap file) beside
    their windows of its frozen weights."""
    checkpoint, steps, save_at = tmp_path / "checkpoint", 4, 2
    common = ("parity", "--steps", str(steps), "--rows", "4", "--accumulation", "2")
    runs = {name: tmp_path / name for name in ("straight", "on1", "on4")}
    for directory in runs.values():
        directory.mkdir()
    launch_nodes(2, runs["straight"], *common, "--save-to", str(checkpoint), "--save-at", str(save_at), per_node=2)
    straight = [torch.load(runs["straight"] / f"rank{r}.pt") for r in range(4)]
    expected, expected_norms = reference_training(steps, 2, world_size=2)  # 4 rows of MICRO = 2 ranks' worth
    for rank in straight:
        assert relative_error(rank["state_dict"], expected) < 2e-6
        assert rank["norms"] == pytest.approx(expected_norms, rel=1e-5)
    _assert_node_shares(straight, nodes=2, per_node=2)
    # Network: each gradient element goes through one reduce per micro-batch (to its owner:
    # a reduce-scatter), and each weight through one broadcast per step after the first
    # (from its node: an all-gather), with the initial weights broadcast once. In fp32 that
    # is the bytes of one all-reduce of the gradients per step.
    numel, micro_batches = sum(straight[0]["numels"]), steps * 2
    for rank in straight:
        reduced = rank["collective_elements"]["reduce"]
        assert numel - 64 * len(straight[0]["numels"]) <= reduced / micro_batches <= numel  # without end padding
    for leader in straight[::2]:
        assert leader["collective_elements"]["broadcast"] == numel * (steps + 1)
    for other in straight[1::2]:
        assert other["collective_elements"]["broadcast"] == 0  # not a node leader: no part in the gather
    assert sorted(p.name for p in (checkpoint / f"global_step{save_at}").glob("optimizer*")) == [
        "optimizer-spans-00001-of-00002.safetensors",
        "optimizer-spans-00002-of-00002.safetensors",
    ]

    by_one = tmp_path / "checkpoint_of_one"
    resume_and_save = ("--resume-from", str(checkpoint), "--save-to", str(by_one), "--save-at", str(save_at))
    # With the moments on its NVMe tier: the span files are read into the swap files.
    launch("parity", runs["on1"], *common[1:], *resume_and_save, "--nvme", str(tmp_path / "swap"), nproc=1)
    assert sorted(p.name for p in (by_one / f"global_step{save_at}").glob("optimizer*")) == [
        "optimizer-00001-of-00001.safetensors"
    ]
    # The 4 nodes keep the moments of their spans on the NVMe tier, each on its own disk; then
    # they train again, frozen but for the input norms of blocks 1-3, with the weights on the
    # tier: block 0 has nothing trained, its frozen weights alone on the ranks' tiers.
    swap = ("--nvme", str(tmp_path / "swap"), "--then-frozen-on-tier", "all-but-later-input-norms")
    launch_nodes(4, runs["on4"], *common, "--resume-from", str(checkpoint), *swap)
    on1 = torch.load(runs["on1"] / "rank0.pt")
    on4 = [torch.load(runs["on4"] / f"rank{r}.pt") for r in range(4)]
    frozen = [torch.load(runs["on4"] / f"frozen{r}.pt") for r in range(4)]
    _assert_frozen_apart_on_rank_tiers(frozen, "all-but-later-input-norms", steps, accumulation=2)
    assert [any(report["tier"]["numels"]) for report in frozen] == [True, False, False, False]
    assert frozen[0]["trained_numels"][0] == 0 and all(t > 0 for t in frozen[0]["trained_numels"][1:])
    _assert_node_shares(on4, nodes=4, per_node=1, tier=True)
    for resumed in (on1, on4[0]):
        assert relative_error(resumed["state_dict"], straight[0]["state_dict"]) < 2e-6
        assert resumed["norms"] == pytest.approx(straight[0]["norms"][save_at:], rel=1e-5)


def test_gradient_all_reduce_starts_while_backward_runs(tmp_path: Path) -> None:
    launch("order", tmp_path)
    for rank in range(2):
        log = json.loads((tmp_path / f"order{rank}.json").read_text())
        # State 4 is the head (resident), reduced parameter by parameter; the last block's
        # gradient is reduced next, while three blocks (0.1 s each) remain.
        assert [index for index, _ in log["starts"] if index < 4] == [3, 2, 1, 0]
        during_backward = [t for _, t in log["starts"] if log["backward_start"] < t < log["backward_end"]]
        assert len(during_backward) >= 3, log


@pytest.mark.parametrize("layout", ["one node", "one rank per node"])
def test_a_dead_rank_stops_the_survivor_with_a_clear_error(tmp_path: Path, layout: str) -> None:
    """Rank 1 is killed in step 2 (with one rank per node: a whole node dies). The survivor
    stops with ``PeerFailureError`` well within the collective timeout, and the checkpoint
    saved at step 1 (each node's span of the optimizer state) is intact: it loads.

    The ranks are forked with the variables a launch by hand sets (``--bare-env``: none
    names the node, so the hostname does), and nothing stops the survivor but itself
    (``--no-kill``: a launcher that stopped it would hide whether it notices)."""
    checkpoint = tmp_path / "checkpoint"
    per_node = ["--one-rank-per-node"] if layout != "one node" else []
    command = [sys.executable, str(FORKED_RANKS), "--per-node", "2", "--port", str(free_port())]
    command += ["--no-kill", "--bare-env", str(WORKER), "die", "--out", str(tmp_path), "--timeout", "60"]
    command += [*per_node, "--save-to", str(checkpoint)]
    result = fork_server.run(command, env=_env(), timeout=TIMEOUT_S)
    stderr = result.stderr  # both ranks': the victim's ends where it was killed
    assert (tmp_path / "killed").exists(), stderr[-6000:]  # it died where it was meant to
    elapsed = time.time() - float((tmp_path / "killed").read_text())
    assert f"forked_ranks: rank 1 exited with {-signal.SIGKILL}" in stderr, stderr[-3000:]
    assert "forked_ranks: rank 0 exited with 1" in stderr, stderr[-3000:]  # the survivor failed
    assert "PeerFailureError" in stderr and "rank 0 of 2" in stderr, stderr[-3000:]
    assert "died or stopped responding" in stderr
    if layout == "one node":
        # Launched by hand, no variable names the node: the hostname does, and rank 0 says so once.
        warning = "no launcher variable (GROUP_RANK, CROSS_RANK, NODE_RANK) names the node"
        assert stderr.count(warning) == 1, stderr[-3000:]
    assert elapsed < 60, f"the survivor took {elapsed:.0f} s to stop"
    # The last checkpoint is whole: one process loads it (resharded from two nodes' spans).
    torch.manual_seed(1)
    engine = MegatrainEngine(tiny_models.llama(num_layers=4), parse_engine_config(worker_config(1, 1)))
    path, _ = engine.load_checkpoint(str(checkpoint))
    assert path is not None and Path(path).name == "global_step1" and engine.global_steps == 1
    engine.destroy()
