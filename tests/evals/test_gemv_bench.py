import re

import pytest
from click.testing import CliRunner

from qinfer.evals.diagnostics.gemv_bench import main
from qinfer.kernels import cpu_library

ROW = re.compile(r"^\s*(\S+)\s+(\d+) x (\d+)\s+(\d+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)$", re.M)
STEP = re.compile(r"^decode step \(16-token prompt\): (\S+) ms with PyTorch's kernels, (\S+) ms with the C kernels "
                  r"\((\S+)x; medians of 4 steps each\); greedy tokens (the same|differ)$", re.M)
NORMS = re.compile(r"^decode step with the C GEMVs: (\S+) ms with PyTorch's norm and attention ops, (\S+) ms with "
                   r"the C ones \((\S+)x\)$", re.M)
FUSED = re.compile(r"^decode step with the C kernels: (\S+) ms with q/k/v and gate/up one linear at a time, (\S+) ms "
                   r"fused \((\S+)x\)$", re.M)
VNNI = re.compile(r"^(decode step with the C kernels: (\S+) ms with 4-bit rows through the AVX2 float loop, (\S+) "
                  r"ms through (AVX-VNNI|AVX512-VNNI) \((\S+)x\)|4-bit rows through VNNI: not measured \(no AVX-VNNI "
                  r"or AVX512-VNNI here\))$", re.M)
AMX = re.compile(r"^(decode step with the C kernels: (\S+) ms with bf16 rows through AVX512-BF16, (\S+) ms through "
                 r"AMX-BF16 \((\S+)x\)|bf16 rows through AMX-BF16: not measured \(bf16 rows take .+\))$", re.M)
PAGES = re.compile(r"^(decode step with the C kernels: (\S+) ms with the weights in 4 KiB pages \(the file map\), "
                   r"(\S+) ms in 2 MiB pages \((\S+)x\)|weights in 2 MiB pages: not measured \(.+\))$", re.M)


@pytest.mark.skipif(not cpu_library.available(), reason=f"no C GEMV here: {cpu_library.unavailable_reason()}")
def test_gemv_bench_times_every_linear_and_the_decode_step(tiny):
    result = CliRunner().invoke(main, [str(tiny), "--prompt-tokens", "16", "--steps", "2", "--rounds", "2",
                                       "--calls", "3"])
    assert result.exit_code == 0, result.output
    rows = ROW.findall(result.stdout)
    assert rows and sum(int(r[3]) for r in rows) > 1  # every distinct linear, with how many the model has
    assert all(float(r[4]) > 0 and float(r[5]) > 0 for r in rows)
    step = STEP.search(result.stdout)
    assert step and float(step.group(1)) > 0 and float(step.group(2)) > 0
    norms = NORMS.search(result.stdout)
    assert norms and float(norms.group(1)) > 0 and norms.group(2) == step.group(2)
    fused = FUSED.search(result.stdout)
    assert fused and float(fused.group(1)) > 0 and fused.group(2) == step.group(2)
    vnni = VNNI.search(result.stdout)
    if cpu_library.int4_vnni():
        assert vnni and vnni.group(3) == step.group(2) and vnni.group(4) == cpu_library.int4_vnni()
    else:
        assert vnni and vnni.group(2) is None
    amx = AMX.search(result.stdout)
    if cpu_library.bf16_loop() == "AMX-BF16" and "AVX512-BF16" in cpu_library.bf16_loops():
        assert amx and amx.group(3) == step.group(2) and float(amx.group(2)) > 0
    else:
        assert amx and amx.group(2) is None
    assert PAGES.search(result.stdout)


def test_gemv_bench_names_a_bad_model_in_one_line(tmp_path):
    result = CliRunner().invoke(main, [str(tmp_path / "missing")])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1 and result.output.startswith("Error: ")


@pytest.mark.skipif(not cpu_library.available(), reason=f"no C GEMV here: {cpu_library.unavailable_reason()}")
def test_gemv_bench_refuses_a_long_prompt_before_timing_the_linears(tiny):
    # the tiny model reads 256 positions: 250 + 4 warm-up steps + 1 round of 8 steps do not fit
    result = CliRunner().invoke(main, [str(tiny), "--prompt-tokens", "250", "--rounds", "1", "--calls", "1"])
    assert result.exit_code == 1 and "medians over" not in result.output
    assert len(result.output.strip().splitlines()) == 1, result.output
    assert ("--prompt-tokens 250 with --steps 8, --rounds 1 runs past the model's context of 256 tokens (12 decode "
            "steps follow the prompt, 4 of them warm-up): use --prompt-tokens 244 or fewer") in result.output


ROWS = re.compile(r"^\s*(\S+)\s+(\d+) x (\d+)\s+(\d+)\s+(.+?)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)$", re.M)


@pytest.mark.skipif(not cpu_library.available(), reason=f"no C GEMV here: {cpu_library.unavailable_reason()}")
def test_gemv_bench_rows_times_each_linear_at_each_row_count(tiny):
    result = CliRunner().invoke(main, [str(tiny), "--rows", "1,3", "--rounds", "1", "--calls", "2"])
    assert result.exit_code == 0, result.output
    rows = ROWS.findall(result.stdout)
    assert {int(r[3]) for r in rows} == {1, 3} and all(float(r[5]) > 0 and float(r[6]) > 0 for r in rows)
    assert all(r[4] == "C GEMV" for r in rows if r[3] == "1")  # one row took the C kernel before too
    assert "decode step" not in result.stdout


def test_gemv_bench_refuses_bad_row_counts(tmp_path):
    for bad in ("0,4", "x", ""):
        result = CliRunner().invoke(main, [str(tmp_path / "missing"), "--rows", bad])
        assert result.exit_code == 1 and "--rows takes row counts" in result.output, result.output


LOOPS = re.compile(r"^ *(\d+) x (\d+) +(\d+)((?: +\S+ +\S+)+) +(\S+)$", re.M)


@pytest.mark.skipif(not cpu_library.bf16_loops(), reason="no bf16 dot-product loop here (AMX-BF16, AVX512-BF16)")
def test_gemv_bench_bf16_loops_times_each_loop_side_by_side(tiny):
    result = CliRunner().invoke(main, [str(tiny), "--bf16-loops", "--rows", "1,17", "--rounds", "2", "--calls", "2"])
    assert result.exit_code == 0, result.output
    header = next(line for line in result.stdout.splitlines() if line.strip().startswith("N x K"))
    assert [f"{name} us" in header for name in cpu_library.bf16_loops()] == [True] * len(cpu_library.bf16_loops())
    rows = LOOPS.findall(result.stdout)
    assert {int(r[2]) for r in rows} == {1, 17}
    for r in rows:  # a time and the bytes over it per loop (a tiny weight's: 0.0 GB/s); the ratio of two times,
        # printed to 2 decimals, may show 0.00 when one call of a tiny weight stalls on a loaded machine
        figures = [float(f) for f in r[3].split()]
        assert len(figures) == 2 * len(cpu_library.bf16_loops()) and min(figures[::2]) > 0 and float(r[4]) >= 0
    assert "decode step" not in result.stdout


@pytest.mark.skipif("AMX-INT8" not in cpu_library.int8_loops() or cpu_library.int4_vnni() != "AVX512-VNNI",
                    reason="no AMX-INT8 loop beside AVX512-VNNI here")
def test_gemv_bench_int8_loops_times_both_loops_or_says_there_is_no_8bit_linear(tiny):
    result = CliRunner().invoke(main, [str(tiny), "--int8-loops", "--rows", "1,17", "--rounds", "2", "--calls", "2"])
    assert result.exit_code == 0, result.output
    header = next(line for line in result.stdout.splitlines() if line.strip().startswith("N x K"))
    assert "AMX-INT8 us" in header and "AVX512-VNNI us" in header
    rows = LOOPS.findall(result.stdout)
    assert rows or "no 8-bit tiled linears in" in result.stdout
    for r in rows:
        assert len(r[3].split()) == 4 and int(r[2]) in (1, 17)
    assert "decode step" not in result.stdout
