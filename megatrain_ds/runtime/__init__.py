"""The device and the host as the engine sees them: streams, events, host allocations, tracing.

- ``device_runtime``: the one owner of CUDA streams, events and memory; hands out streams, events,
  pinned or page-aligned host buffers and device buffers (no-op streams on the CPU).
- ``stream_check``: the race checker (``MEGATRAIN_STREAM_CHECK=1``): virtual streams and
  host threads with vector clocks; an access no synchronisation orders raises.
- ``aten_access``: what an aten op reads and writes, and the engine line that issued it (the
  race checker's view of each op).
- ``trace``: Chrome/Perfetto traces of copies, compute and the optimizer worker.
- ``host_ledger``: host bytes read and written and copied per step, fed by the race checker.
- ``host_heap``: how the CPU path keeps transient host memory from piling up.
- ``node_shared_memory``: host memory mapped by every rank of a node.
- ``measurement_cache``: figures of this machine measured once and kept in a JSON file.
- ``built_ops``: the engine's C++ ops (DeepSpeed's sources, its flags), compiled once per
  machine and found again by name from any virtualenv.

May import: ``megatrain_ds.config`` only (nothing else of the package).
"""
