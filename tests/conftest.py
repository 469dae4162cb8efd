import pytest
import torch


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """Tests never touch the user's cache unless they opt in (slow tests share one cache, see below)."""
    monkeypatch.setenv("QINFER_CACHE", str(tmp_path_factory.getbasetemp() / "qinfer-cache"))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
