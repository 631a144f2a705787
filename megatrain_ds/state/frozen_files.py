"""Frozen weights on the NVMe tier: each block's in a read-only file, in their own dtype.

With the weights on the tier (``"nvme_offload": "all"``), a block's frozen
parameters (``requires_grad=False``, e.g. a LoRA base) have no master, moments or
gradients: the block's swap file (``state/nvme_tier.py``) holds its trained prefix alone,
and the frozen weights ``[trained_numel, numel)`` of its flat layout are a file of their
own, ``blockNNNNN.frozen`` in the same swap directory, in their own dtype
(``HostFlatState.frozen``: the compute dtype where every one arrives in it, else the
master's). With data parallel each rank's tier holds its window of the trained prefix in
the swap file and its window of the frozen weights in the frozen file
(``HostFlatState.frozen_window``; the swap file is empty where the rank's window of a small
trained prefix is), gathered whole when used (``distributed/gathered_weights.py``).
:class:`FrozenFiles` is the tier's bookkeeping of those files; the tier moves the bytes.

[Note: frozen weights on the tier]
- Written once, when the tier adopts the block (:meth:`FrozenFiles.write`, on the training
  thread, through the page cache and fsynced: the file is then on disk before any O_DIRECT
  read of it, as a checkpoint's mapped writes are), and never by a step: the optimizer's
  window slots hold the trained prefix's kinds alone, so nothing of the frozen weights is
  written back.
- Read with the master whenever the weight window reads a block
  (``NvmeTier.read_master``): on an I/O thread, into an aligned fp32 staging buffer of the
  window's, whose bytes are then copied, in their dtype, into the block's weights after its
  trained prefix (rounded to the compute dtype where they are held in the master's).
- Changed only by a checkpoint load, through ``NvmeTier.file_views`` (a shared mapping,
  fsynced when done, the block's version moved on so the weight window reads it again).
- Given back to the parameters, as a private mapping, when the tier closes.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from megatrain_ds.runtime.stream_check import declare_access
from megatrain_ds.state.swap_io import aligned_bytes


@dataclass
class _FrozenFile:
    nbytes: int
    """The frozen weights' bytes (the file is padded to the I/O engine's alignment)."""
    padded: int
    path: str = ""
    dtype: torch.dtype | None = None
    """Learnt when the block is adopted: what its frozen weights arrived as."""
    token: torch.Tensor = field(default_factory=lambda: torch.empty(1))
    """What the race checker sees of the file's bytes (``declare_access``)."""


class FrozenFiles:
    """Every block's read-only file of frozen weights (see the module docstring).

    Args:
        nbytes: each block's frozen weights' bytes, in block order (0: none, no file).
        alignment: the I/O engine's; each file is padded to it.
    """

    def __init__(self, nbytes: Sequence[int], alignment: int) -> None:
        self._files = {
            index: _FrozenFile(size, aligned_bytes(size, alignment)) for index, size in enumerate(nbytes) if size
        }

    def sizes(self) -> dict[str, int]:
        """File name -> padded bytes, for the swap directory to make."""
        return {_name(index): file.padded for index, file in self._files.items()}

    def locate(self, paths: Mapping[str, str]) -> None:
        """The files' paths, once the swap directory has made them."""
        for index, file in self._files.items():
            file.path = paths[_name(index)]

    def holds(self, index: int) -> bool:
        return index in self._files

    def numel(self, index: int) -> int:
        """Elements of block ``index``'s frozen weights once adopted (0 without a file)."""
        file = self._files.get(index)
        if file is None:
            return 0
        assert file.dtype is not None, "adopted before it is counted"
        return file.nbytes // file.dtype.itemsize

    def padded_bytes(self, index: int) -> int:
        return self._files[index].padded

    def largest(self) -> int:
        """Padded bytes of the largest file (the weight window's staging buffers); 0 without any."""
        return max((file.padded for file in self._files.values()), default=0)

    def file(self, index: int) -> tuple[str, torch.Tensor, int]:
        """Block ``index``'s file: its path, its race-checker token and its padded bytes."""
        file = self._files[index]
        return file.path, file.token, file.padded

    def write(self, index: int, weights: torch.Tensor) -> int:
        """Write block ``index``'s frozen weights (``HostFlatState.frozen``) to its file, once,
        on the training thread; returns the bytes written."""
        file = self._files[index]
        values = weights.detach().reshape(-1).view(torch.uint8)
        if values.numel() != file.nbytes:
            raise ValueError(f"block {index}'s frozen weights are {values.numel()} bytes, the tier made {file.nbytes}")
        file.dtype = weights.dtype
        # A plain write from the tensor's own bytes, no staging: nothing else touches the
        # file before the fsync, after which O_DIRECT reads find the bytes on disk.
        declare_access(reads=(weights,), writes=(file.token,), what=f"the frozen weights' write of {file.path}")
        with open(file.path, "r+b") as handle:
            handle.write(values.numpy().data)  # the bytes in place: no copy
            handle.flush()
            os.fsync(handle.fileno())
        return file.nbytes

    def unpack(self, index: int, staging: torch.Tensor) -> torch.Tensor:
        """Block ``index``'s frozen weights in ``staging`` (its file's bytes read into it), as
        a tensor of their dtype."""
        file = self._files[index]
        assert file.dtype is not None, "adopted before it is read"
        return staging.view(torch.uint8)[: file.nbytes].view(file.dtype)

    def mapped(self, index: int, shared: bool) -> torch.Tensor:
        """Block ``index``'s frozen weights mapped from its file in their dtype: ``shared``,
        writes go to the file (a checkpoint load); else a private copy-on-write mapping that
        outlives the file (the parameters' values once the tier has closed)."""
        file = self._files[index]
        assert file.dtype is not None, "adopted before it is mapped"
        mapped = torch.from_file(file.path, shared=shared, size=file.padded, dtype=torch.uint8)
        return mapped[: file.nbytes].view(file.dtype)

    def fsync(self, index: int) -> None:
        """A mapping's writes reach the disk before an O_DIRECT read of the file."""
        fd = os.open(self._files[index].path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _name(index: int) -> str:
    return f"block{index:05d}.frozen"
