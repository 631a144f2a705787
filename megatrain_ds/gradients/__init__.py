"""Gradients on their way from backward to the host: buckets, the d2h stream, the worker.

- ``outbox``: a block's parameter gradients, bucketed as backward finishes them.
- ``sink``: device-to-host copies, straight into the held gradients or into pinned staging
  consumed by a host worker thread.
- ``held_writes``: which held gradient elements this step has written (the first write copies).
- ``squared_norm``: the step's squared gradient norm, summed on the device or the host.
- ``row_chunked``: embedding and lm_head gradients produced a few rows at a time.

May import: ``config``, ``runtime``, ``state``.
"""
