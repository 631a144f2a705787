"""The step's squared gradient norm, summed where each chunk is: on the device or the host.

A chunk copied straight into the held gradients (no host pass, ``sink.py``) adds its
squared norm on the device, on the d2h stream, into a one-element fp64 accumulator; a
chunk the host worker handles anyway (accumulation, fp16, no held gradients) adds it on
the host. :meth:`SquaredNorm.take` reads both once per step, after the sink has drained:
the one host read of the device accumulator, and the one place the step's norm comes from.

Arithmetic, the same on both sides and as before this split: each chunk's norm in fp32
(``vector_norm(dtype=fp32)``, no chunk-sized temporary), squared and summed in fp64 in
push order, so the sum is deterministic and a chunk's contribution does not depend on
where it was computed (on the CPU the "device" is the host: bit for bit the same).
The one exception: a chunk accumulated into fp32 held gradients by the fused host pass
(``optimizer/gradient_accumulation.py``) brings its sum of squares summed in fp64 in a
fixed order (:meth:`SquaredNorm.add_squares_on_host`), more exact than an fp32 norm and as
deterministic; it moves the step's norm by less than an fp32 norm's own rounding error.
"""

from __future__ import annotations

import math

import torch


class SquaredNorm:
    """Running ``sum(norm(chunk)**2)`` of one optimizer step.

    Args:
        device: where the device-side accumulator lives (the runtime's device).
    """

    def __init__(self, device: torch.device) -> None:
        self._on_device = torch.zeros(1, dtype=torch.float64, device=device)
        self._on_host = 0.0

    def add_on_device(self, chunk: torch.Tensor) -> None:
        """Add ``chunk``'s squared norm on the current stream (the sink's d2h stream); the
        host sees it only at :meth:`take`, after the stream has been waited for."""
        norm = torch.linalg.vector_norm(chunk, dtype=torch.float32)
        self._on_device.addcmul_(norm, norm)  # fp64: the fp32 norm widened, then squared

    def add_on_host(self, chunk: torch.Tensor) -> None:
        """Add a host chunk's squared norm (the gradient worker; the same arithmetic)."""
        self._on_host += float(torch.linalg.vector_norm(chunk, dtype=torch.float32)) ** 2

    def add_squares_on_host(self, squares: float) -> None:
        """Add a host chunk's sum of squares computed elsewhere (the gradient worker's fused
        accumulation pass, ``optimizer/gradient_accumulation.py``: fp64, in a fixed order)."""
        self._on_host += squares

    def lower_bound(self) -> float:
        """What the host knows of the sum so far: the sum only grows, so this bounds it
        from below (speculation stops once it proves clipping or a skip)."""
        return self._on_host

    def host_known_finite(self) -> bool:
        return math.isfinite(self._on_host)

    def take(self) -> float:
        """The step's sum, and a fresh start for the next step. Call on the main thread
        only after every chunk's addition is done (the sink drained: its d2h stream waited
        for); the read of the device accumulator is the step's one device-to-host sync."""
        total = float(self._on_device) + self._on_host
        # Zeroed on the compute stream: the next step's first device addition is issued on
        # the d2h stream after that stream waited on an event the compute stream recorded
        # later (sink.py: [Note: gradient ordering]).
        self._on_device.zero_()
        self._on_host = 0.0
        return total
