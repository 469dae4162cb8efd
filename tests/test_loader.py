"""Loader memory: dropping the pages of memory-mapped tensors that are done with."""

import mmap
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from qinfer.loader import drop_pages, read_safetensors


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
