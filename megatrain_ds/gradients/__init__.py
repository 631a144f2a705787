"""Gradients on their way from backward to the host: buckets, the d2h stream, the worker.

- ``outbox``: a block's parameter gradients, bucketed as backward finishes them.
- ``sink``: device-to-host copies into pinned staging, consumed by a host worker thread.
- ``row_chunked``: embedding and lm_head gradients produced a few rows at a time.

May import: ``config``, ``runtime``, ``state``.
"""
