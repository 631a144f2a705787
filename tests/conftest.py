"""Fixtures shared by the unit tests."""

import pytest
import torch

import megatrain_ds.engine


@pytest.fixture
def cpu_single_thread(monkeypatch):
    """CPU numerics are the reference (CUDA is covered where marked gpu), on one thread:
    tiny models gain nothing from a second one, and on a shared machine spinning OpenMP
    threads make them several times slower."""
    monkeypatch.setattr(megatrain_ds.engine, "default_device", lambda: torch.device("cpu"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
