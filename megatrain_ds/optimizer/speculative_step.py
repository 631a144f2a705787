"""One optimizer step, validated: global norm, speculative updates during backward, skips.

:class:`OptimizerStepper` sees every final gradient chunk on the gradient worker (during
the backward of the last micro-batch) and finishes the step at ``engine.step()``, once
the global gradient norm is known. Its decisions are described below; the arithmetic is
:class:`~megatrain_ds.optimizer.host_adamw.HostAdamW`'s.

[Note: speculative steps]
The clipping scale ``min(clip / (norm + eps), 1)`` and the decision to skip a non-finite
step need the norm of *all* gradients, known only when backward ends; waiting for it
serialises the whole update after backward. Instead the worker *speculates* that the step
needs neither (the steady state of a healthy run) and validates at ``engine.step()``:

- Every final chunk adds its squared norm to the step's running sum (in double,
  ``gradients/squared_norm.py``): on the host where the worker handles the chunk anyway
  (accumulation, fp16, no held gradients), on the device where the chunk is copied
  straight into the held gradients (``gradients/sink.py``). The sum only grows, so as
  soon as what the host knows of it proves ``sqrt(sum) + eps > clip`` clipping is certain,
  and once it is not finite the step is certainly skipped: speculation stops for the rest
  of the step. Device-side sums are known only at ``engine.step()``: there speculation
  goes on until validation (the predictor alone decides).
- The journaled elements (``optimizer/journal.py``: [Note: journal extents]; the tail of
  backward's order: the last blocks whole, then the trailing elements of the next one, as
  ``speculative_blocks`` or its budget allows) are stepped *as their chunks arrive*, with
  scale 1, if the previous step was applied unclipped (a clipped or skipped step predicts
  another) and the running sum has not proved speculation wrong. Right before a chunk of
  them is overwritten, its master, m, v and shadow are copied into the block's journal
  slot (cache-hot for the update that follows).
- Every other range is deferred: its gradient waits in the held gradient buffer.
- At ``engine.step()``, with the norm known:
  (a) finite, no clipping, hyperparameters unchanged since the speculative updates read
      them: the speculation was right; the deferred ranges are stepped with scale 1.
  (b) finite, clipping (or an lr/betas/eps/weight decay changed in between): the journal
      is copied back and every range is stepped with the clipping scale.
  (c) not finite: the journal is copied back; nothing is stepped; the step is skipped.
  A state read between the last backward and ``engine.step()`` (a state dict, a checkpoint)
  first copies the journal back (:meth:`OptimizerStepper.withdraw_speculation`): it reads
  the weights before the step, as from DeepSpeed's engine, and ``finish`` then steps every
  range, as in (b) with the step's own scale.
  In (a) and (b) the ranges left are stepped on the finish worker, behind ``engine.step()``
  and in the order the next forward reads them, where the configuration allows it
  (``optimizer/pipelined_finish.py``: [Note: pipelined finish]); elsewhere here, in state order.
  Copying back is a bit copy, so (b) and (c) end in exactly the state a non-speculative
  step gives, bit for bit (``tests/test_nonfinite_steps.py``,
  ``tests/test_speculative_step.py``). (a) applies the same arithmetic to the same values,
  so it is bit-identical too: no kernel's results depend on where a range starts or ends
  (the DeepSpeed pass takes every element through its SIMD loop, ``cpu_adam.py``).

Cost. Memory: one journal slot per journaled block, ``12 B (+2 B with a bf16 shadow)`` per
journaled element, allocated once (``Journal.nbytes``, ``host_bytes()["journal"]``; at most
``AUTO_JOURNAL_BYTES_PER_PARAM`` = 0.5 B per model parameter with ``"auto"``). Time, on the
worker during backward: a right speculation adds one copy of the journaled elements (14 B
read + 14 B written each, against the 28 B the update itself touches); a wrong one adds
the copy back and throws the speculative update away, so the step costs what it would have
cost without speculation plus two copies of the journaled elements. Gradients are held for
every range until the step is validated, which clipping and accumulation need anyway.

The GPU tier's states (``"device_state"``: ``optimizer/device_states.py``) take no part in
speculation: their gradients are always held, on the device, and at ``engine.step()`` they
are updated there with the step's scale in (a) and (b), in none of (c); the journal never
covers them.

Without clipping, accumulation or ``"non_finite_steps": "skip"`` no gradient is held
(12 B/param with fp32 compute): each chunk is stepped as it arrives, nothing can be
undone, and a non-finite norm can only be reported (``StepOutcome.PARTIAL``).
"""

from __future__ import annotations

import enum
import logging
import math
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from megatrain_ds.gradients.squared_norm import SquaredNorm
from megatrain_ds.optimizer.adamw_math import AdamHyper
from megatrain_ds.optimizer.device_states import DeviceStates
from megatrain_ds.optimizer.host_adamw import HostAdamW
from megatrain_ds.optimizer.journal import Journal, JournalExtent
from megatrain_ds.optimizer.pipelined_finish import PipelinedFinish
from megatrain_ds.runtime.trace import NULL_TRACER, NullTracer, Tracer
from megatrain_ds.state.flat_layout import intersect_runs
from megatrain_ds.state.host_store import HostFlatState

if TYPE_CHECKING:
    from megatrain_ds.runtime.device_runtime import DeviceRuntime

logger = logging.getLogger(__name__)

CLIP_EPS = 1e-6
"""DeepSpeed's and torch's ``clip_grad_norm_`` epsilon."""


class StepOutcome(enum.Enum):
    APPLIED = "applied"
    """Finite norm at most the clipping threshold: gradients applied as they are."""
    CLIPPED = "clipped"
    """Finite norm above the threshold: gradients applied times ``clip / (norm + eps)``."""
    SKIPPED = "skipped"
    """Non-finite norm: weights and optimizer state exactly as before the step."""
    PARTIAL = "partial"
    """Non-finite norm with no gradients held: ranges whose gradients arrived before the
    first non-finite chunk were already updated (the state cannot be restored)."""


@dataclass(frozen=True)
class StepReport:
    outcome: StepOutcome
    norm: float
    scale: float
    speculated: int
    """Elements updated during backward (speculatively, or as they arrived without a hold)."""
    restored: int
    """Speculatively updated elements copied back from the journal."""


class OptimizerStepper:
    """Norm, speculation and validation of each optimizer step; see [Note: speculative steps].

    Args:
        states: every flat state (blocks, then the resident parameters).
        adamw: the arithmetic and placements.
        clipping: global-norm threshold; 0 disables clipping.
        journal_extents: the elements stepped speculatively during backward
            (``optimizer/journal.py``: [Note: journal extents]).
        holds_gradients: every state has a gradient buffer that keeps its final gradient
            until :meth:`finish` (``state.grad``); without it nothing is deferred or undone.
        sum_over_ranks: with data parallel ``states`` are this rank's windows, and this
            sums the squared norm over the ranks that hold the other windows.
        runtime: whose tracer times each range update (``runtime/trace.py``); none: untraced.
        device_states: the states kept on the device, updated there (none: every state on the host).
    """

    def __init__(
        self,
        states: Sequence[HostFlatState],
        adamw: HostAdamW,
        *,
        clipping: float,
        journal_extents: Sequence[JournalExtent],
        holds_gradients: bool,
        sum_over_ranks: Callable[[float], float] | None = None,
        runtime: DeviceRuntime | None = None,
        device_states: DeviceStates | None = None,
    ) -> None:
        self.states = states
        self.device_states = device_states
        """The states kept on the device (``optimizer/device_states.py``): updated there at
        :meth:`finish`, never journaled, deferred or handed to the host pass."""
        self._runtime = runtime
        self.adamw = adamw
        self.clipping = clipping
        self.holds_gradients = holds_gradients
        self._sum_over_ranks = sum_over_ranks
        self.journal = Journal(states, journal_extents if holds_gradients else ())
        self.norm = SquaredNorm(runtime.device if runtime is not None else torch.device("cpu"))
        """The step's squared gradient norm: the one place it is summed and read."""
        self.speculate_next = True
        """The predictor: speculate in the next step (the last one was applied unclipped)."""
        self._begin_step()

    @property
    def updates_during_backward(self) -> bool:
        """Whether the worker may change host weights before :meth:`finish`: every final chunk
        when nothing is held, the journaled ranges while the predictor speculates (once this
        step's first final chunk has decided it: no longer after :meth:`withdraw_speculation`)."""
        if not self.holds_gradients:
            return True
        decided = self._speculating
        return decided if decided is not None else self.speculate_next and bool(self.journal)

    def _begin_step(self) -> None:
        self._speculating: bool | None = None  # decided at the step's first final chunk
        self._hyper_read: dict[int, AdamHyper] = {}
        self._speculated = 0

    # -- gradient worker ------------------------------------------------------------------

    def may_speculate(self, index: int, offset: int, numel: int) -> bool:
        """Whether part of final chunk ``[offset, offset+numel)`` of state ``index`` may be
        stepped during backward (the journal covers it, the predictor speculating): the sink
        hands such a chunk to the worker even when it lands straight in the held gradients.
        Any thread; the predictor changes only in :meth:`finish`, after the step's chunks
        have all been pushed."""
        return (
            self.holds_gradients
            and self.speculate_next
            and self.journal.overlap(index, offset, offset + numel) is not None
        )

    def consume_final(self, index: int, offset: int, grad: torch.Tensor, step: int, *, counted: bool = False) -> None:
        """A final gradient chunk of state ``index`` (the held buffer's view when gradients
        are held, else the sink's chunk). Runs on the gradient worker. ``counted``: its
        squared norm was added on the device already (a direct chunk)."""
        if not counted:
            self.norm.add_on_host(grad)
        state = self.states[index]
        if not self.holds_gradients:
            if self.norm.host_known_finite():  # after a non-finite chunk, stop spoiling the state
                with self._span(index, offset, grad.numel()):
                    self.adamw.update_range(state, offset, grad, step=step)
                self._speculated += grad.numel()
            return
        if self._speculating is None:
            self._speculating = self.speculate_next and bool(self.journal)
        covered = self.journal.overlap(index, offset, offset + grad.numel()) if self._speculating else None
        if covered is None or not self._speculation_may_hold():
            return  # deferred to finish(): the gradient waits in state.grad
        # A chunk may straddle its extent's start (journal.py: [Note: journal extents]): the
        # part before it is deferred like any other range.
        lo, hi = covered
        for run in intersect_runs(state.layout.trained_runs(), lo, hi):
            self._hyper_read.setdefault(run.group, self.adamw.hyper(run.group))
        with self._span(index, lo, hi - lo, speculative=True):
            self.adamw.update_range(
                state,
                lo,
                grad[lo - offset : hi - offset],
                step=step,
                before_chunk=lambda start, end: self.journal.save(index, start, end),
            )
        self._speculated += hi - lo

    def _tracer(self) -> NullTracer | Tracer:
        return self._runtime.tracer if self._runtime is not None else NULL_TRACER

    def _span(
        self, index: int, offset: int, numel: int, tracer: NullTracer | Tracer | None = None, **args: object
    ) -> AbstractContextManager[None]:
        """Times one range update on the ``optimizer worker`` track (whichever thread runs it)."""
        tracer = tracer or self._tracer()
        return tracer.span(f"adamw {index}", "optimizer worker", state=index, offset=offset, numel=numel, **args)

    def _speculation_may_hold(self) -> bool:
        """False once the running norm proves clipping or a skip (it can only grow)."""
        assert self._speculating is not None  # decided at the step's first final chunk, before this
        known = self.norm.lower_bound()
        norm = math.sqrt(known) if math.isfinite(known) else math.inf
        if not math.isfinite(norm) or (self.clipping > 0 and self.clipping / (norm + CLIP_EPS) < 1.0):
            self._speculating = False
        return self._speculating

    # -- main thread, at engine.step() (the worker has drained) ---------------------------

    def withdraw_speculation(self) -> int:
        """Undo this step's speculative updates before :meth:`finish` (the worker has
        drained): the host state reads as before the step, as DeepSpeed's does between the
        last backward and ``step()`` (a state dict or checkpoint taken there). The journal is
        copied back and emptied, and no chunk of this step is speculated after, so
        :meth:`finish` steps every range from the held gradients: the same arithmetic on the
        same values as a step that never speculated, bit for bit. Returns the elements restored
        (none without held gradients: nothing can be undone there, the weights read updated)."""
        if not self.holds_gradients:
            return 0
        self.adamw.flush()  # device write-backs land before the host state is restored
        restored = self.journal.restore(self.adamw.residency)
        self.journal.clear()
        self._speculating = False
        return restored

    def finish(self, step: int, pipeline: PipelinedFinish | None = None) -> StepReport:
        """Validate this step's speculation and complete (or skip) the update.

        With ``pipeline`` the ranges left to update from the held gradients are handed to
        its worker, which updates them after this returns ([Note: pipelined finish]);
        everything else (the norm, the outcome, the journal's restore) is done here."""
        self.adamw.flush()  # device write-backs land before host state is read or restored
        local = self.norm.take()  # the sink has drained: every device addition is done
        total = local if self._sum_over_ranks is None else self._sum_over_ranks(local)
        finite = math.isfinite(total)
        norm = math.sqrt(total) if finite else total
        scale = min(self.clipping / (norm + CLIP_EPS), 1.0) if (finite and self.clipping > 0) else 1.0
        restored = 0
        work: dict[int, list[tuple[int, int]]] = {}
        if not self.holds_gradients:
            outcome = StepOutcome.APPLIED if finite else StepOutcome.PARTIAL
        elif not finite:
            restored = self.journal.restore(self.adamw.residency)
            outcome = StepOutcome.SKIPPED
        elif scale != 1.0 or self._hyperparameters_changed():
            restored = self.journal.restore(self.adamw.residency)
            work = {index: [(0, _held_numel(state))] for index, state in enumerate(self.states)}
            outcome = StepOutcome.CLIPPED if scale != 1.0 else StepOutcome.APPLIED
        else:
            work = {index: _unstepped(state, self.journal.ranges(index)) for index, state in enumerate(self.states)}
            outcome = StepOutcome.APPLIED
        if self.device_states:  # updated on the device now, the host pass covers the rest
            for index in self.device_states.indices:
                work[index] = []
            if outcome in (StepOutcome.APPLIED, StepOutcome.CLIPPED):
                self.device_states.update(step, scale, self.adamw.snapshot())
        self._update(work, step, scale, pipeline)
        self.journal.clear()
        # No zeroing pass: the next step's first write of each held element copies over it
        # (gradients/held_writes.py).
        report = StepReport(outcome, norm, scale, self._speculated, restored)
        if restored:
            logger.debug(
                "megatrain: speculation refuted (%s, norm %s): %d elements restored and redone",
                outcome.value,
                norm,
                restored,
            )
        self.speculate_next = outcome is StepOutcome.APPLIED and scale == 1.0
        self._begin_step()
        self.adamw.residency.step_done()
        self.plan_access()
        return report

    def _update(
        self, work: dict[int, list[tuple[int, int]]], step: int, scale: float, pipeline: PipelinedFinish | None
    ) -> None:
        """Step each state's ``work`` ranges from its held gradient, with the hyperparameters
        as they are now: here in state order, or behind ``step()`` on ``pipeline``'s worker
        in the order the next forward reads the states."""
        if not any(work.values()):
            return
        hypers = self.adamw.snapshot()  # a scheduler stepped after step() must not reach it
        # Traced as this step's work, even when it runs during the next step.
        tracer = self._tracer()
        traced = {"step": tracer.step} if isinstance(tracer, Tracer) and tracer.step is not None else {}

        def update(index: int) -> None:
            state = self.states[index]
            assert state.grad is not None  # holds_gradients: every state has one
            for start, end in work[index]:
                with self._span(index, start, end - start, tracer, scale=scale, **traced):
                    self.adamw.update_range(
                        state, start, state.grad[start:end], step=step, grad_scale=scale, hypers=hypers
                    )

        if pipeline is not None:
            pipeline.start(pipeline.order(len(self.states)), update)
            return
        self.adamw.residency.expect([self.states[index] for index, ranges in work.items() if ranges])
        for index in work:
            update(index)
        self.adamw.flush()

    def plan_access(self) -> None:
        """Tell the residency (the NVMe tier) the order the next step will touch the states
        in, so it reads them ahead from now on, during the forward: without held gradients
        backward's order; else the journal blocks (backward's order) when the step will
        speculate, then what ``finish`` walks (block order)."""
        if not self.holds_gradients:
            order = list(self.states[::-1])
        else:
            first = self.journal.indices if (self.speculate_next and self.journal) else []
            order = [self.states[i] for i in first] + [s for i, s in enumerate(self.states) if i not in first]
        self.adamw.residency.expect(order)

    def _hyperparameters_changed(self) -> bool:
        return any(self.adamw.hyper(group) != read for group, read in self._hyper_read.items())


def _held_numel(state: HostFlatState) -> int:
    assert state.grad is not None  # holds_gradients: every state has one
    return state.grad.numel()


def _unstepped(state: HostFlatState, stepped: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The trained ranges of ``state`` not in ``stepped`` (ranges that may touch but not overlap)."""
    gaps = []
    cursor = 0
    for start, end in sorted(stepped):
        if start > cursor:
            gaps.append((cursor, start))
        cursor = max(cursor, end)
    if cursor < state.layout.numel:
        gaps.append((cursor, state.layout.numel))
    return [(run.start, run.end) for lo, hi in gaps for run in intersect_runs(state.layout.trained_runs(), lo, hi)]
