import json
import time

import pytest
import torch

from qinfer.errors import QinferError
from qinfer.evals import roofline as rl
from qinfer.evals.roofline import (
    RooflinePoint,
    attainable_tflops,
    format_roofline,
    load_roofline,
    mbu,
    measure_roofline,
    mfu,
    roofline_path,
    save_roofline,
)
from qinfer.evals.roofline_plot import plot_roofline
from tests.evals.eval_fixtures import fake_roofline


def test_mbu_mfu_and_the_roof_are_exact():
    r = fake_roofline()
    assert mbu(2e9, 0.2, r) == 0.5  # 10 GB/s of 20
    assert mfu({"fp32": 1e12}, 4.0, r) == 1.0  # 0.25 TFLOP/s of 0.25
    assert mfu({"bf16": 1e12}, 4.0, r) == 0.5
    # mixed work: 1e12 FLOP at the fp32 peak take 4 s, 1e12 at the bf16 peak 2 s; done in 12 s
    assert mfu({"fp32": 1e12, "bf16": 1e12}, 12.0, r) == 0.5
    assert r.ridge("bf16") == 25.0 and r.ridge("fp32") == 12.5  # FLOP/byte where slope meets ceiling
    assert attainable_tflops(10.0, r, "bf16") == pytest.approx(0.2, rel=1e-15)  # on the slope: 10 x 20 GB/s
    assert attainable_tflops(25.0, r, "bf16") == 0.5
    assert attainable_tflops(100.0, r, "bf16") == 0.5 and attainable_tflops(100.0, r, "fp32") == 0.25


def test_helpers_reject_bad_input():
    r = fake_roofline()
    with pytest.raises(QinferError, match="no measured peak for dtype 'fp8'.*bf16, fp32"):
        mfu({"fp8": 1.0}, 1.0, r)
    with pytest.raises(QinferError, match="FLOPs keyed by dtype"):
        mfu(1.0, 1.0, r)
    with pytest.raises(QinferError, match="seconds_per_token must be a positive"):
        mbu(1.0, 0.0, r)
    with pytest.raises(QinferError, match="arithmetic_intensity"):
        attainable_tflops(float("nan"), r, "bf16")


def test_roofline_is_validated_and_read_only():
    with pytest.raises(QinferError, match="bandwidth_gbs"):
        fake_roofline(bandwidth_gbs=-1.0)
    with pytest.raises(QinferError, match="peak_tflops"):
        fake_roofline(peak_tflops={"int3": 1.0})
    with pytest.raises(QinferError, match="device"):
        fake_roofline(device="tpu")
    with pytest.raises(TypeError):
        fake_roofline().peak_tflops["bf16"] = 1e9
    with pytest.raises(QinferError, match="kind"):
        RooflinePoint("x", 1.0, 1.0, "training")


def test_json_round_trip(tmp_path):
    r = fake_roofline()
    save_roofline(r, tmp_path / "r.json")
    assert load_roofline(tmp_path / "r.json") == r
    assert json.loads((tmp_path / "r.json").read_text())["peak_tflops"] == {"bf16": 0.5, "fp32": 0.25}
    assert load_roofline(tmp_path / "missing.json") is None
    (tmp_path / "bad.json").write_text("{not json")
    assert load_roofline(tmp_path / "bad.json") is None


def test_cache_is_used_while_it_describes_this_process(monkeypatch):
    fresh = fake_roofline(bandwidth_gbs=99.0)
    calls = []
    monkeypatch.setattr(rl, "_measure", lambda device, seconds: calls.append(device) or fresh)
    save_roofline(fake_roofline(), roofline_path("cpu"))
    assert measure_roofline() == fake_roofline() and calls == []
    assert measure_roofline(force=True) == fresh and calls == ["cpu"]
    assert load_roofline(roofline_path("cpu")) == fresh
    save_roofline(fake_roofline(torch_version="0.0.1"), roofline_path("cpu"))  # stale: another torch
    assert measure_roofline() == fresh and calls == ["cpu", "cpu"]
    # another machine under the same CPU name (an AVX-512 part, where this may be AVX2), a bandwidth read from
    # other pages than the weights now lie in, or a cache written before either was recorded: measured again
    other_pages = "4 KiB" if rl._buffer_pages("cpu") == "2 MiB" else "2 MiB"
    for field, value in (("machine", rl._machine("cpu").replace("CPUs", "CPUs, another")), ("machine", None),
                         ("buffer_pages", other_pages), ("buffer_pages", None)):
        old = fake_roofline().to_json()
        if value is None:
            del old[field]
        else:
            old[field] = value
        roofline_path("cpu").write_text(json.dumps(old))
        calls.clear()
        assert measure_roofline() == fresh and calls == ["cpu"]
    calls.clear()
    roofline_path("cpu").write_text("garbage")
    assert measure_roofline() == fresh and len(calls) == 1
    legacy = fake_roofline().to_json()
    del legacy["matmul_op"]  # written before the peaks timed x @ w.T: the old a @ b peak is re-measured
    roofline_path("cpu").write_text(json.dumps(legacy))
    assert load_roofline(roofline_path("cpu")).matmul_op == "a @ b"
    assert measure_roofline() == fresh and len(calls) == 2


def test_machines_of_one_name_are_told_apart(monkeypatch):
    def cpuinfo(flags):
        text = f"processor\t: 0\nmodel name\t: AMD EPYC\ncpu family\t: 25\nmodel\t\t: 1\nflags\t\t: fpu {flags}\n"
        return lambda: [tuple(p.strip() for p in line.partition(":")[::2]) for line in text.splitlines()]

    monkeypatch.setattr(rl, "_cpuinfo", cpuinfo("avx2 avx512f avx512_bf16"))
    name, avx512 = rl._device_name("cpu"), rl._machine("cpu")
    monkeypatch.setattr(rl, "_cpuinfo", cpuinfo("avx2"))
    assert rl._device_name("cpu") == name == "AMD EPYC"
    assert rl._machine("cpu") != avx512 and "avx512_bf16" in avx512 and "cpu family 25 model 1" in avx512


def test_measurement_runs_and_gives_a_valid_roofline(monkeypatch):
    # small buffer and matmuls: this checks the plumbing, not the machine (no timing asserts)
    monkeypatch.setattr(rl, "BUFFER_BYTES", 16 << 20)
    monkeypatch.setattr(rl, "_MATMUL_TARGET_S", 0.0)
    monkeypatch.setattr(rl, "busy_while", lambda before, start: None)  # cached even while other work runs (below)
    r = measure_roofline(seconds=0.05, force=True)
    assert set(r.peak_tflops) == {"bf16", "fp32"} and r.matmul_n == {"bf16": 256, "fp32": 256}
    assert r.matmul_op == "x @ w.T"
    assert r.buffer_bytes == 16 << 20 and r.threads == torch.get_num_threads() and r.cpu_name
    assert r.buffer_pages == rl._buffer_pages("cpu") in ("2 MiB", "4 KiB")
    assert load_roofline(roofline_path("cpu")) == r
    monkeypatch.setenv("QINFER_HUGE_PAGES", "0")  # weights left in the file map: the bandwidth in 4 KiB pages
    assert measure_roofline(seconds=0.05, force=True).buffer_pages == "4 KiB"


def test_a_roofline_measured_on_a_busy_machine_is_used_once_and_not_cached(monkeypatch, capsys):
    fresh = fake_roofline(bandwidth_gbs=9.0)
    monkeypatch.setattr(rl, "_measure", lambda device, seconds: fresh)
    before = rl.busy_cpu_seconds()
    assert before is not None and before[0] >= before[1] > 0  # Linux: every process's CPU time, then our own
    assert 0.0 <= rl.others_cpus(before, 10.0) < 2.0  # over 10 s, whatever the machine did since
    for _ in range(50):  # a short timing on a machine doing nothing else is not called busy by the ticks' rounding
        mark, start = rl.busy_cpu_seconds(), time.perf_counter()
        while time.perf_counter() - start < 0.03:
            pass
        assert rl.busy_while(mark, start) is None
    monkeypatch.setattr(rl, "others_cpus", lambda before, wall: 1.3)  # another job on both cores
    roofline_path("cpu").unlink(missing_ok=True)
    assert measure_roofline(force=True) == fresh
    assert "other processes kept 1.3 CPUs busy" in capsys.readouterr().err
    assert not roofline_path("cpu").exists()
    monkeypatch.setattr(rl, "others_cpus", lambda before, wall: 0.1)
    assert measure_roofline(force=True) == fresh and load_roofline(roofline_path("cpu")) == fresh


@pytest.mark.parametrize("change, note", [({"bandwidth_gbs": 1e300}, "must be at most 1e+06"),
                                          ({"peak_tflops": {"bf16": 1e9, "fp32": 1.0}}, "must be at most"),
                                          ({"threads": 0}, "must be a positive int"),
                                          ({"timestamp": None}, "its fields are not a roofline's"),
                                          ({"extra": 1}, "its fields are not a roofline's")])
def test_an_implausible_or_misshapen_cache_is_measured_again(monkeypatch, capsys, change, note):
    data = {k: v for k, v in {**fake_roofline().to_json(), **change}.items() if v is not None}
    roofline_path("cpu").write_text(json.dumps(data))
    assert load_roofline(roofline_path("cpu")) is None
    assert note in capsys.readouterr().err


def test_unavailable_device_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(QinferError, match="no CUDA GPU; use device='cpu'"):
        measure_roofline("cuda")


def test_plot_writes_a_png(tmp_path):
    points = [
        RooflinePoint("decode bf16", 1.0, 0.01, "decode"),
        RooflinePoint("decode int4", 3.5, 0.04, "decode"),
        RooflinePoint("prefill 512", 300.0, 0.2, "prefill"),
    ]
    for name, pts in (("points.png", points), ("empty.png", [])):
        path = plot_roofline(fake_roofline(), pts, tmp_path / "sub" / name)
        data = path.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_table_and_main(capsys):
    r = fake_roofline()
    text = format_roofline(r)
    assert "20.0 GB/s" in text and "0.500 TFLOP/s" in text and "ridge at 25.0 FLOP/byte" in text
    assert f"of fp32 in {r.buffer_pages} pages)" in text
    assert text.startswith(f"roofline of {rl._machine('cpu')} (cpu, ")
    save_roofline(r, roofline_path("cpu"))
    rl.main([])
    assert capsys.readouterr().out.strip() == text


def test_a_cache_of_another_device_is_measured_again(monkeypatch, capsys):
    fresh = fake_roofline(bandwidth_gbs=99.0)
    calls = []
    monkeypatch.setattr(rl, "_measure", lambda device, seconds: calls.append(device) or fresh)
    roofline_path("cpu").write_text(json.dumps({**fake_roofline().to_json(), "device": "cuda"}))
    assert measure_roofline() == fresh and calls == ["cpu"]  # not a look at a GPU torch may not have
    assert "describes device 'cuda', not 'cpu'" in capsys.readouterr().err


def test_a_cache_whose_peaks_and_sizes_name_other_dtypes_is_measured_again(monkeypatch):
    with pytest.raises(QinferError, match="peak_tflops and Roofline.matmul_n must name the same dtypes"):
        fake_roofline(matmul_n={"bf16": 2048})
    fresh = fake_roofline(bandwidth_gbs=99.0)
    monkeypatch.setattr(rl, "_measure", lambda device, seconds: fresh)
    roofline_path("cpu").write_text(json.dumps({**fake_roofline().to_json(), "matmul_n": {"bf16": 2048}}))
    assert load_roofline(roofline_path("cpu")) is None
    assert format_roofline(measure_roofline()) == format_roofline(fresh)


def test_a_folder_where_the_cache_goes_is_refused_before_measuring(monkeypatch, tmp_path):
    monkeypatch.setenv("QINFER_CACHE", str(tmp_path))  # a cache of its own: the folder stays out of the shared one
    calls = []
    monkeypatch.setattr(rl, "_measure", lambda device, seconds: calls.append(device) or fake_roofline())
    roofline_path("cpu").mkdir()
    for force in (False, True):
        with pytest.raises(QinferError, match=r"roofline-cpu\.json is a folder, where the cpu roofline is cached"):
            measure_roofline(force=force)
    assert calls == []
