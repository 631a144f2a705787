"""The exact update of an optimizer step, run behind ``engine.step()`` in the order the next forward needs it.

:class:`PipelinedFinish` owns one host thread, the *finish worker*. At ``engine.step()`` the
:class:`~megatrain_ds.optimizer.speculative_step.OptimizerStepper` decides the step on the
calling thread (norm, clipping scale, skip, journal restored, hyperparameters read) and, where
ranges are left to update from the held gradients, hands them here instead of updating them
itself: ``step()`` returns while the worker updates state after state.

[Note: pipelined finish]
When clipping fires (or a step could not speculate) every state is updated from its held
gradient once the global norm is known: on the CPU one AdamW pass over all the optimizer
state, which used to run inside ``engine.step()`` with the device idle (240 ms of a 425 ms
step of a 940M Llama on an H200, ``bench/results/gpu_H200/2026-11-27/``). The next forward
reads the updated weights one state at a time, so the update runs behind it instead:

- Order: the resident state first (its embedding is the first thing forward computes),
  then blocks 0, 1, ... -- the order the next forward reads them in.
- Handoff: the worker reports each state as it lands (``runtime.host_queue()``, which the
  race checker sees as a handoff: put before get). :meth:`synchronize` makes the calling
  thread wait until a given state has landed. The weight streamer calls it before it
  copies (or, on the CPU, points a slot at) a block's host weights
  (``streaming/weight_streamer.py``: [Note: buffer ordering]); the model's forward
  pre-hook for the resident state, whose device copy is refreshed as it lands
  (``on_landed``). So block ``i`` computes while blocks ``i+1..`` are still being updated.
  What it can hide is the forward's time at most: the forward takes each block only once
  its update has landed, and the next backward's gradients land in the held gradients the
  update reads (the wait at ``engine.backward`` is free by then: the forward has waited for
  every block). On the H200 trace of the 940M Llama that is the 35 ms forward of a 0.83 s
  step, the update 180-240 ms.
- Exactness: nothing about the update changes but the thread and the time it runs: the
  same ranges, scale and step number as the synchronous finish, and each group's
  hyperparameters as they were at ``step()`` (:meth:`HostAdamW.snapshot`): a scheduler
  stepped after ``engine.step()`` (the engine's own, or the script's) changes the next step.
- Settle points: whatever reads or writes masters, moments, shadows or held gradients
  other than through the streamer waits for the whole update first (:meth:`settle`):
  ``state_dict`` (and so ``save_16bit_model``, ``save_pretrained``, Accelerate's
  ``get_state_dict``), ``save_checkpoint``/``load_checkpoint``, ``engine.backward`` (the
  next gradients land in the held gradients the update reads; by then the forward has
  waited for every block, so this wait is normally free), a forward outside training
  (eval, generation), the next ``step()``, writing a trace, ``destroy()``, and entering
  ``deepspeed.zero.GatheredParameters`` (:func:`settle_every_update`, patched in by
  ``integration/compat.py``). User code that reads ``engine.module``'s parameters directly
  between ``step()`` and the next forward without that context (they view the host
  masters) must call ``engine.settle_optimizer()`` first.
- Where it does not run (:func:`refusal`; the step is finished synchronously, as before):
  without held gradients (nothing is left for the finish: the worker stepped every chunk
  during backward); with data parallel (every rank's windows must be updated before the
  node's weight gather after the step, ``_gather_updated_weights``); with the NVMe tier
  (its I/O threads read ahead and write behind in the finish's order, and the weight
  window is filled from the files the update writes); with states placed on the device
  (``DeviceAdamW`` uses the device's streams from one thread at a time, and its
  write-backs are settled by ``flush`` within the step): ``"optimizer_device": "gpu"``,
  since ``"auto"`` keeps every state on the CPU where the finish can pipeline
  (``optimizer/placement.py``: ``build_host_adamw``).

The GPU tier's states (``"device_state"``, ``optimizer/device_states.py``) are no part of it:
they are updated on the device at ``step()`` and the worker's turn for them does nothing,
while the next forward waits for their update on the device, not for the worker.

An update that raises on the worker is re-raised by the next wait for it, and logged (the
states after it were never updated: the run cannot go on from them).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from megatrain_ds.runtime.device_runtime import DeviceRuntime

logger = logging.getLogger(__name__)

UpdateFn = Callable[[int], None]
"""``update(index)``: the step's whole update of state ``index`` (on the finish worker)."""


@dataclass(frozen=True)
class _Failed:
    """What the worker reports instead of a state when its update raised."""

    index: int
    error: BaseException


_LIVE: weakref.WeakSet[PipelinedFinish] = weakref.WeakSet()
"""Every engine's :class:`PipelinedFinish` still alive (:func:`settle_every_update`)."""


def settle_every_update() -> None:
    """Wait until every live engine's update in flight has landed: for readers of parameters
    from outside the engine, ``deepspeed.zero.GatheredParameters`` (``integration/compat.py``,
    patch 5), which TRL and transformers use to read a ZeRO-3 model's weights."""
    for finish in list(_LIVE):
        finish.settle_observed()


def refusal(*, holds_gradients: bool, data_parallel: bool, nvme_tier: bool, on_host_only: bool) -> str | None:
    """Why a configuration finishes its steps synchronously, or ``None`` when it pipelines
    them ([Note: pipelined finish])."""
    if not holds_gradients:
        return "no held gradients: every range is updated during backward"
    if data_parallel:
        return "data parallel: the weight gather after the step needs every window updated"
    if nvme_tier:
        return "the NVMe tier: its reads ahead and writes behind follow the synchronous finish"
    if not on_host_only:
        return "optimizer state placed on the device: DeviceAdamW runs from one thread"
    return None


def pipelined_finish_for(
    runtime: DeviceRuntime,
    first: int,
    on_landed: Callable[[int], None],
    *,
    holds_gradients: bool,
    data_parallel: bool,
    nvme_tier: bool,
    on_host_only: bool,
) -> PipelinedFinish | None:
    """The engine's :class:`PipelinedFinish`, or ``None`` where its configuration finishes
    steps synchronously (:func:`refusal`); the decision is logged."""
    why_not = refusal(
        holds_gradients=holds_gradients, data_parallel=data_parallel, nvme_tier=nvme_tier, on_host_only=on_host_only
    )
    logger.info("megatrain: optimizer finish %s", f"synchronous ({why_not})" if why_not else "pipelined")
    return None if why_not else PipelinedFinish(runtime, first, on_landed)


class PipelinedFinish:
    """Runs each step's updates on the finish worker and tells waiters when a state has landed.

    Args:
        runtime: whose host thread and queues carry the handoff (seen by the race checker).
        first: the state the next forward needs first (the resident parameters).
        on_landed: called on the waiting thread, once per state, when a wait finds it
            landed (the engine refreshes the resident parameters' device copy there).
    """

    def __init__(self, runtime: DeviceRuntime, first: int, on_landed: Callable[[int], None]) -> None:
        self._runtime = runtime
        self._first = first
        self._on_landed = on_landed
        self._jobs = runtime.host_queue()
        self._landed = runtime.host_queue()
        self._thread: threading.Thread | None = None
        self._waiting: list[int] = []
        """States handed to the worker whose landing no waiter has seen yet, in order."""
        self._lock = threading.Lock()  # a CUDA backward pushes from autograd's thread
        _LIVE.add(self)

    @property
    def in_flight(self) -> bool:
        """Whether an update has been started and not yet seen landed in full."""
        return bool(self._waiting)

    def order(self, num_states: int) -> list[int]:
        """The order the next forward reads the states in: ``first``, then the rest ascending."""
        return [self._first] + [index for index in range(num_states) if index != self._first]

    def start(self, order: Sequence[int], update: UpdateFn) -> None:
        """Hand ``update`` of every state in ``order`` to the worker (the previous step's
        must have been settled: ``engine.step()`` does that first)."""
        assert not self._waiting, "the previous step's update is still in flight"
        if self._thread is None:
            self._thread = self._runtime.start_thread(self._work, "megatrain finish worker")
        self._waiting = list(order)
        self._jobs.put((list(order), update))

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            order, update = job
            for index in order:
                try:
                    update(index)
                except BaseException as error:  # re-raised by the waiter: the step is broken
                    self._landed.put(_Failed(index, error))
                    break
                # Handoff: the get of this item orders the waiter after the update's writes.
                self._landed.put(index)

    def before_forward(self, training: bool) -> None:
        """The model's forward is about to run: a training forward waits for the ``first``
        state only (the weight streamer waits for each block's), any other forward (eval,
        generation) for the whole update."""
        if not self._waiting:
            return
        if not training:
            self.settle()
            return
        # Sync: the embedding computes first; its device copy is refreshed as it lands.
        self.synchronize(self._first)

    def synchronize(self, index: int) -> None:
        """The calling thread waits until state ``index``'s update has landed (at once
        when it is not in flight)."""
        with self._lock:
            while index in self._waiting:
                self._take_one()

    def settle(self) -> None:
        """The calling thread waits until the whole update has landed."""
        with self._lock:
            while self._waiting:
                self._take_one()

    def settle_observed(self) -> None:
        """:meth:`settle`, seen by the race checker as the engine's own host code
        (``runtime.observe``): the engine's settle points and readers outside it."""
        if self._waiting:
            with self._runtime.observe():
                self.settle()

    def _take_one(self) -> None:
        landed = self._landed.get()
        if isinstance(landed, _Failed):
            self._waiting = []
            # The worker's own exception (a race the checker found stays a StreamRaceError).
            logger.error(
                "megatrain: the optimizer update of state %d failed on the finish worker; the weights "
                "are partly updated: restore the last checkpoint",
                landed.index,
            )
            raise landed.error
        expected = self._waiting.pop(0)
        assert landed == expected, f"the finish worker reported state {landed}, expected {expected}"
        self._on_landed(landed)

    def close(self) -> None:
        """Settle, then stop the worker (idempotent). A failed update raises no further:
        ``engine.destroy()`` tears down whatever happened (the failure was logged)."""
        with contextlib.suppress(Exception):  # logged by _take_one; the teardown goes on
            self.settle()
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None
