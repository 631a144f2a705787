"""Runs the model's blocks from streamed weights: checkpointed forward, recomputing backward.

The model's own ``forward`` runs unchanged; each block's ``forward`` is redirected here
(``install``). With gradients enabled a block runs inside :class:`_StreamedBlockFn`:

- forward: weights are acquired from the :class:`WeightStreamer`, the block runs with no
  autograd graph, and only the *segment start*'s inputs are kept (the activation
  checkpoint; a segment is ``checkpoint_interval`` consecutive blocks).
- backward: the first backward call in a segment recomputes the whole segment from its
  checkpoint with block-local graphs (weights re-streamed, RNG and autocast state
  restored); each block's call then takes the gradient of its own outputs w.r.t. its
  parameters (pushed, parameter by parameter, to the :class:`GradientSink`) and its
  inputs, and frees its graph and device buffer at once.

A *stashed* block (``"megatrain": {"recompute": ...}``, ``streaming/activation_stash.py``)
is its own segment with no checkpoint: its forward builds the block-local graph at once,
what autograd saves goes to the host stash, and its backward re-acquires the weights and
runs from that graph without recomputing.

With ``checkpoint_interval`` 1 each block's weights cross host->device exactly twice per
step: once in forward, once in backward (stashed or recomputed alike).

Between the step's phases -- blocks forward, head forward and backward, blocks backward,
embedding backward -- the runtime may hand cached transient memory back
(``DeviceRuntime.return_transient_memory``; only where the device is the host).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from megatrain_ds.gradients.outbox import GradientOutbox
from megatrain_ds.gradients.sink import GradientPort
from megatrain_ds.model.block_template import BlockTemplate
from megatrain_ds.model.layer_checkpointing import ReentrantRerunNotice
from megatrain_ds.runtime.device_runtime import DeviceRuntime
from megatrain_ds.state.flat_layout import FROZEN_GROUP
from megatrain_ds.state.host_store import HostFlatState
from megatrain_ds.streaming.activation_offload import ActivationOffloader, HostCheckpoint
from megatrain_ds.streaming.activation_stash import ActivationStash, BlockStash
from megatrain_ds.streaming.weight_streamer import WeightStreamer


@dataclass
class _ReplayState:
    """What a recompute needs to reproduce the forward exactly (dropout, autocast)."""

    cpu_rng: torch.Tensor
    device_rng: torch.Tensor | None
    autocast_enabled: bool
    autocast_dtype: torch.dtype

    @classmethod
    def capture(cls, runtime: DeviceRuntime) -> _ReplayState:
        device_type = runtime.device.type
        return cls(
            cpu_rng=torch.get_rng_state(),
            device_rng=runtime.rng_state(),
            autocast_enabled=torch.is_autocast_enabled(device_type),
            autocast_dtype=torch.get_autocast_dtype(device_type),
        )

    @contextlib.contextmanager
    def replay(self, runtime: DeviceRuntime) -> Iterator[None]:
        devices = [runtime.device] if runtime.is_cuda else []
        with torch.random.fork_rng(devices=devices, device_type=runtime.device.type):
            torch.set_rng_state(self.cpu_rng)
            if self.device_rng is not None:
                runtime.set_rng_state(self.device_rng)
            with torch.autocast(runtime.device.type, dtype=self.autocast_dtype, enabled=self.autocast_enabled):
                yield


@dataclass
class _BlockCall:
    """One block's forward call, as much as its backward needs."""

    index: int
    spec: Any
    leaves: list[Any]
    """Flattened ``(args, kwargs)``; ``None`` where the leaf is a previous block's output,
    a :class:`HostCheckpoint` where the checkpoint was offloaded."""
    tensor_positions: list[int]
    from_previous: dict[int, int]
    """Leaf position -> index of the previous block's tensor output it was."""
    requires_grad: dict[int, bool]
    replay: _ReplayState
    training: bool
    stash: BlockStash | None = None
    """Set for a stashed block: its forward built the graph backward runs from."""
    # Set by the recompute, cleared by the block's backward:
    param_views: list[torch.Tensor] = field(default_factory=list)
    input_leaves: dict[int, torch.Tensor] = field(default_factory=dict)
    outputs: list[torch.Tensor] = field(default_factory=list)


@dataclass
class _Segment:
    calls: list[_BlockCall] = field(default_factory=list)
    recomputed: bool = False
    checkpoint_bytes: int = 0
    stashed: bool = False
    """One stashed block: nothing to recompute, no checkpoint."""


class _StreamedBlockFn(torch.autograd.Function):
    """Autograd node of one streamed block; see the module docstring."""

    @staticmethod
    def forward(
        ctx: Any,
        runner: StreamedBlocks,
        segment: _Segment,
        call: _BlockCall,
        anchor: torch.Tensor,
        *tensors: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        del anchor  # only makes the outputs require grad when no input does
        ctx.runner, ctx.segment, ctx.call = runner, segment, call
        ctx.set_materialize_grads(False)
        leaves = list(call.leaves)
        for position, tensor in zip(call.tensor_positions, tensors):
            leaves[position] = tensor
        if segment.stashed:
            outputs = runner._run_stashed(call, leaves)
        else:
            outputs = runner._run(call.index, call.training, leaves, call.spec)
        out_leaves, out_spec = tree_flatten(outputs)
        ctx.out_spec = out_spec
        runner._pending_structure = (out_leaves, out_spec)
        # detach: a stashed block's outputs carry its block-local graph, which stays inside.
        return tuple(leaf.detach() for leaf in out_leaves if isinstance(leaf, torch.Tensor))

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        runner: StreamedBlocks = ctx.runner
        if ctx.call.stash is not None:
            runner._reattach(ctx.call)
        elif not ctx.segment.recomputed:
            runner._recompute(ctx.segment)
        input_grads = runner._backward_call(ctx.segment, ctx.call, grad_outputs)
        return (None, None, None, None, *input_grads)


def _is_kv_cache(value: Any) -> bool:
    """Duck-typed Hugging Face ``Cache`` (the core does not import transformers)."""
    return hasattr(value, "get_seq_length") and hasattr(value, "update")


class StreamedBlocks:
    """Owns the redirected blocks of one model and runs them from streamed weights.

    Args:
        blocks: the model's block list (the modules stay in the model; only their
            ``forward`` is redirected).
        templates: the template of each block (shared between blocks of one structure).
        states: host state of each block.
        streamer: device buffers and the host-to-device stream.
        sink: where gradients go (device-to-host transport, or the data-parallel reducer).
        runtime: device, streams and events.
        checkpoint_interval: blocks per segment (K); one activation checkpoint each.
        offloader: parks checkpoints in host memory; ``None`` keeps them on the device.
        is_final_micro_batch: whether gradients produced now finish the accumulation window.
        gradient_bucket_elements: a block's gradients go to ``sink`` in buckets of at least
            this many elements, as backward finishes them (:class:`GradientOutbox`).
        stash: holds stashed blocks' saved activations on the host; ``None``: every block
            is recomputed.
        stashes: whether block ``i`` is stashed (asked at each forward; needs ``stash``).
    """

    def __init__(
        self,
        blocks: nn.ModuleList,
        templates: Sequence[BlockTemplate],
        states: Sequence[HostFlatState],
        streamer: WeightStreamer,
        sink: GradientPort,
        runtime: DeviceRuntime,
        checkpoint_interval: int,
        offloader: ActivationOffloader | None,
        is_final_micro_batch: Callable[[], bool],
        gradient_bucket_elements: int,
        stash: ActivationStash | None = None,
        stashes: Callable[[int], bool] = lambda index: False,
    ) -> None:
        self.blocks = blocks
        self.templates = templates
        self.states = states
        self.streamer = streamer
        self.sink = sink
        self.runtime = runtime
        self.checkpoint_interval = checkpoint_interval
        self.offloader = offloader
        self.stash = stash
        self.stashes = stashes
        self._prefetch_with: dict[int, list[HostCheckpoint]] = {}
        self._in_backward = False
        streamer.on_issue = self._send_checkpoints_along
        self._is_final_micro_batch = is_final_micro_batch
        self.gradient_bucket_elements = gradient_bucket_elements
        self._overrides = [t.scalar_overrides(b) for t, b in zip(templates, blocks)]
        self._anchor = torch.empty(0, device=runtime.device, requires_grad=True)
        self._segments: list[_Segment] = []
        self._last: tuple[int, tuple[torch.Tensor, ...]] | None = None
        self._pending_structure: tuple[list[Any], Any] | None = None
        self.live_checkpoint_bytes = 0
        """Device bytes of checkpoints kept on the device (not offloaded)."""
        self.peak_checkpoint_bytes = 0
        """Peak device bytes of checkpoints, kept or in flight back from the host."""
        self._head_backward_pending = False
        """The forward ended and no block's backward has started: the head's is under way."""
        self._reentrant_rerun = ReentrantRerunNotice()

    # -- wiring ---------------------------------------------------------------------

    def install(self) -> None:
        """Redirect every block's ``forward`` to the engine (an instance attribute, so
        ``nn.Module.__call__`` and its hooks still run as the model expects)."""
        for index, block in enumerate(self.blocks):
            block.forward = self._make_forward(index)

    def uninstall(self) -> None:
        for block in self.blocks:
            block.__dict__.pop("forward", None)

    def _make_forward(self, index: int) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            return self._forward_block(index, args, kwargs)

        return forward

    # -- passes -----------------------------------------------------------------------

    def begin_forward(self) -> None:
        """A model forward starts: plan blocks 0..L-1 and forget any unfinished pass."""
        self._segments, self._last = [], None
        self._prefetch_with = {}
        self._in_backward = False
        if self.stash is not None:
            self.stash.begin_pass()
        self.live_checkpoint_bytes = 0
        self.streamer.begin(range(len(self.blocks)))

    def begin_backward(self) -> None:
        """Backward is about to start: plan the segments' blocks in backward order."""
        plan = [call.index for segment in reversed(self._segments) for call in segment.calls]
        # Phase boundary (called after the last block's forward and again from
        # engine.backward): the head's forward or backward comes next, with the step's
        # largest transients (logits); what the previous phase left goes back first.
        self.runtime.return_transient_memory()
        self._head_backward_pending = True
        # Added to, not replaced: engine.backward calls this again after the last block's
        # forward did, with no segments left, and the checkpoints not yet sent along must
        # still travel with their weights. Taken at backward instead, a checkpoint's copy
        # would queue on the h2d stream behind the next block's weights, and the recompute
        # wait for both (one weight copy of idle device per block on the H200).
        self._prefetch_with.update(
            {
                segment.calls[0].index: [leaf for leaf in segment.calls[0].leaves if isinstance(leaf, HostCheckpoint)]
                for segment in self._segments
            }
        )
        self._segments, self._last = [], None
        self._in_backward = True
        if plan:
            self.streamer.begin(plan)

    def _send_checkpoints_along(self, block: int) -> None:
        """A segment's checkpoint, or a stashed block's activations, travel back with the
        weights of its first block."""
        if self.stash is not None and self._in_backward:
            self.stash.prefetch(block)
        if self.offloader is None:
            return
        for checkpoint in self._prefetch_with.pop(block, []):
            self.offloader.prefetch(checkpoint)
        self._note_peak()

    def _note_peak(self) -> None:
        in_flight = self.offloader.device_bytes_in_flight if self.offloader else 0
        self.peak_checkpoint_bytes = max(self.peak_checkpoint_bytes, self.live_checkpoint_bytes + in_flight)

    # -- forward ------------------------------------------------------------------------

    def _run(
        self,
        index: int,
        training: bool,
        leaves: list[Any],
        spec: Any,
        params: list[torch.Tensor] | None = None,
        phase: str | None = None,
    ) -> Any:
        """Run block ``index``; without ``params`` its weights are acquired and released here."""
        args, kwargs = tree_unflatten(leaves, spec)
        layout = self.states[index].layout
        release = params is None
        if params is None:
            params = BlockTemplate.bind(self.streamer.acquire(index), layout)
        # Given weights: the backward's recompute, unless the caller says otherwise.
        phase = phase or ("forward" if release else "recompute")
        with self.runtime.tracer.device_span(f"{phase} {index}", "compute", block=index, phase=phase):
            outputs = self.templates[index].run(
                params, layout, self._overrides[index], training, args, kwargs, before_part=self._part_waiter(index)
            )
        if release:
            self.streamer.release(index)
        return outputs

    def _part_waiter(self, index: int) -> Callable[[int], None] | None:
        """With fragmented streaming, each part of the block waits for its own pieces."""
        if not self.streamer.fragment_elements:
            return None
        return lambda part: self.streamer.wait_for_part(index, part)

    def _forward_block(self, index: int, args: tuple, kwargs: dict[str, Any]) -> Any:
        training = self.blocks[index].training
        if not torch.is_grad_enabled():
            leaves, spec = tree_flatten((args, kwargs))
            return self._run(index, training, leaves, spec)
        self._reentrant_rerun.note_block_called_in_backward(index)  # [Note: layer checkpointing]
        # As under Hugging Face's own gradient checkpointing, a KV cache is not used when
        # training: the recompute would append to it twice, and it would hold every
        # block's keys and values for the whole step.
        if "use_cache" in kwargs:
            kwargs = {**kwargs, "use_cache": False}
        leaves, spec = tree_flatten((args, kwargs))
        leaves = [None if _is_kv_cache(leaf) else leaf for leaf in leaves]

        stashed = self.stash is not None and self.stashes(index)
        continues = (
            self._last is not None
            and self._last[0] == index - 1
            and index % self.checkpoint_interval != 0
            and self._segments
            and not stashed
            and not self._segments[-1].stashed
        )
        if not continues:
            self._segments.append(_Segment(stashed=stashed))
        segment = self._segments[-1]
        previous = self._last[1] if continues and self._last else ()
        tensor_leaves = {p: leaf for p, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)}
        tensor_positions = list(tensor_leaves)
        from_previous: dict[int, int] = {}
        for position in tensor_positions:
            for k, output in enumerate(previous):
                if leaves[position] is output:
                    from_previous[position] = k
        kept = [None if p in from_previous else leaf for p, leaf in enumerate(leaves)]
        # A stashed block keeps no checkpoint: its graph holds what its backward needs.
        checkpointed = [] if continues or stashed else [p for p in tensor_positions if tensor_leaves[p].requires_grad]
        if self.offloader is not None:
            for position in checkpointed:
                kept[position] = self.offloader.offload(tensor_leaves[position])
        call = _BlockCall(
            index=index,
            spec=spec,
            leaves=kept,
            tensor_positions=tensor_positions,
            from_previous=from_previous,
            requires_grad={p: tensor_leaves[p].requires_grad for p in tensor_positions},
            replay=_ReplayState.capture(self.runtime),
            training=training,
        )
        segment.calls.append(call)
        if self.offloader is None:
            added = sum(tensor_leaves[p].numel() * tensor_leaves[p].element_size() for p in checkpointed)
            segment.checkpoint_bytes += added
            self.live_checkpoint_bytes += added
            self._note_peak()

        tensors = _StreamedBlockFn.apply(self, segment, call, self._anchor, *[leaves[p] for p in tensor_positions])
        assert self._pending_structure is not None  # set by the forward _StreamedBlockFn just ran
        out_leaves, out_spec = self._pending_structure
        self._pending_structure = None
        tensor_iter = iter(tensors)
        out_leaves = [next(tensor_iter) if isinstance(leaf, torch.Tensor) else leaf for leaf in out_leaves]
        self._last = (index, tuple(tensors))
        if index == len(self.blocks) - 1:
            self.begin_backward()  # prefetch for backward while the head and loss compute
        return tree_unflatten(out_leaves, out_spec)

    # -- backward ------------------------------------------------------------------------

    def _make_graph_leaves(self, call: _BlockCall, leaves: list[Any], weights: torch.Tensor) -> list[Any]:
        """Detached leaves for a block-local graph: the inputs that carry gradient (into
        ``call.input_leaves``) and one leaf per parameter (into ``call.param_views``)."""
        leaves = list(leaves)
        call.input_leaves = {}
        for position in call.tensor_positions:
            leaf = leaves[position].detach()
            if call.requires_grad[position] and leaf.is_floating_point():
                leaf.requires_grad_(True)
                call.input_leaves[position] = leaf
            leaves[position] = leaf
        # One leaf per parameter (sharing the buffer): each gets its gradient from its
        # own AccumulateGrad node, so it can leave as soon as it is complete.
        layout = self.states[call.index].layout
        call.param_views = [
            view.detach().requires_grad_(slot.group != FROZEN_GROUP)
            for slot, view in zip(layout.slots, BlockTemplate.bind(weights, layout))
        ]
        return leaves

    def _run_stashed(self, call: _BlockCall, leaves: list[Any]) -> Any:
        """Forward of a stashed block: its graph is built now and what it saves is stashed."""
        assert self.stash is not None
        weights = self.streamer.acquire(call.index)
        leaves = self._make_graph_leaves(call, leaves, weights)
        with self.stash.block(call.index, weights) as stash, torch.enable_grad():
            outputs = self._run(call.index, call.training, leaves, call.spec, params=call.param_views, phase="forward")
        self.streamer.release(call.index)  # the forward's kernels are queued; backward re-acquires
        call.stash = stash
        call.outputs = [leaf for leaf in tree_flatten(outputs)[0] if isinstance(leaf, torch.Tensor)]
        call.leaves = []  # nothing to recompute from
        return outputs

    def _leave_head_backward(self) -> None:
        if self._head_backward_pending:  # phase boundary: the head's backward is done
            self._head_backward_pending = False
            self.runtime.return_transient_memory()

    def _reattach(self, call: _BlockCall) -> None:
        """A stashed block's backward is next: its weights again, and its stash on the way."""
        assert call.stash is not None
        self._leave_head_backward()
        call.stash.attach_weights(self.streamer.acquire(call.index))
        # Issued after the weights (normally with them already: a no-op then); waiting for
        # it orders the backward after fragmented weights too ([Note: stash ordering]).
        call.stash.prefetch()

    def _recompute(self, segment: _Segment) -> None:
        """Re-run the segment with grad, one detached graph per block (see module doc)."""
        previous: list[torch.Tensor] = []
        self._leave_head_backward()
        for call in segment.calls:
            weights = self.streamer.acquire(call.index)
            leaves = list(call.leaves)
            for position in call.tensor_positions:
                if position in call.from_previous:
                    leaves[position] = previous[call.from_previous[position]]
                elif isinstance(leaves[position], HostCheckpoint):
                    assert self.offloader is not None
                    leaves[position] = self.offloader.take(leaves[position])
            leaves = self._make_graph_leaves(call, leaves, weights)
            with call.replay.replay(self.runtime), torch.enable_grad():
                outputs = self._run(call.index, call.training, leaves, call.spec, params=call.param_views)
            call.outputs = [leaf for leaf in tree_flatten(outputs)[0] if isinstance(leaf, torch.Tensor)]
            previous = call.outputs
        segment.recomputed = True
        self.live_checkpoint_bytes -= segment.checkpoint_bytes

    def _backward_call(
        self, segment: _Segment, call: _BlockCall, grad_outputs: Sequence[torch.Tensor | None]
    ) -> list[torch.Tensor | None]:
        pairs = [(out, grad) for out, grad in zip(call.outputs, grad_outputs) if grad is not None and out.requires_grad]
        trained = [
            (slot, leaf)
            for slot, leaf in zip(self.states[call.index].layout.slots, call.param_views)
            if leaf.requires_grad
        ]
        outbox = GradientOutbox(self.sink, call.index, self._is_final_micro_batch(), self.gradient_bucket_elements)
        # Each parameter's gradient goes to the sink from its AccumulateGrad hook, while
        # backward goes on through the block: at most a bucket of the block's gradients
        # waits on the device, not all of them. Frozen parameters get none computed. The
        # hooks die with the leaves, which this call drops.
        for slot, leaf in trained:
            leaf.register_post_accumulate_grad_hook(outbox.hook(slot.offset))
        inputs = [leaf for _, leaf in trained] + list(call.input_leaves.values())
        if pairs and inputs:
            with self.runtime.tracer.device_span(
                f"backward {call.index}", "compute", block=call.index, phase="backward"
            ):
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs], inputs=inputs)
        # An unused parameter contributes zeros, so every range of the block reaches
        # the worker in every micro-batch (norm and update coverage stay complete).
        for slot, leaf in trained:
            if slot.offset not in outbox.sent:
                outbox.add(slot.offset, torch.zeros(leaf.numel(), dtype=leaf.dtype, device=leaf.device))
        outbox.flush()
        # Every kernel that reads this block's weights is queued: the slot may be refilled.
        self.streamer.release(call.index)
        if call.stash is not None:
            call.stash.finish()
            call.stash = None
        by_position = {position: leaf.grad for position, leaf in call.input_leaves.items()}
        call.param_views, call.input_leaves, call.outputs, call.leaves = [], {}, [], []
        del segment
        if call.index == 0:  # phase boundary: the blocks' backward is done, the embedding's is next
            self.runtime.return_transient_memory()
        return [by_position.get(position) for position in call.tensor_positions]
