"""MegatrainEngine: DeepSpeed's engine API over host-resident state and streamed blocks.

Lifecycle of one optimizer step (``gradient_accumulation_steps`` micro-batches)::

    engine(**batch)        blocks stream in, block inputs kept as checkpoints
    engine.backward(loss)  blocks recompute in reverse, gradients flow to the host worker,
                           which accumulates them and, on the last micro-batch, sums their
                           norm and steps the journal blocks speculatively
    engine.step()          at the boundary: wait for the worker, validate the speculation
                           against the exact global norm (clip, or skip a non-finite step),
                           and hand what is left to the finish worker, which updates it
                           behind the next forward in block order (each block streamed once
                           its update has landed; optimizer/speculative_step.py: [Note:
                           speculative steps], optimizer/pipelined_finish.py: [Note:
                           pipelined finish])

Building the engine (preflight, the placement, the host state, the optimizer, the streams)
is ``engine_build.py``'s: ``__init__`` runs its :func:`~megatrain_ds.engine_build.build`.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import warnings
import weakref
from collections.abc import Callable, Iterable
from typing import Any, Literal

import torch
from torch import nn

from megatrain_ds import engine_memory
from megatrain_ds.checkpoint import load as checkpoint_load
from megatrain_ds.checkpoint import save as checkpoint_save
from megatrain_ds.checkpoint.whole_masters import masters_by_param, state_dict_is_collective
from megatrain_ds.config import EngineConfig
from megatrain_ds.distributed.data_parallel import DataParallel
from megatrain_ds.distributed.gathered_weights import GatheredWeights
from megatrain_ds.engine_build import STAGING_CHUNK_ELEMENTS, build, decide_at_first_forward
from megatrain_ds.gradients.held_writes import HeldWrites
from megatrain_ds.gradients.sink import STAGED, GradientPort, Landing
from megatrain_ds.model.batch_checks import check_batch
from megatrain_ds.model.causal_lm_loss import ChunkedCausalLMLoss
from megatrain_ds.model.layer_checkpointing import log_if_requested as log_layer_checkpointing
from megatrain_ds.optimizer.device_states import DeviceStates
from megatrain_ds.optimizer.facade import MegatrainOptimizer, build_optimizer
from megatrain_ds.optimizer.gradient_accumulation import HostAccumulation
from megatrain_ds.optimizer.host_adamw import HostAdamW
from megatrain_ds.optimizer.loss_scaling import LossScaling
from megatrain_ds.optimizer.pipelined_finish import PipelinedFinish
from megatrain_ds.optimizer.speculative_step import OptimizerStepper, StepOutcome, StepReport
from megatrain_ds.planning.fragment_policy import FragmentChoice
from megatrain_ds.planning.recompute_policy import RecomputeChoice
from megatrain_ds.planning.transfer_hiding import warn_if_transfers_exposed
from megatrain_ds.runtime.device_runtime import DeviceRuntime, cuda_available, default_device
from megatrain_ds.runtime.host_ledger import LedgerCounts
from megatrain_ds.runtime.trace import TraceSchedule
from megatrain_ds.state.host_store import HostFlatState
from megatrain_ds.state.nvme_tier import NvmeTier
from megatrain_ds.state.nvme_weights import NvmeWeights
from megatrain_ds.state.placement import Placement
from megatrain_ds.streaming.resident_params import ResidentParams
from megatrain_ds.streaming.streamed_blocks import StreamedBlocks
from megatrain_ds.streaming.weight_streamer import WeightStreamer

__all__ = ["STAGING_CHUNK_ELEMENTS", "MegatrainEngine", "NonFiniteGradientError", "default_device"]
"""``STAGING_CHUNK_ELEMENTS`` is ``engine_build.py``'s, named here too for the tests and benchmarks."""

logger = logging.getLogger(__name__)


class NonFiniteGradientError(RuntimeError):
    """The global gradient norm was not finite and the step could not (or may no longer) be skipped."""


def _destroy_at_exit(engine: weakref.ref[MegatrainEngine]) -> Callable[[], None]:
    """An exit handler that destroys ``engine`` if it is still alive (see ``__init__``)."""

    def destroy() -> None:
        alive = engine()
        if alive is not None:
            alive.destroy()

    return destroy


class MegatrainEngine(nn.Module):
    """Trains ``model`` with every persistent tensor in host memory.

    Args:
        model: a model whose repeated blocks can be found (see :mod:`block_discovery`).
        config: the parsed DeepSpeed config.
        model_parameters: parameters or parameter groups for the optimizer (as in DeepSpeed).
        optimizer: a client ``torch.optim.AdamW``/``Adam`` to take groups and
            hyperparameters from, instead of the config's ``optimizer`` block.
        lr_scheduler: stepped after every optimizer step, as DeepSpeed does.
        device: where blocks compute; CUDA when available, else the CPU.
    """

    _destroyed: bool = False
    """Set by the first :meth:`destroy` (a class default: readable before ``__init__`` sets anything)."""
    _exit_handler: Callable[[], None] | None = None
    """Registered with ``atexit`` at the end of ``__init__``: :meth:`destroy` if the script did not."""
    _final_backward_done: bool = False
    """A backward at the accumulation boundary ran and its ``step()`` has not yet: the worker
    may be updating host weights (see :meth:`_before_forward`)."""
    _forward_since_backward: bool = False
    """A forward ran since the last backward: its device reads of the host weights may still
    be queued, and the blocks it copied ahead for its backward are read before any update."""

    # The parts engine_build.build sets, in the order it builds them (engine_build.py).
    block_path: str
    """Where the repeated blocks were found (``"model.layers"``)."""
    placement: Placement
    """Where every buffer of every flat state lives (state/placement.py): what the builders branch on."""
    states: list[HostFlatState]
    """One flat host state per block, in block order, then the resident parameters' state."""
    num_templates: int
    """Weightless block templates, one per distinct block structure (model/block_template.py)."""
    resident: ResidentParams
    """The parameters outside the blocks (embeddings, final norm, head), on the device."""
    _resident_index: int
    """The resident parameters' state in :attr:`states` (the last)."""
    windows: list[tuple[int, int]]
    """This rank's ``[start, end)`` of each state (all of it without data parallel)."""
    optimizer_states: list[HostFlatState]
    """Views of each state's window: what this rank's optimizer (and NVMe tier) holds."""
    adamw: HostAdamW
    """AdamW over :attr:`optimizer_states`, each state on its placement (optimizer/host_adamw.py)."""
    stepper: OptimizerStepper
    """The global norm, clipping, speculative updates and skips (optimizer/speculative_step.py)."""
    accumulation: HostAccumulation
    """Staged chunks written or added into the held gradients on the worker (optimizer/gradient_accumulation.py)."""
    held_writes: HeldWrites
    pipelined_finish: PipelinedFinish | None
    """The update behind the next forward, where the configuration allows it (optimizer/pipelined_finish.py)."""
    device_states: DeviceStates | None
    """The states kept whole on the device (``"device_state"``), updated there (optimizer/device_states.py)."""
    sink: GradientPort
    """Where gradients leave the device (behind the reducer with data parallel)."""
    streamer: WeightStreamer
    """The blocks' weights into device buffers (from the NVMe tier's window where they live there)."""
    blocks: StreamedBlocks
    stashed_blocks: int
    """Blocks, from the first, whose activations are stashed rather than recomputed."""
    recompute_choice: RecomputeChoice | None
    """The policy's decision at the first training forward (stash bytes, predicted steps)."""
    fragment_choice: FragmentChoice | None
    """``"fragment_bytes": "auto"``'s decision at the first training forward."""
    mlp_tile_tokens: int
    """Tokens per tile of the blocks' MLPs (0: not tiled; planning/long_context.py)."""
    causal_loss: ChunkedCausalLMLoss | None
    """The loss over sequence chunks, where the model's head allows it (model/causal_lm_loss.py)."""

    def __init__(
        self,
        model: nn.Module,
        config: EngineConfig,
        model_parameters: Iterable[Any] | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        lr_scheduler: Any = None,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        # Before the device is chosen: on CUDA each rank takes the device LOCAL_RANK.
        self.data_parallel = DataParallel.join(
            use_cuda=(device.type == "cuda") if device is not None else cuda_available(),
            timeout_s=config.options.collective_timeout_s,
        )
        self.runtime = DeviceRuntime.create(device or default_device(), config.options.pin_memory)
        self.optimizer: MegatrainOptimizer = build_optimizer(model, model_parameters, config.optimizer, optimizer)
        self.loss_scaling = LossScaling(config.fp16)
        """fp16: DeepSpeed's loss scaler, applied in backward and at the step (optimizer/loss_scaling.py)."""
        self.optimizer.loss_scaling = self.loss_scaling  # optimizer.loss_scale/cur_scale, as DeepSpeed's
        self.lr_scheduler = lr_scheduler
        self.module = model
        self.global_steps = 0
        self.micro_steps = 0
        self.optimizer_steps = 0
        self._boundary_override: bool | None = None
        self._global_grad_norm: float | None = None
        self.skipped_steps = 0
        """Optimizer steps skipped for a non-finite gradient norm (DeepSpeed's counter)."""
        self._consecutive_skips = 0
        self._step_applied = True
        self.last_step_report: StepReport | None = None
        """How the last optimizer step went: outcome, norm, scale, speculated/restored elements."""
        self.nvme_tier: NvmeTier | None = None
        self.nvme_weights: NvmeWeights | None = None
        """The weight window, with the blocks' weights on the NVMe tier (``"nvme_offload": "all"``)."""
        self.gathered_weights: GatheredWeights | None = None
        """With the weights on the NVMe tier and data parallel: every rank keeps only its window
        of each block, gathered whole when used (``distributed/gathered_weights.py``)."""
        try:
            build(self, model)  # engine_build.py
        except BaseException:
            if self.nvme_tier is not None:
                self.nvme_tier.close()  # its swap files are this engine's working state
            self.runtime.release_host_memory()  # pinned buffers, the process's mmap threshold
            raise
        # A plain function: torch tags public hooks with an attribute, which bound methods refuse.
        model.register_state_dict_post_hook(lambda *hook_args: self._master_state_dict_hook(*hook_args))
        model.register_forward_pre_hook(lambda *hook_args: self._before_model_forward())
        self._tracing = TraceSchedule.for_run(
            self.runtime, config, type(model).__name__, self.data_parallel.rank if self.data_parallel else None
        )
        self._tracing.before_write = self.settle_optimizer  # the traced update's spans are in
        self.num_params = sum(slot.numel for state in self.states for slot in state.layout.slots)
        """Parameters in the flat states (what the host ledger's per-parameter figures divide by)."""
        self.last_host_ledger: LedgerCounts | None = None
        """The host traffic of the last optimizer step (``runtime/host_ledger.py``); kept only
        with the race checker on (``MEGATRAIN_STREAM_CHECK=1``), which sees the accesses."""
        self._batch_checked = False  # the transfer-hiding warning, at the first training forward
        # A script may return without destroy(). The engine's host threads are daemons, and
        # at interpreter exit Python ends a daemon thread that wants the GIL back from inside
        # C++ code: an NVMe tier's I/O thread still writing the last step behind, in DeepSpeed's
        # async I/O op (which releases the GIL), was unwound through a noexcept destructor and
        # the process aborted (SIGABRT, "terminate called without an active exception").
        # destroy() at exit lets the writes finish and joins the threads first. atexit runs
        # before the interpreter's finalization; the weak reference keeps the engine collectable.
        self._exit_handler = _destroy_at_exit(weakref.ref(self))
        atexit.register(self._exit_handler)

    # -- the state_dict ----------------------------------------------------------------------

    def _master_state_dict_hook(
        self, module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any
    ) -> None:
        """Report every parameter by its master, the weights the optimizer updates, whatever
        the placement (``checkpoint/whole_masters.py``: [Note: one answer from state_dict]):
        views of the host masters where they are whole there, copies read from the NVMe
        tier or gathered from the other ranks or nodes where not."""
        del module, local_metadata
        self.settle_optimizer()
        masters = masters_by_param(self)  # collective where state_dict_is_collective(self)
        for name, param in self.module.named_parameters(remove_duplicate=False):
            key = prefix + name
            if key in state_dict and id(param) in masters:
                state_dict[key] = masters[id(param)]

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """``nn.Module.state_dict`` of the engine (the model's under ``module.``): every
        parameter by its master, as ``engine.module.state_dict()`` gives it. Collective where
        :attr:`state_dict_is_collective`: every rank must call it, in the same order as its
        other collectives."""
        return super().state_dict(*args, **kwargs)

    @property
    def state_dict_is_collective(self) -> bool:
        """Whether ``state_dict()`` (and whatever takes it: ``save_pretrained``,
        ``save_16bit_model``, Accelerate's ``get_state_dict``) runs collectives: with the
        weights on the NVMe tier and data parallel, or the masters sharded across nodes.
        Then every rank must take it, as every rank joins a ZeRO-3 gather."""
        return state_dict_is_collective(self)

    # -- DeepSpeed engine API ---------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the model (call the engine, not ``engine.module``: this plans the prefetch of
        block 0 before the embedding computes; the module alone also works, a little later)."""
        check_batch(self.module, self.runtime.device, args, kwargs)
        if not self._batch_checked and torch.is_grad_enabled() and self.module.training:
            self._batch_checked = True
            log_layer_checkpointing(self.blocks.blocks, self.block_path)
            warn_if_transfers_exposed(
                self.runtime,
                args,
                kwargs,
                bf16=self.config.compute_dtype.itemsize == 2,  # 2-byte weights cross: fp16 as bf16
                accumulation=self.gradient_accumulation_steps(),
            )
            # The trace says what was chosen (its otherData), next to the stash track's spans.
            self._tracing.metadata.update(decide_at_first_forward(self, self.module, args, kwargs))
        self._tracing.before_forward(self.global_steps)
        self._before_forward()  # before begin_forward's first weight copies
        with self.runtime.observe(), self._out_of_memory_explained():
            self.blocks.begin_forward()
            if self.causal_loss is not None and self.causal_loss.applies(kwargs):
                return self.causal_loss(self.module, args, kwargs)  # model/causal_lm_loss.py
            return self.module(*args, **kwargs)

    def _out_of_memory_explained(self) -> contextlib.AbstractContextManager[None]:
        """A device out-of-memory error inside names the GPU tier's share and its fix, where
        the tier holds states (optimizer/device_states.py)."""
        if self.device_states is None:
            return contextlib.nullcontext()
        return self.device_states.out_of_memory_explained()

    def settle_optimizer(self) -> None:
        """Wait until the last optimizer step's update, when it runs behind :meth:`step`, has
        landed in the host state (optimizer/pipelined_finish.py: [Note: pipelined finish]).
        The engine does it wherever it reads or writes that state; call it before reading
        ``module``'s parameters directly between ``step()`` and the next forward. Between a
        step's last backward and ``step()`` it also undoes the updates made during backward
        where they can be undone: the state then reads as before the step."""
        if self.pipelined_finish is not None:
            self.pipelined_finish.settle_observed()
        if self.device_states is not None:
            with self.runtime.observe():  # host code reads the device states next
                self.device_states.settle()
        if self._final_backward_done:  # and no step() yet: the state reads as before the step
            self._withdraw_speculation()

    def _withdraw_speculation(self) -> None:
        """Between a step's last backward and ``step()`` the worker may have updated ranges
        speculatively (optimizer/speculative_step.py: [Note: speculative steps]): a state dict
        or checkpoint taken there must hold the weights before the step, as DeepSpeed's does
        (a checkpoint with the held gradients and updated masters steps them twice on resume).
        The speculation is undone here; ``step()`` updates every range from the held gradients."""
        with self.runtime.observe():
            self.sink.drain()  # Sync: the worker's speculative writes land before they are undone
            if self._forward_since_backward:
                # Sync: that forward's weight copies (device reads of the host weights the
                # restore writes) may still be queued; rare, so the host waits for the device.
                self.runtime.synchronize()
            with self.runtime.host_work():
                self.stepper.withdraw_speculation()

    def _before_model_forward(self) -> None:
        """The model's forward pre-hook (optimizer/pipelined_finish.py: [Note: pipelined finish];
        optimizer/device_states.py: [Note: device state ordering])."""
        training = torch.is_grad_enabled() and self.module.training
        self._before_forward()
        if self.pipelined_finish is not None:
            with self.runtime.observe():
                self.pipelined_finish.before_forward(training=training)
        if self.device_states is not None:
            with self.runtime.observe():
                if not training:  # eval or generation: host code may read any state
                    self.device_states.settle()
                elif self._resident_index in self.device_states:
                    # The embedding computes first: its device update lands before, on the device.
                    self.device_states.wait_on_device(self._resident_index, self.runtime.compute_stream())

    def _landed(self, index: int) -> None:  # a state's pipelined update, seen by a waiting thread
        if index == self._resident_index:
            self.resident.refresh_device()  # queued on the compute stream: before the forward

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backpropagate ``loss`` divided by the accumulation steps, and with fp16 times the
        loss scale (DeepSpeed semantics: the scale multiplies the divided loss)."""
        self.optimizer.refuse_if_evaluation_only("backward")
        with self.runtime.observe(), self._out_of_memory_explained():
            # Sync: the update behind the last step() reads the held gradients this backward
            # lands in (the GPU tier's, its device gradients). Free after a training forward,
            # which waited for every state it reached (no gradient comes from one it did not),
            # but not for a loss whose forward came before that step() (the mutation test's
            # forward-ahead scenario). Every chunk _land_gradient places comes from this
            # backward's hooks, or the reducer behind them, before the next step() can start
            # an update: this wait orders them all, so _land_gradient has no wait of its own.
            self.settle_optimizer()
            self.blocks.begin_backward()
            scaled = loss / self.gradient_accumulation_steps() if scale_wrt_gas else loss
            self.loss_scaling.scale_loss(scaled).backward(retain_graph=retain_graph)
        self._final_backward_done = self.is_gradient_accumulation_boundary()
        self._forward_since_backward = False  # its forward's copies: this backward's gradients follow them
        return loss

    def _before_forward(self) -> None:
        """Noted for the next update (:meth:`_before_update` orders this forward's reads before
        it). Between a step's last backward and ``step()`` the gradient worker may be updating
        the host weights already (speculated ranges, or every chunk when nothing is held:
        docs/how-it-works.md, "The optimizer step"): such a forward reads some updated and some
        not, where DeepSpeed's engine reads the old ones. Said, not refused: training is
        unaffected (it only reads, after the worker's writes so far: the drain)."""
        if self._forward_since_backward:
            return
        self._forward_since_backward = True
        if not self._final_backward_done:
            return
        with self.runtime.observe():
            self.sink.drain()  # Sync: the worker's updates so far land before this forward reads
        if self.stepper.updates_during_backward:
            warnings.warn(
                "megatrain: a forward between the last backward of a step and engine.step() reads weights "
                "the optimizer is already updating (the engine updates during backward); its outputs mix "
                "old and new weights. Call engine.step() before this forward.",
                stacklevel=3,
            )

    def step(self, lr_kwargs: dict[str, Any] | None = None) -> None:
        """Finish a micro-batch; at the accumulation boundary, finish the optimizer step."""
        self.optimizer.refuse_if_evaluation_only("step")
        if self.is_gradient_accumulation_boundary():
            # Closed before the finish: its update may run behind step() (pipelined), and a
            # step's ledger then counts the previous step's finish whatever the timing.
            ledger = self._close_ledger_step()
            with self.runtime.observe():
                self.optimizer.step()  # -> _finish_optimizer_step (DeepSpeed's order)
            if self.lr_scheduler is not None and self._step_applied:  # DeepSpeed: not after a skip
                self.lr_scheduler.step(**(lr_kwargs or {}))
            self.global_steps += 1
            # Writes the trace after its last step; the step's span carries its host ledger.
            self._tracing.after_step(self.global_steps - 1, **ledger)
        self.micro_steps += 1
        self._boundary_override = None

    def _close_ledger_step(self) -> dict[str, Any]:
        """Close the host ledger's step (race checker on): its figures, for the trace."""
        ledger = self.runtime.host_ledger
        if ledger is None:
            return {}
        counts = self.last_host_ledger = ledger.close_step()
        return {"host_ledger": {**counts.as_dict(), "per_param": counts.per_param(self.num_params)}}

    def is_gradient_accumulation_boundary(self) -> bool:
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        self._boundary_override = is_boundary

    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.train_micro_batch_size_per_gpu

    def train_batch_size(self) -> int:
        return self.config.train_batch_size

    def get_global_grad_norm(self) -> float | None:
        return self._global_grad_norm

    def was_step_applied(self) -> bool:
        """Whether the last optimizer step changed the weights (False: skipped, non-finite)."""
        return self._step_applied

    def get_lr(self) -> list[float]:
        return [float(group["lr"]) for group in self.optimizer.param_groups]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Gradients live in the engine's host buffers and are cleared by every update."""
        del set_to_none

    def device_bytes(self) -> dict[str, int]:
        """Device memory the engine itself holds, by kind (:func:`engine_memory.device_bytes`)."""
        return engine_memory.device_bytes(self.resident, self.streamer, self.blocks, self.placement)

    def host_bytes(self) -> dict[str, int]:
        """Host memory of the persistent training state, by kind (:func:`engine_memory.host_bytes`)."""
        weights = self.gathered_weights if self.gathered_weights is not None else self.nvme_weights
        return engine_memory.host_bytes(self.placement, self.stepper.journal, self.nvme_tier, weights)

    def destroy(self) -> None:
        """Stop the gradient worker, give the blocks their own ``forward`` back, unpin host memory.

        The model stays usable: its parameters keep viewing the (now unpinned) host masters
        (the NVMe tier hands back the masters it held: ``NvmeTier.close``).
        Idempotent: DeepSpeed's ``__del__`` calls it again on the engine the adapter builds,
        and a second call must neither remap removed swap files nor hand back the
        process's mmap threshold twice.
        """
        if self._destroyed:
            return
        self._destroyed = True
        if self._exit_handler is not None:
            atexit.unregister(self._exit_handler)
        if self.pipelined_finish is not None:
            with self.runtime.observe():
                self.pipelined_finish.close()  # the last step's update lands first
        self._tracing.close()  # a trace cut short is still written
        self.sink.close()
        self.blocks.uninstall()
        self.resident.unhook_gradients()
        if self.nvme_tier is not None:
            self.nvme_tier.close()  # the swap files are working state: removed with the run
        self.runtime.release_host_memory()

    # -- optimizer ---------------------------------------------------------------------------

    def _land_gradient(self, index: int, offset: int, numel: int, final: bool) -> Landing:
        """Where a chunk of this rank's windows lands (GradientSink, on the pushing thread);
        see ``HeldWrites.land``."""
        if self.device_states is not None and index in self.device_states:
            return self._land_on_device(index, offset, numel)
        # Not settled here: engine.backward did before any gradient of it could land.
        grad = self.optimizer_states[index].grad
        if grad is None:  # nothing held: the worker steps each chunk as it arrives
            return STAGED
        start = offset - self.windows[index][0]
        speculative = final and self.stepper.may_speculate(index, start, numel)  # the worker steps it in backward
        with self.runtime.host_work():  # a partly written chunk's zeroing: no write of it in flight
            return self.held_writes.land(index, grad, start, numel, self.config.compute_dtype, speculative)

    def _land_on_device(self, index: int, offset: int, numel: int) -> Landing:
        """A device state's chunk: copied (its first write this step) or added into its held
        gradient on the device, whose earlier writes the device orders
        (optimizer/device_states.py: [Note: device state ordering]); the worker never sees it."""
        grad = self.optimizer_states[index].grad
        assert grad is not None, "a device state always holds its gradient"
        end = offset + numel
        unwritten = self.held_writes.claim(index, offset, end)
        fresh = unwritten == [(offset, end)]
        zero = () if fresh else tuple((lo - offset, hi - offset) for lo, hi in unwritten)
        return Landing(held=grad[offset:end], fresh=fresh, notify=False, on_device=True, zero=zero)

    def _consume_gradient(self, index: int, offset: int, grad: torch.Tensor, final: bool, landing: Landing) -> None:
        """Runs on the gradient worker for every host chunk of this rank's windows that
        reaches it (see GradientSink)."""
        state = self.optimizer_states[index]
        offset -= self.windows[index][0]
        step = self.optimizer_steps + 1
        if state.grad is None:  # nothing held (no clipping, accumulation or skipping): final
            assert not self.loss_scaling.enabled, "fp16 holds gradients (EngineConfig.holds_gradients)"
            self.stepper.consume_final(index, offset, grad, step)
            return
        if landing.held is not None:  # copied in place, its norm summed on the device
            self.stepper.consume_final(index, offset, grad, step, counted=True)
            return
        accumulated = state.grad[offset : offset + grad.numel()]
        # fp16: divided by the scale here, in fp32; the scale changes only between steps,
        # after the worker has drained (optimizer/loss_scaling.py). The first write of the
        # step copies: the held gradients are never zeroed (gradients/held_writes.py). One
        # GIL-free pass, with the final chunk's sum of squares where it can
        # (optimizer/gradient_accumulation.py: [Note: the fused accumulation pass]).
        squares = self.accumulation.accumulate_(
            accumulated, grad, self.loss_scaling, overwrite=landing.fresh, squares=final
        )
        if final:
            if squares is not None:
                self.stepper.norm.add_squares_on_host(squares)
            self.stepper.consume_final(index, offset, accumulated, step, counted=squares is not None)

    def _before_update(self) -> None:
        """Order everything that reads the host weights before this step's update writes them."""
        forward_before_step = self._forward_since_backward  # and no backward since: nothing orders its reads
        self._final_backward_done = self._forward_since_backward = False
        behind = self.pipelined_finish is not None and self.pipelined_finish.in_flight
        self.settle_optimizer()  # the last step's update, if its forward did not need it all
        self.sink.drain()  # the worker is idle and every direct copy has landed
        if behind or forward_before_step:
            # Sync: device work that reads the host weights this step's update writes, and that
            # no backward's gradients follow (the drain orders only those): step() again with no
            # backward since the last one (the only way an update is still behind here: a
            # backward settles it), whose settle above queued a refresh of the resident
            # parameters' device copy; or a forward with no backward since, whose weight copies
            # (on the CPU, its compute) may still be queued. Rare, so the host waits for the device.
            self.runtime.synchronize()
        if forward_before_step:  # the blocks it copied ahead for its backward hold the old weights
            self.streamer.begin(())  # dropped: the next pass copies the updated ones

    def _finish_optimizer_step(self) -> None:
        self._before_update()
        # After the drain the rest of the update is host code here, or on the finish worker.
        with self.runtime.tracer.span("step finish", "optimizer worker"), self.runtime.host_work():
            self.held_writes.settle(self.optimizer_states)  # zeros where nothing was written
            report = self.stepper.finish(self.optimizer_steps + 1, self.pipelined_finish)
            self.held_writes.clear()
        if self.data_parallel is not None:
            changed = report.outcome is not StepOutcome.SKIPPED  # a skipped step changed nothing
            step = self.optimizer_steps + 1
            self.data_parallel.gather_updated_weights(self.states, self.placement.states, step, changed)
        self.last_step_report = report
        self._global_grad_norm = report.norm
        self._step_applied = report.outcome in (StepOutcome.APPLIED, StepOutcome.CLIPPED)
        self.optimizer.overflow = not self._step_applied  # DeepSpeed's flag (Accelerate reads it)
        # fp16: the scaler hears of the step after it is settled (an overflow's is undone), as
        # in DeepSpeed's ZeRO optimizer; at its minimum scale it raises DeepSpeed's error.
        self.loss_scaling.after_step(overflow=not self._step_applied)
        if self._step_applied:
            self._consecutive_skips = 0
            self.optimizer_steps += 1
            if self.pipelined_finish is None or not self.pipelined_finish.in_flight:
                self.resident.refresh_device()  # else as its update lands (_landed)
            return
        if report.outcome is StepOutcome.PARTIAL:
            raise NonFiniteGradientError(
                f"the global gradient norm of optimizer step {self.optimizer_steps + 1} is {report.norm}; "
                f"{report.speculated} elements whose gradients came before the first non-finite one were "
                "already updated, because this configuration holds no gradients (no clipping, no "
                'accumulation). Restore the last checkpoint; set "megatrain": {"non_finite_steps": '
                '"skip"} to skip such steps exactly (gradients are then held: 2-4 bytes/param)'
            )
        self.skipped_steps += 1
        self._consecutive_skips += 1
        if self.loss_scaling.dynamic:  # an overflow: the scaler judges (it lowered the scale)
            logger.info(
                "megatrain: fp16 overflow in optimizer step %d: skipped; loss scale now %s",
                self.optimizer_steps + 1,
                self.loss_scaling.scale,
            )
            return
        logger.warning(
            "megatrain: skipped optimizer step %d: global gradient norm %s (%d skipped in a row, "
            "%d in all); weights and optimizer state unchanged",
            self.optimizer_steps + 1,
            report.norm,
            self._consecutive_skips,
            self.skipped_steps,
        )
        if not self.config.skips_non_finite or self._consecutive_skips > self.config.options.max_consecutive_skips:
            raise NonFiniteGradientError(
                f"the global gradient norm was not finite ({report.norm}) in {self._consecutive_skips} "
                f"optimizer step(s) in a row (megatrain.non_finite_steps={self.config.options.non_finite_steps!r}, "
                f"max_consecutive_skips={self.config.options.max_consecutive_skips}); weights and optimizer "
                "state are those before the first of them. Check the data, lower the learning rate or "
                "restore a checkpoint"
            )

    # -- checkpoints ---------------------------------------------------------------------------

    def save_checkpoint(
        self,
        save_dir: str,
        tag: Any = None,
        client_state: dict[str, Any] | None = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
    ) -> Literal[True]:
        """DeepSpeed's ``save_checkpoint``: ``<save_dir>/<tag>`` is also a Hugging Face model
        directory; crash-safe and checksummed. See :mod:`megatrain_ds.checkpoint.save`.

        Collective with data parallel: every rank must call it (barriers, the span files,
        the blocks gathered for the model files); every rank returns once it is published."""
        # Settled first, outside host_work: the resident parameters' refresh it may issue is
        # device work, which the streams' synchronisation in save_checkpoint then orders.
        self.settle_optimizer()
        # Checkpoint I/O is host code on host buffers, once save_checkpoint has synchronised the streams.
        with self.runtime.observe(), self.runtime.host_work():
            if self._inside_accumulation_window():  # the held gradients are saved: all of them valid
                self.sink.drain()
                self.held_writes.settle(self.optimizer_states)
            return checkpoint_save.save_checkpoint(
                self, save_dir, tag, client_state, save_latest, exclude_frozen_parameters
            )

    def load_checkpoint(
        self,
        load_dir: str,
        tag: Any = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        custom_load_fn: Any = None,
    ) -> tuple[str | None, dict[str, Any] | None]:
        """DeepSpeed's ``load_checkpoint``: returns ``(load_path, client_state)``, or
        ``(None, None)`` without a ``latest`` file. See :mod:`megatrain_ds.checkpoint.load`.

        Collective with data parallel: every rank must call it (barriers; each node reads
        its copy, each rank its windows)."""
        self.settle_optimizer()  # outside host_work, as for saving
        with self.runtime.observe(), self.runtime.host_work():  # host code, as for saving
            request = checkpoint_load.LoadRequest(
                load_dir,
                tag,
                load_module_strict,
                load_optimizer_states,
                load_lr_scheduler_states,
                load_module_only,
                custom_load_fn,
            )
            loaded = checkpoint_load.load_checkpoint(self, request)
        # Inside an accumulation window the held gradients were loaded: later writes add to
        # them; at a boundary the next write of each element is its first.
        self.held_writes.clear()
        if self._inside_accumulation_window():
            self.held_writes.mark_all_written()
        return loaded

    def _inside_accumulation_window(self) -> bool:
        """Between micro-batches of one optimizer step (held gradients hold a partial sum)."""
        return self.micro_steps % self.gradient_accumulation_steps() != 0
