"""Data parallelism on torch.distributed: who shares memory with whom, and the collectives.

One process per device (``torchrun``, ``accelerate launch``, the ``deepspeed``
launcher). Every rank streams all blocks to its own device and computes the gradients
of its own micro-batch; what is shared is decided here.

A node is named by the launcher, not by the hostname: torchrun's ``GROUP_RANK``, the
deepspeed launcher's ``CROSS_RANK``, or ``NODE_RANK``; the hostname only when none is set.
Ranks of one named node on different hosts are an error (``[Note: node identity]``).

[Note: data-parallel step]
- Host state (``[Note: sharded host state]``): the ranks of a node map one copy of its
  state (``runtime/node_shared_memory.py``). Every rank *owns* one window of every flat state
  (``distributed/ownership.py``): it alone accumulates, clips and steps those elements, so
  optimizer work is split over all ranks, never repeated.
- Gradients: as soon as a block's backward is done its gradient is reduced to the owners
  of its windows, one reduce per owner for the whole block (a bucket), on its own stream
  and thread (``distributed/gradient_reducer.py``), while backward goes on with the blocks
  before it: the bytes of a reduce-scatter. With gradient accumulation every micro-batch
  is reduced (sum over ranks and micro-batches commutes), so no rank ever needs a private
  full-size gradient buffer.
- Norm: each rank sums the squares of its window; the sum over all ranks is the global
  norm, identical on every rank.
- Step: each rank updates its window of the weights; after a node barrier each node's
  leader sends its span of the updated streamed weights (the master, or the bf16 shadow
  where the master is sharded) to the other nodes' leaders (an all-gather, as broadcasts
  from each span's leader), and after a second node barrier every rank reads the whole
  updated model.
- Weights on the NVMe tier (``"nvme_offload": "all"``): no node holds the blocks' weights;
  each rank keeps its window of each block (master, m, v) on its own disk, nothing is sent
  after the step, and every use of a block gathers it from the windows
  (``distributed/gathered_weights.py``: [Note: gathered weights]).
- Failure: every collective runs on groups created with the engine's timeout
  (``megatrain.collective_timeout_s``); a dead peer breaks gloo/NCCL connections at once
  and a hung one times out, and either surfaces as :class:`PeerFailureError`.

[Note: sharded host state]
Each node keeps whole only the weights it streams (the fp32 master; with bf16 compute the
bf16 shadow), and only its span of the rest: Adam's m and v, the held gradients and, with
bf16 compute, the fp32 master (``Where.NODE_SPAN`` in ``state/placement.py``).
Per node that is ``W + S/N`` bytes/param for N nodes (fp32 with held gradients: W = 4,
S = 12, 7 B/param on 4 nodes instead of 16; bf16 compute: W = 2, S = 4 + 8 + the held
gradients' 2 or 4, 6 B/param on 4 nodes instead of 18), and each node's optimizer work is 1/N.
Network bytes per step: the reduce of the gradients (a reduce-scatter, (N-1)/N of the
gradient bytes) and the gather of the updated streamed weights ((N-1)/N of their bytes:
the fp32 master, or the bf16 shadow that each rank rounded from its window of the master
as it stepped it): one all-reduce of the gradients' worth. The first node's initial fp32
weights are broadcast as each state is migrated, the one time a node has them whole.
Within a node the ranks share that copy instead of each holding its own: sharding within
the node would still need every rank's own copy of the streamed weights (``16 + 4 (n - 1)``
B/param for ``n`` fp32 ranks).
"""

from __future__ import annotations

import datetime
import functools
import logging
import os
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist

from megatrain_ds.distributed.ownership import Ownership
from megatrain_ds.runtime.device_runtime import take_local_device
from megatrain_ds.runtime.node_shared_memory import NodeSharedMemory
from megatrain_ds.runtime.stream_check import declare_access
from megatrain_ds.state.host_store import HostFlatState
from megatrain_ds.state.placement import Topology
from megatrain_ds.state.state_placement import StatePlacement

T = TypeVar("T")
logger = logging.getLogger(__name__)


class PeerFailureError(RuntimeError):
    """A collective failed or timed out: another rank died or hung."""


# [Note: node identity]
# A node is the set of ranks that map one copy of the host state, so it must be one
# machine (one kernel: memfd is shared through /proc/<pid>/fd). The launcher knows which
# node started each process; the hostname does not (two machines, or containers, may share
# a name). The variables, first present wins:
#   GROUP_RANK   torchrun's node rank (its elastic agent sets it; `accelerate launch` on
#                GPUs runs torchrun, so Accelerate's multi-GPU launches set it too)
#   CROSS_RANK   the deepspeed launcher's node rank (deepspeed/launcher/launch.py; with
#                CROSS_SIZE and LOCAL_SIZE, its ranks per node)
#   NODE_RANK    the conventional variable (Accelerate's forked launcher reads it; set by
#                hand or by a cluster's job script)
# With none of them the hostname is the node (logged once). The claim is checked against
# the hostnames: ranks of one claimed node on different hosts cannot share memory and raise;
# ranks of different claimed nodes on one host (simulated nodes, containers) are fine, they
# just keep separate copies. The ranks per node the launcher states (LOCAL_WORLD_SIZE,
# LOCAL_SIZE) must match what the ranks found, and LOCAL_RANK must not repeat on a node.
NODE_RANK_VARIABLES = ("GROUP_RANK", "CROSS_RANK", "NODE_RANK")
LOCAL_SIZE_VARIABLES = ("LOCAL_WORLD_SIZE", "LOCAL_SIZE")  # torchrun's, the deepspeed launcher's
HOSTNAME = "hostname"


@dataclass(frozen=True)
class NodeIdentity:
    """What one rank says about its node; gathered from every rank to group them.

    Attributes:
        node: the node's key: ``"GROUP_RANK=1"`` style when a launcher named it, else the hostname.
        source: the variable the key came from, or ``"hostname"``.
        hostname: this process's host, to check the launcher's claim against.
        local_rank: ``LOCAL_RANK``, when set.
        local_world_size: the ranks on this node the launcher started, when it says.
    """

    node: str
    source: str
    hostname: str
    local_rank: int | None
    local_world_size: int | None


def node_identity(environ: Mapping[str, str] | None = None, hostname: str | None = None) -> NodeIdentity:
    """This process's node as its launcher names it (``[Note: node identity]``)."""
    env = os.environ if environ is None else environ
    host = socket.gethostname() if hostname is None else hostname
    source = next((name for name in NODE_RANK_VARIABLES if env.get(name, "").strip()), HOSTNAME)
    local_size = next((name for name in LOCAL_SIZE_VARIABLES if env.get(name, "").strip()), None)
    return NodeIdentity(
        node=host if source == HOSTNAME else f"{source}={_integer(env, source)}",
        source=source,
        hostname=host,
        local_rank=_integer(env, "LOCAL_RANK") if env.get("LOCAL_RANK", "").strip() else None,
        local_world_size=_integer(env, local_size) if local_size is not None else None,
    )


def _integer(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise ValueError(
            f"megatrain: the launcher variable {name}={env[name]!r} is not an integer; "
            f"unset it or let the launcher (torchrun, deepspeed, accelerate launch) set it"
        ) from None


def group_into_nodes(identities: list[NodeIdentity]) -> dict[str, list[int]]:
    """The ranks of each node (global ranks, ascending), nodes in order of their first rank.

    Raises ``ValueError`` where the launcher's claim cannot be true: one node on several
    hosts, ranks naming their node through different variables, a stated number of ranks per
    node that is not the number found, or a ``LOCAL_RANK`` twice on one node.
    """
    sources = {identity.source for identity in identities}
    if len(sources) > 1:
        raise ValueError(
            f"megatrain: the ranks name their node differently ({', '.join(sorted(sources))}): "
            f"they were not all started by one launcher. Launch every rank with the same "
            f"launcher, or unset the stray variables ({', '.join(NODE_RANK_VARIABLES)})"
        )
    nodes: dict[str, list[int]] = {}
    for rank, identity in enumerate(identities):
        nodes.setdefault(identity.node, []).append(rank)
    for node, members in nodes.items():
        _check_node(node, [identities[rank] for rank in members], members)
    return nodes


def _check_node(node: str, identities: list[NodeIdentity], members: list[int]) -> None:
    hosts = {identity.hostname for identity in identities}
    if len(hosts) > 1:
        by_host = {host: [r for r, i in zip(members, identities) if i.hostname == host] for host in sorted(hosts)}
        raise ValueError(
            f"megatrain: ranks {members} claim the same node ({node}) but run on different hosts "
            f"{by_host}; ranks of one node share host memory, so they must run on one machine. "
            f"Give each machine its own node rank (torchrun --node-rank, deepspeed's hostfile)"
        )
    stated = {identity.local_world_size for identity in identities if identity.local_world_size is not None}
    if stated and stated != {len(members)}:
        raise ValueError(
            f"megatrain: node {node} has ranks {members} ({len(members)}), but the launcher says "
            f"{sorted(stated)} per node ({'/'.join(LOCAL_SIZE_VARIABLES)}). Are two launches "
            f"using the same node rank? Give each launch its own"
        )
    local_ranks = [identity.local_rank for identity in identities if identity.local_rank is not None]
    if len(set(local_ranks)) < len(local_ranks):
        raise ValueError(
            f"megatrain: ranks {members} of node {node} repeat a LOCAL_RANK ({local_ranks}): "
            f"two launches on one machine with the same node rank? Give each launch its own"
        )


def _gather_nodes(rank: int, world_size: int) -> tuple[dict[str, list[int]], str]:
    """Every node's ranks, from every rank's :func:`node_identity`, and this rank's node."""
    gathered: list[NodeIdentity | None] = [None] * world_size
    dist.all_gather_object(gathered, node_identity())
    identities = [identity for identity in gathered if identity is not None]
    assert len(identities) == world_size, gathered
    nodes = group_into_nodes(identities)  # the same list on every rank: all raise alike
    if rank == 0 and identities[0].source == HOSTNAME:
        logger.warning(
            "megatrain: no launcher variable (%s) names the node; grouping the %d ranks into nodes "
            "by hostname (%d nodes): machines with the same name would be taken for one",
            ", ".join(NODE_RANK_VARIABLES),
            world_size,
            len(nodes),
        )
    return nodes, identities[rank].node


def _process_group_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _member(group: dist.ProcessGroup | int | None) -> dist.ProcessGroup:
    """A group from ``dist.new_group`` that this rank belongs to (a rank outside the group
    gets ``GroupMember.NON_GROUP_MEMBER``, an int, instead of a ``ProcessGroup``)."""
    assert isinstance(group, dist.ProcessGroup), group
    return group


@dataclass
class DataParallel:
    """This rank's place among the data-parallel ranks, and the engine's process groups.

    Attributes:
        rank, world_size: global rank and number of ranks.
        node_index, node_size: this rank's index among its node's ranks, and their number.
        comm_group: the gradient all-reduce group (NCCL on CUDA, gloo on the CPU).
        control_group: gloo group of every rank, for host-side agreement (checkpoints).
        node_group: gloo group of this node's ranks (shared memory, norm, barriers).
        leaders_group: gloo group of each node's first rank; ``None`` on one node.
        gather_group: gloo group of every rank, for the host-side gathers of weights kept
            only as windows (``distributed/gathered_weights.py``), apart from the gradient
            reduces so that neither waits behind the other.
        shared: the node-shared allocator of the host state.
        timeout_s: how long any collective waits for a peer.
        ownership: every rank's window and every node's span of a flat state.
    """

    rank: int
    world_size: int
    node_index: int
    node_size: int
    comm_group: dist.ProcessGroup
    control_group: dist.ProcessGroup
    node_group: dist.ProcessGroup
    leaders_group: dist.ProcessGroup | None
    gather_group: dist.ProcessGroup
    shared: NodeSharedMemory
    timeout_s: float
    ownership: Ownership

    @classmethod
    def join(cls, use_cuda: bool, timeout_s: float) -> DataParallel | None:
        """The data-parallel context of this process, or ``None`` when it trains alone.

        Uses the default process group if the launcher (Accelerate, DeepSpeed) made one,
        else creates it from the ``torchrun`` environment (``WORLD_SIZE`` > 1). On CUDA,
        selects the device ``LOCAL_RANK``.
        """
        if not dist.is_initialized():
            if _process_group_env() <= 1:
                return None
            dist.init_process_group(
                backend="nccl" if use_cuda else "gloo", timeout=datetime.timedelta(seconds=timeout_s)
            )
        world_size = dist.get_world_size()
        if world_size == 1:
            return None
        rank = dist.get_rank()
        if use_cuda and "LOCAL_RANK" in os.environ:
            take_local_device(int(os.environ["LOCAL_RANK"]))
        timeout = datetime.timedelta(seconds=timeout_s)
        nodes, my_node = _gather_nodes(rank, world_size)
        # new_group is collective over the whole world, in the same order everywhere.
        comm_group = _member(dist.new_group(backend="nccl" if use_cuda else "gloo", timeout=timeout))
        control_group = _member(dist.new_group(backend="gloo", timeout=timeout))
        gather_group = _member(dist.new_group(backend="gloo", timeout=timeout))
        node_group = None
        for members in nodes.values():
            group = dist.new_group(ranks=members, backend="gloo", timeout=timeout)
            if rank in members:
                node_group = _member(group)
        leaders = [members[0] for members in nodes.values()]
        leaders_group = dist.new_group(ranks=leaders, backend="gloo", timeout=timeout) if len(leaders) > 1 else None
        mine = nodes[my_node]
        assert node_group is not None
        return cls(
            rank=rank,
            world_size=world_size,
            node_index=mine.index(rank),
            node_size=len(mine),
            comm_group=comm_group,
            control_group=control_group,
            node_group=node_group,
            leaders_group=_member(leaders_group) if leaders_group is not None and rank in leaders else None,
            gather_group=gather_group,
            shared=NodeSharedMemory(node_group, writer=mine[0], rank=rank),
            timeout_s=timeout_s,
            ownership=Ownership.of(list(nodes.values()), rank),
        )

    @property
    def is_node_writer(self) -> bool:
        return self.shared.is_writer

    @property
    def num_nodes(self) -> int:
        return len(self.ownership.nodes)

    def window(self, numel: int) -> tuple[int, int]:
        """``[start, end)``: the elements of a ``numel``-element state this rank owns."""
        return self.ownership.window(numel)

    def span(self, numel: int) -> tuple[int, int]:
        """``[start, end)``: the elements of a sharded ``numel``-element state this node holds."""
        return self.ownership.span(numel)

    @property
    def topology(self) -> Topology:
        """What the placement of the state needs of the ranks (``state/placement.py``): this
        node's ranks, its span with several nodes, this rank's window and its node's ranks'."""
        members = set(self.ownership.nodes[self.ownership.node])

        def node_windows(numel: int) -> list[tuple[int, int]]:
            # Every rank's, empty ones too: the n-th is the same rank's for every state.
            return [(start, end) for owner, start, end in self.ownership.every_window(numel) if owner in members]

        return Topology(
            node_ranks=self.node_size,
            span_of=self.span if self.num_nodes > 1 else None,
            window_of=self.window,
            node_windows_of=node_windows,
            world_size=self.world_size,
        )

    # -- collectives (each wrapped so a peer's failure reads as one) ---------------------

    def reduce_mean_to_owners(
        self, flat: torch.Tensor, offset: int, windows: list[tuple[int, int, int]]
    ) -> tuple[int, torch.Tensor] | None:
        """Average ``flat`` (elements ``[offset, offset + len)`` of a state whose windows are
        ``windows``) over every rank, delivering each owner its part: one reduce per owner,
        the bytes of a reduce-scatter. Returns this rank's ``(state offset, averaged part)``,
        or ``None`` where it owns none of ``flat``. ``flat`` is scratch afterwards."""
        flat.div_(self.world_size)  # divided first: gloo has no AVG
        end, mine = offset + flat.numel(), None
        for owner, start, stop in windows:
            lo, hi = max(start, offset), min(stop, end)
            if lo >= hi:
                continue
            part = flat[lo - offset : hi - offset]
            reduce = functools.partial(dist.reduce, part, dst=owner, op=dist.ReduceOp.SUM, group=self.comm_group)
            self._guard("the gradient reduce", reduce)
            if owner == self.rank:
                mine = (lo, part)
        return mine

    def world_sum(self, value: float) -> float:
        """``value`` summed over every rank (float64: the squared gradient norm of the windows)."""
        total = torch.tensor([value], dtype=torch.float64)
        self._guard("the gradient-norm all-reduce", lambda: dist.all_reduce(total, group=self.control_group))
        return float(total.item())

    def gather_spans_(self, flat: torch.Tensor) -> list[tuple[int, int]]:
        """Give this node's copy of ``flat`` (a whole state; a no-op but on node leaders)
        every other node's span of it: one broadcast from each span's leader (an
        all-gather). Returns the ``[start, end)`` spans received."""
        received: list[tuple[int, int]] = []
        if self.leaders_group is None:
            return received
        for leader, start, end in self.ownership.spans(flat.numel()):
            if start < end:
                send = functools.partial(dist.broadcast, flat[start:end], src=leader, group=self.leaders_group)
                self._guard("the updated-weight all-gather", send)
                if leader != self.rank:
                    received.append((start, end))
        return received

    def gather_spans_to_every_rank_(self, flat: torch.Tensor, what: str) -> None:
        """Give every rank's ``flat`` (a whole state, this node's span already in place) every
        other node's span of it: one broadcast from each span's node leader over the control
        group. Unlike :meth:`gather_spans_` every rank joins and receives, not only the node
        leaders: for what each process keeps for itself (a state dict of sharded masters).
        Every rank must call it, with states in the same order."""
        for leader, start, end in self.ownership.spans(flat.numel()):
            if start < end:
                send = functools.partial(dist.broadcast, flat[start:end], src=leader, group=self.control_group)
                self._guard(what, send)

    def gather_windows_(self, whole: torch.Tensor, mine: torch.Tensor, what: str) -> None:
        """Fill ``whole`` (``world_size`` windows of ``mine``'s size, in position order: the
        :class:`Ownership` layout) with every rank's ``mine``: an all-gather over the gather
        group, whose ranks come in global order, so each rank's part lands at its position."""
        chunk = mine.numel()
        by_position = {rank: position for position, rank in enumerate(self.ownership.positions)}
        parts = [whole[by_position[rank] * chunk : (by_position[rank] + 1) * chunk] for rank in range(self.world_size)]
        self._guard(what, lambda: dist.all_gather(parts, mine, group=self.gather_group))

    def broadcast_from_rank0_(self, tensor: torch.Tensor) -> None:
        """Give every rank rank 0's values of ``tensor`` (every rank calls this)."""
        self._guard("the initial weight broadcast", lambda: dist.broadcast(tensor, src=0, group=self.control_group))

    def gather_updated_weights(
        self, states: Sequence[HostFlatState], placements: Sequence[StatePlacement], step: int, changed: bool
    ) -> None:
        """After every rank has stepped its window of ``states`` in optimizer step ``step``:
        every node's copy of the weights gets the other nodes' updated spans ([Note: sharded
        host state]), each state's whole weights where its placement says they are;
        ``changed``: the step updated the weights (it was not skipped)."""
        # Sync: every rank of the node has written its window before the leader sends them.
        self.node_barrier(f"the end of optimizer step {step}")
        if self.num_nodes == 1:
            return  # one node: its copy is whole already
        if changed:
            for state, placement in zip(states, placements):
                if placement.gathered:
                    continue  # never sent after a step: the next use gathers it from the windows
                # Only the stepped elements changed (frozen weights after them never do), and
                # the spans are of those (HostFlatState.stepped_numel).
                weights = getattr(state, placement.weights_in)[: state.stepped_numel]
                received = self.gather_spans_(weights)
                if placement.weights_in == "shadow":
                    # A sharded master: the shadow is what the nodes hold whole, and each rank
                    # rounded its window into it as it stepped (HostAdamW.update_range), so the
                    # shadow's spans are gathered (2 bytes/param in bf16), nothing refreshed.
                    # gloo writes the received spans unseen by aten; the race checker sees
                    # them as it saw the refresh of the shadow they replace.
                    declare_access(writes=[weights[start:end] for start, end in received], what="the shadow gather")
                    continue
                for start, end in received:
                    state.refresh_shadow(start, end)  # the received spans' compute copy
        # Sync: the next forward streams the weights the leader has just received.
        self.node_barrier(f"the weight gather of optimizer step {step}")

    def node_barrier(self, what: str) -> None:
        """Wait for every rank of the node; names the ranks that do not arrive."""
        self._guard(
            what,
            lambda: dist.monitored_barrier(
                group=self.node_group, timeout=datetime.timedelta(seconds=self.timeout_s), wait_all_ranks=True
            ),
        )

    def world_barrier(self, what: str) -> None:
        """Wait for every rank; names the ranks that do not arrive."""
        self._guard(
            what,
            lambda: dist.monitored_barrier(
                group=self.control_group, timeout=datetime.timedelta(seconds=self.timeout_s), wait_all_ranks=True
            ),
        )

    def on_rank0(self, what: str, action: Callable[[], None]) -> None:
        """Run ``action`` on global rank 0 only; every rank returns once it is done, and
        raises if it failed there (so no rank goes on believing it succeeded)."""
        self.from_rank0(what, action)

    def from_rank0(self, what: str, action: Callable[[], T]) -> T:
        """``action()`` run on global rank 0, its result given to every rank; every rank
        raises if it failed there."""
        outcome: list[object] = [None, None]  # (result, error)
        if self.rank == 0:
            try:
                outcome = [action(), None]
            except BaseException as error:
                outcome = [None, f"{type(error).__name__}: {error}"]
                self._guard(what, lambda: dist.broadcast_object_list(outcome, src=0, group=self.control_group))
                raise
        self._guard(what, lambda: dist.broadcast_object_list(outcome, src=0, group=self.control_group))
        if outcome[1] is not None:
            raise RuntimeError(f"megatrain: rank 0 failed at {what}: {outcome[1]}")
        return outcome[0]  # type: ignore[return-value]  # rank 0's T, sent over the control group

    def all_gather_object(self, what: str, value: T) -> list[T]:
        """Every rank's ``value`` (small, picklable: sent between these processes only)."""
        gathered: list[T | None] = [None] * self.world_size
        self._guard(what, lambda: dist.all_gather_object(gathered, value, group=self.control_group))
        return gathered  # type: ignore[return-value]  # every slot filled by all_gather_object

    def broadcast_from_first_node_(self, tensor: torch.Tensor) -> None:
        """Give every node's copy the first node's values (node writers only)."""
        if self.leaders_group is not None:
            leader = dist.get_global_rank(self.leaders_group, 0)
            self._guard(
                "the initial weight broadcast", lambda: dist.broadcast(tensor, src=leader, group=self.leaders_group)
            )

    def _guard(self, what: str, collective: Callable[[], T]) -> T:
        start = time.monotonic()
        try:
            return collective()
        except Exception as error:  # gloo/NCCL raise RuntimeError or DistBackendError
            raise PeerFailureError(
                f"megatrain: rank {self.rank} of {self.world_size}: {what} failed after "
                f"{time.monotonic() - start:.1f} s; another rank died or stopped responding "
                f"(collectives wait at most {self.timeout_s:g} s, megatrain.collective_timeout_s). "
                f"Look for the first error in the other ranks' logs. Cause: {error}"
            ) from error
