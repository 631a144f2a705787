"""AdamW over host-resident flat state: the arithmetic, where it runs, and the validated step.

- ``adamw_math``: the hyperparameters of one update and the op-by-op reference.
- ``cpu_adam``: CPU kernels (DeepSpeed's, ATen's fused, op by op) and the choice among them.
- ``device_adamw``: the update on the compute device, state streamed in and out.
- ``device_states``: the GPU tier's update (``"device_state"``): states kept whole on the
  device, stepped there in place at ``step()``, ordered before the next forward by events.
- ``placement``: which state's update runs where (``"optimizer_device"``), calibrated once.
- ``host_adamw``: walks a state's optimizer-group runs and hands each to its placement.
- ``speculative_step``: global norm, speculative updates during backward, clipping, skips.
- ``journal``: what the speculative step journals (whole blocks, then part of one, within
  the budget) and the pre-step copies it restores.
- ``pipelined_finish``: the step's remaining update on a host thread behind ``engine.step()``,
  in the order the next forward reads the states, and the waits for it.
- ``gradient_accumulation``: a staged gradient chunk written or added into the held fp32
  gradients, with its sum of squares, in one GIL-free pass of the engine's C++ binding.
- ``loss_scaling``: fp16 loss scaling with DeepSpeed's loss scalers, and their checkpointed state.
- ``facade``: the optimizer object ``deepspeed.initialize`` returns.

May import: ``config``, ``runtime``, ``state``, ``gradients``; of DeepSpeed, besides its op builders, its loss
scalers (``deepspeed.runtime.fp16.loss_scaler``, and ``deepspeed.comm``, which they ask for the rank).
"""
