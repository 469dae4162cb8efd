"""Loader memory: dropping the pages of memory-mapped tensors that are done with; weights in huge pages."""

import errno
import mmap
import os
import sys
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import save_file

import qinfer.model.loader
from qinfer.format import QuantScheme
from qinfer.model.loader import HUGE_PAGE, drop_pages, huge_pages_reason, into_huge_pages, load_model, read_safetensors
from qinfer.pipeline.config import CalibConfig
from qinfer.pipeline.quantize import quantize_model
from tests.tiny_models import COMMON, CONFIGS, make_model


def _mapped_kib(path: Path) -> int:
    """Resident KiB of this process's mappings of ``path`` (from /proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5:  # a mapping's first line: address range ... [path]
            inside = len(head) >= 6 and head[5] == str(path)
        elif inside and line.startswith("Rss:"):
            total += int(head[1])
    return total


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")
def test_dropped_pages_leave_the_process_and_read_back_unchanged(tmp_path):
    path = tmp_path / "w.safetensors"
    a, b = torch.randn(512, 1024), torch.randn(300)
    save_file({"a": a, "b": b}, str(path))
    t = read_safetensors(path)
    assert float(t["a"].sum()) == pytest.approx(float(a.sum()), rel=1e-5)  # read: its pages are resident
    before = _mapped_kib(path)
    assert before >= 2000
    dropped = drop_pages([t["a"], t["a"].clone()])  # the copy is not in a map: skipped
    assert 0 < dropped <= a.numel() * 4 and dropped % mmap.PAGESIZE == 0
    assert _mapped_kib(path) <= before - dropped // 1024
    torch.testing.assert_close(t["a"], a)  # faulted back in from the file
    torch.testing.assert_close(t["b"], b)
    assert drop_pages([b, t["b"]]) == 0  # a tensor within one page: no whole page to drop


def _weights(model) -> list[torch.Tensor]:
    """Every parameter of ``model`` and every tensor of its packed weights, once each."""
    found = {id(p): p for p in model.parameters()}
    for module in model.modules():
        w = getattr(module, "weight", None)
        for t in vars(w).values() if w is not None and not isinstance(w, torch.Tensor) else ():
            if isinstance(t, torch.Tensor):
                found[id(t)] = t
    return list(found.values())


@pytest.mark.parametrize("scheme", [
    None,
    QuantScheme(method="rtn", bits=4, group_size=32, quantize_lm_head=True),
    QuantScheme(method="fp8", format="fp8", bits=8, group_size=-1, quantize_lm_head=True),
])
def test_huge_pages_take_every_weight_and_change_no_output(tmp_path, monkeypatch, scheme):
    monkeypatch.delenv("QINFER_HUGE_PAGES", raising=False)
    if huge_pages_reason():
        pytest.skip(huge_pages_reason())
    monkeypatch.setattr(qinfer.model.loader, "COPY_SLICE", 3000)  # each weight copied in many slices, none page-aligned
    folder = tmp_path / "src"
    make_model("gemma3", folder)  # a tied embedding: one tensor under two names, or one packed lm_head
    if scheme is not None:
        quantize_model(folder, tmp_path / "q", scheme, CalibConfig(samples=2, seq_len=16))
        folder = tmp_path / "q"
    plain, moved = load_model(folder), load_model(folder, run=True)
    before = {t.data_ptr() for t in _weights(plain)}
    weights = _weights(moved)
    starts = sorted(t.data_ptr() for t in weights)
    ends = max(t.data_ptr() + t.numel() * t.element_size() for t in weights)
    assert starts[0] % HUGE_PAGE == 0 and not before & set(starts)  # all copied, from a huge page on
    assert ends - starts[0] <= sum(-(-t.numel() * t.element_size() // 64) * 64 for t in weights)  # into one region
    assert moved.model.embed_tokens.weight is moved.lm_head.weight  # still tied
    ids = torch.tensor([[0, 7, 7, 300, 5]])
    assert torch.equal(moved(ids), plain(ids))
    assert torch.equal(moved(ids[:, :1]), plain(ids[:, :1]))  # one row: the decode GEMVs, on the new pointers
    assert into_huge_pages(moved) > 0  # moving again is harmless
    assert torch.equal(moved(ids[:, :1]), plain(ids[:, :1]))


def test_no_room_for_the_huge_page_copy_keeps_the_weights_where_they_are(tmp_path, monkeypatch):
    # under ulimit -v the second copy's map is refused (ENOMEM): the model runs from its own pages
    make_model("llama", tmp_path)
    monkeypatch.setattr(qinfer.model.loader, "huge_pages_reason", lambda: "")

    def refuse(nbytes):
        raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))

    monkeypatch.setattr(qinfer.model.loader, "huge_page_buffer", refuse)
    plain, kept = load_model(tmp_path), load_model(tmp_path, run=True)
    ids = torch.tensor([[0, 7, 7, 300, 5]])
    assert torch.equal(kept(ids), plain(ids))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")
def test_the_weights_fusing_read_leave_before_the_copy_into_huge_pages(tmp_path, monkeypatch):
    # load_model(run=True) stacks q/k/v and gate/up, reading them from the file map: their pages go before every
    # weight is copied into huge pages, so the copy's peak holds one copy of the model, not two
    wide = {**COMMON, "hidden_size": 256, "intermediate_size": 512, "head_dim": 64, "num_hidden_layers": 2}
    monkeypatch.setitem(CONFIGS, "llama-wide", lambda: transformers.LlamaConfig(**wide))
    make_model("llama-wide", tmp_path, dtype=torch.bfloat16)  # bf16, as loaded: the weights stay in the map
    real, resident = qinfer.model.loader.into_huge_pages, []

    def measured(model):
        resident.append(_mapped_kib(tmp_path / "model.safetensors"))
        return real(model)

    monkeypatch.setattr(qinfer.model.loader, "into_huge_pages", measured)
    moved = load_model(tmp_path, run=True)
    # at most the pages the 10 stacked weights (1.5 MiB) share with their neighbours, two each
    assert resident and resident[0] * 1024 <= 20 * mmap.PAGESIZE, resident
    ids = torch.tensor([[0, 7, 7, 300, 5]])
    plain = load_model(tmp_path)
    assert torch.equal(moved(ids), plain(ids)) and torch.equal(moved(ids[:, :1]), plain(ids[:, :1]))


def test_huge_pages_off_leaves_the_weights_in_the_file_map(tmp_path, monkeypatch):
    make_model("llama", tmp_path)
    model = load_model(tmp_path)
    where = [t.data_ptr() for t in _weights(model)]
    monkeypatch.setenv("QINFER_HUGE_PAGES", "0")
    assert huge_pages_reason() == "QINFER_HUGE_PAGES=0" and into_huge_pages(model) == 0
    monkeypatch.delenv("QINFER_HUGE_PAGES")
    setting = tmp_path / "enabled"
    setting.write_text("always madvise [never]\n")
    monkeypatch.setattr("qinfer.model.loader._THP_SETTING", setting)
    assert "off" in huge_pages_reason() and into_huge_pages(model) == 0
    monkeypatch.setattr("qinfer.model.loader._THP_SETTING", tmp_path / "missing")
    assert "not readable" in huge_pages_reason() and into_huge_pages(model) == 0
    assert [t.data_ptr() for t in _weights(model)] == where
