"""The GPU tier's update: states kept whole on the compute device, stepped there in place.

``"device_state"`` keeps a prefix of the flat states (the resident state, then blocks 0, 1,
..., ``state/placement.py``: [Note: the GPU tier]) whole on the device: master, shadow, Adam's
m and v and the held gradient. Backward's gradients are copied or added into the held
gradient on the device and their squared norm summed there (``gradients/sink.py``); at
``engine.step()``, once the clipping scale is known, :meth:`DeviceStates.update` steps each
of them with the fused Triton kernel (``megatrain_triton.adamw_step_``, as ``DeviceAdamW``
uses it, but on the resident tensors: nothing streams), while the host states go through the
host pass (pipelined behind the next forward where it can be) as before. The speculative
journal never covers them (``optimizer_build.py``): their update is cheap at step time.

Without CUDA the "device" is the CPU: the kernel runs through Triton's interpreter, so CI
runs this exact code (the interpreter truncates fp32 -> bf16 where the GPU rounds the shadow;
``megatrain_triton/adamw.py``).

[Note: device state ordering]
- The update is issued on ``runtime.optimizer_stream``, which first waits on an event the
  compute stream recorded at ``step()``: backward's kernels there (the recompute of each
  block reads its weights, which for these states *are* the shadow and master the update
  writes) may still be queued when the host reaches ``step()``.
- The gradients it reads were written on the d2h stream (``sink.py``); the sink's drain at
  ``step()`` waited on the host for the last of them, before this is issued: no device-side
  wait is needed for them (the host's wait orders every launch after it).
- Each state's ``updated`` event is recorded after its kernels. The next forward's use waits
  on it on the device, never on the host: the weight streamer makes the compute stream wait
  on it when it hands the block out (``acquire``; the h2d stream goes on copying the next
  host blocks), and the model's forward pre-hook makes the compute stream wait on the
  resident state's. The next backward's gradient writes (d2h stream, after an event the
  compute stream recorded later than those waits) are ordered after the update's reads.
- Host code that reads or writes these tensors (a user's read of ``engine.module``'s
  parameters between ``step()`` and the next forward, through ``settle_optimizer()``; the
  engine's settle points) calls :meth:`settle` first: the compute stream waits for every
  ``updated`` event, at most once per step, and the host never blocks. On a GPU host code
  reaches device tensors only through a stream, the current one, the compute stream: so
  that orders it. The engine's own readers are ordered without it too (the race checker's
  mutation test finds both waits of this module but ``wait_on_device`` redundant in its
  runs, ``tests/test_stream_ordering.py``): ``state_dict`` and checkpoints synchronise the
  device first (``checkpoint/checkpointed_engine.py``'s ``quiesce``), and the next step's
  host reads follow the sink's drain, whose host wait follows the compute stream's waits.
  The wait at :meth:`update` orders what the checker sees as host work: the held gradients'
  zeroing by ``HeldWrites.settle`` at ``step()``, a compute-stream kernel on a GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from megatrain_ds.optimizer.adamw_math import AdamHyper
from megatrain_ds.optimizer.device_adamw import triton_adamw_step
from megatrain_ds.runtime.device_runtime import DeviceRuntime, Stream
from megatrain_ds.state.host_store import HostFlatState


class DeviceStates:
    """The states the placement keeps on the device, and their update at ``step()``.

    Args:
        runtime: the streams and events ([Note: device state ordering]).
        states: every flat state (blocks, then the resident state).
        indices: those on the device, in the order the next forward reads them.
        setting: ``megatrain.device_state`` as configured.
        device_bytes: the device memory they take.
    """

    def __init__(
        self,
        runtime: DeviceRuntime,
        states: Sequence[HostFlatState],
        indices: Sequence[int],
        setting: str | float,
        device_bytes: int,
    ) -> None:
        import megatrain_triton  # noqa: F401  (fails here, at build, where Triton is missing)

        self._runtime = runtime
        self._states = states
        self.indices = tuple(indices)
        self.setting = setting
        """``megatrain.device_state`` as configured (named in :meth:`out_of_memory_explained`)."""
        self.device_bytes = device_bytes
        """Device memory the states take (the placement's count)."""
        self._updated = {index: runtime.event() for index in self.indices}
        self._unsettled = False
        """An update has been issued that the host has not waited for (:meth:`settle`)."""

    def __contains__(self, index: object) -> bool:
        return index in self._updated

    def __bool__(self) -> bool:
        return bool(self.indices)

    @property
    def numel(self) -> int:
        """Elements of the states on the device."""
        return sum(self._states[index].layout.numel for index in self.indices)

    def update(self, step: int, scale: float, hypers: Sequence[AdamHyper]) -> None:
        """Issue every device state's AdamW step from its held gradient (times ``scale``,
        the clipping), with each group's hyperparameters ``hypers`` as read at ``step()``;
        returns at once ([Note: device state ordering])."""
        runtime = self._runtime
        stream = runtime.optimizer_stream
        backward_done = runtime.event()
        backward_done.record(runtime.compute_stream())
        with runtime.on(stream):
            # Sync: backward's kernels on the compute stream read these weights (and the
            # resident state's gradients were produced there); the update overwrites them.
            stream.wait_event(backward_done)
            for index in self.indices:
                with runtime.tracer.device_span(f"adamw {index} on device", "optimizer", stream, state=index):
                    self._step_state(self._states[index], step, scale, hypers)
                self._updated[index].record(stream)
        self._unsettled = True

    def _step_state(self, state: HostFlatState, step: int, scale: float, hypers: Sequence[AdamHyper]) -> None:
        grad = state.grad
        assert grad is not None, "a device state always holds its gradient (state/placement.py)"
        for run in state.layout.trained_runs():
            lo, hi = run.start, run.end
            master, exp_avg, exp_avg_sq = state.master[lo:hi], state.exp_avg[lo:hi], state.exp_avg_sq[lo:hi]
            shadow = state.shadow[lo:hi] if state.shadow is not None else None
            what = "the Triton AdamW kernel on a device state"
            triton_adamw_step(master, grad[lo:hi], exp_avg, exp_avg_sq, shadow, step, hypers[run.group], scale, what)

    @contextlib.contextmanager
    def out_of_memory_explained(self) -> Iterator[None]:
        """Add to a device out-of-memory error raised inside what the GPU tier holds, and the
        fix: ``"auto"`` sized the tier at start-up, before any batch was seen, so a batch whose
        activations need more than the memory it left (``DEVICE_STATE_AUTO_SHARE``'s rest and
        ``DEVICE_STATE_HEADROOM_BYTES``) runs out where the same script with ``"none"`` fits."""
        try:
            yield
        except torch.OutOfMemoryError as error:
            message = error.args[0] if error.args else ""
            error.args = (
                f"{message}\nmegatrain: the GPU tier holds {len(self.indices)} optimizer states "
                f"({self.device_bytes / 2**30:.1f} GiB) on the device (megatrain.device_state {self.setting!r}, "
                'sized at start-up); to leave that memory to activations set "megatrain": '
                '{"device_state": "none"} or a smaller fraction of the trained elements',
                *error.args[1:],
            )
            raise

    def wait_on_device(self, index: int, stream: Stream) -> None:
        """``stream`` waits (on the device, the host goes on) for state ``index``'s last update."""
        # Sync: the state's weights are read on ``stream`` next ([Note: device state ordering]).
        stream.wait_event(self._updated[index])

    def settle(self) -> None:
        """The compute stream waits (on the device) for the last update of every device state:
        whatever reads or writes their tensors next from host code does so through the compute
        stream (a copy to the host, a user's read of a parameter, the held gradients' zeroing)
        ([Note: device state ordering]). Once per step: free when settled."""
        if not self._unsettled:
            return
        stream = self._runtime.compute_stream()
        for index in self.indices:
            # Sync: the next reader of the state's tensors queues on the compute stream.
            stream.wait_event(self._updated[index])
        self._unsettled = False
