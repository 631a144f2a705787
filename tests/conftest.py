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


@pytest.fixture
def stream_check(monkeypatch):
    """CPU runtimes created in the test check stream ordering (``MEGATRAIN_STREAM_CHECK=1``):
    virtual streams and events, and ``StreamRaceError`` on an access no synchronisation orders."""
    monkeypatch.setenv("MEGATRAIN_STREAM_CHECK", "1")
