import dataclasses
import errno
import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from qinfer.store.paths import cache_dir
from qinfer.errors import QinferError
from qinfer.evals import result_cache, runner
from qinfer.evals import roofline as rl
from qinfer.evals.forward import eval_device
from qinfer.evals.report import SCHEMA_VERSION, format_table
from qinfer.evals.runner import EvalConfig, ModelResult, run_eval
from qinfer.kernels import cpu_library
from qinfer.kernels.dense import native_half_gemm
from qinfer.model.loader import huge_pages_reason, weight_pages
from tests.conftest import qinfer_imports
from tests.evals.eval_fixtures import install_roofline, install_tasks, text_file, tiny_model

SMALL = dict(window=64, stride=32, max_tokens=300, tasks=(), speed=False, out=None, progress=False)
SPEED = dict(speed=True, prompt_tokens=24, decode_steps=3, repeats=2)


@pytest.fixture
def env(tmp_path, monkeypatch):
    """A fresh cache per test (the session-wide one would leak cached results between tests)."""
    monkeypatch.setenv("QINFER_CACHE", str(tmp_path / "cache"))
    model = tiny_model(tmp_path / "m")
    return {"model": str(model), "text": str(text_file(tmp_path / "text.txt")), "root": tmp_path}


@pytest.fixture
def count_loads(monkeypatch):
    calls = []
    real = runner.load_model

    def counting(folder, *args, **kwargs):
        calls.append(folder)
        return real(folder, *args, **kwargs)

    monkeypatch.setattr(runner, "load_model", counting)
    return calls


def _perturbed_copy(src, dst):
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name] = (tensors[name].float() + 0.05 * torch.randn(tensors[name].shape)).to(tensors[name].dtype)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_a_model_against_itself_has_zero_kl_and_full_agreement(env):
    copy = shutil.copytree(env["model"], env["root"] / "copy")
    base, twin = run_eval(EvalConfig(models=(env["model"], str(copy)), text=env["text"], **SMALL))
    assert base.is_baseline and not twin.is_baseline
    for r in (base, twin):
        assert r.text.kl == 0.0 and r.text.top1_agreement == 1.0
    assert twin.text.ppl == base.text.ppl and base.text.tokens == 299


def test_a_perturbed_model_has_positive_kl(env):
    other = _perturbed_copy(env["model"], env["root"] / "other")
    base, r = run_eval(EvalConfig(models=(env["model"], str(other)), text=env["text"], **SMALL))
    assert r.text.kl > 1e-4 and r.text.ppl != base.text.ppl
    assert 0.0 <= r.text.top1_agreement <= 1.0
    assert r.text.ppl_ratio == pytest.approx(r.text.ppl / base.text.ppl, rel=1e-9)
    assert r.text.nll_delta_se > 0 and r.text.kl_se > 0 and base.text.nll_delta_se == 0.0
    se = 100 * r.text.ppl_ratio * r.text.nll_delta_se  # the table's "vs base %" cell: change ± standard error
    (row,) = [line for line in format_table([base, r]).splitlines() if line.startswith("other")]
    assert f"{100 * (r.text.ppl_ratio - 1):+.1f} ±{se:.1f}" in row and f"{r.text.kl:.4f} ±{r.text.kl_se:.4f}" in row


def test_a_quantized_kv_cache_shows_up_as_kl_even_on_the_baseline_weights(env):
    (r,) = run_eval(EvalConfig(models=(env["model"],), text=env["text"], kv_cache="int8", **SMALL))
    assert r.is_baseline and r.text.kl > 0.0


def test_perplexity_and_accuracy_are_identical_across_runs(env):
    install_tasks(("truths", "more_truths"))
    config = EvalConfig(models=(env["model"],), text=env["text"], **{**SMALL, "tasks": ("truths", "more_truths")},
                        limit=5, cache=False)
    first, second = run_eval(config)[0], run_eval(config)[0]
    assert first.text == second.text
    assert first.tasks == second.tasks and first.tasks["truths"].n == 5


def test_the_cache_skips_all_work_and_no_cache_recomputes(env, count_loads, monkeypatch):
    monkeypatch.setattr(runner, "busy_while", lambda busy, start: None)  # an idle machine, whatever else runs here
    install_tasks()
    install_roofline()
    config = EvalConfig(models=(env["model"],), text=env["text"], **{**SMALL, **SPEED, "tasks": ("truths",)})
    first = run_eval(config)
    assert len(count_loads) == 2  # measured: loaded for the text, then once for its tasks and speed together
    count_loads.clear()
    again = run_eval(config)
    assert count_loads == []  # everything came from the cache, nothing was loaded or run
    assert again == first
    more = run_eval(dataclasses.replace(config, limit=3))  # another setting is another key
    assert count_loads and more[0].tasks["truths"].n == 3 and more[0].text == first[0].text
    count_loads.clear()
    run_eval(dataclasses.replace(config, cache=False))
    assert count_loads


def test_speeds_measured_beside_other_work_are_shown_but_not_cached(env, count_loads, monkeypatch, capsys):
    monkeypatch.setattr(runner, "busy_while", lambda busy, start: 1.5)
    install_roofline()
    config = EvalConfig(models=(env["model"],), text=env["text"], **{**SMALL, **SPEED})
    (first,) = run_eval(config)
    assert first.speed is not None and "1.5 CPUs busy" in capsys.readouterr().err
    count_loads.clear()
    run_eval(config)
    assert count_loads  # timed again: the slowed speed was not kept



def test_speeds_measured_on_a_busy_machine_are_shown_but_not_cached(env, count_loads, monkeypatch, capsys):
    import qinfer.evals.roofline as rl

    install_roofline()
    config = EvalConfig(models=(env["model"],), text=env["text"], **{**SMALL, **SPEED})
    monkeypatch.setattr(rl, "others_cpus", lambda before, wall: 1.4)  # another job on both cores
    first = run_eval(config)
    assert first[0].speed is not None and "kept 1.4 CPUs busy while the speeds were measured" in capsys.readouterr().err
    count_loads.clear()
    monkeypatch.setattr(rl, "others_cpus", lambda before, wall: 0.0)
    run_eval(config)
    assert count_loads  # timed again: nothing was cached
    count_loads.clear()
    run_eval(config)
    assert count_loads == []  # an idle machine's speeds are


def test_the_runtime_fingerprint_reads_every_module_the_runtime_imports():
    """A fix in a module the decoder imports (the architecture table: attention scale, sliding windows) must not
    leave cached numbers of the old code in use."""
    runtime = {m for m in qinfer_imports(result_cache.RUNTIME_MODULES) if not m.startswith("qinfer.kernels")}
    ground = {m for m in runtime if m == "qinfer.errors" or m.startswith("qinfer.store.")}  # errors and file writing
    assert runtime - ground <= set(result_cache.RUNTIME_MODULES)


def test_a_runtime_code_change_is_a_cache_miss(env, count_loads, monkeypatch):
    monkeypatch.setattr(runner, "busy_while", lambda before, start: None)  # speeds cached even on a busy machine
    install_tasks()
    install_roofline()
    config = EvalConfig(models=(env["model"],), text=env["text"], **{**SMALL, **SPEED, "tasks": ("truths",)})
    assert len(result_cache.code_fingerprint()) == 64
    fingerprint = result_cache.speed_fingerprint.__wrapped__  # (cached per process: the environment is fixed)
    with_kernels = fingerprint()
    monkeypatch.setenv("QINFER_HUGE_PAGES", "0")  # the weights in other pages, or other decode kernels
    assert fingerprint() != with_kernels
    monkeypatch.delenv("QINFER_HUGE_PAGES")
    code, compiled = result_cache.code_fingerprint(), cpu_library.available()  # (inside disabled() it is False)
    with cpu_library.disabled():
        assert fingerprint() != with_kernels or not compiled
        # PyTorch's one-row kernels sum in another order: text and task numbers are measured again too
        assert result_cache.code_fingerprint() != code or not compiled
    run_eval(config)
    count_loads.clear()
    run_eval(config)
    assert count_loads == []  # same code: cached
    monkeypatch.setattr(result_cache, "code_fingerprint", lambda: "another kernel")
    run_eval(config)
    assert count_loads  # measured again, not read from the old code's cache
    count_loads.clear()
    timed = []
    monkeypatch.setattr(runner, "measure_speeds", lambda models, *a, **k: timed.append(len(models)) or [])
    monkeypatch.setattr(result_cache, "speed_fingerprint", lambda: "another way of timing")
    run_eval(config)
    assert timed == [1]  # a change to how speed is timed measures the speed again
    # a change to how tasks are scored (qinfer.evals.tasks, ...) scores the tasks again, and only them
    calls = []

    def counted(name, real):
        return lambda *a, **k: calls.append(name) or real(*a, **k)

    monkeypatch.setattr(runner, "task_accuracy", counted("task", runner.task_accuracy))
    monkeypatch.setattr(runner, "text_metrics", counted("text", runner.text_metrics))
    measure = result_cache.measure_fingerprint
    monkeypatch.setattr(result_cache, "measure_fingerprint", lambda part: "other" if part == "task" else measure(part))
    run_eval(config)
    assert calls == ["task"]


def test_cached_results_of_the_wrong_shape_are_measured_again(env, count_loads):
    """A cached part that parses but is not the record (fields missing, of the wrong type, unknown) is a miss."""
    install_tasks()
    install_roofline()
    config = EvalConfig(models=(env["model"],), text=env["text"], **{**SMALL, **SPEED, "tasks": ("truths",)})
    first = run_eval(config)
    files = sorted((cache_dir() / "eval").rglob("*.json"))
    assert {f.parent.name for f in files} == {"text", "task", "speed"}
    for bad in ("{}", None, "extra"):
        for f in files:
            value = json.loads(f.read_text())
            if bad is None:  # every field a string
                value = {k: "abc" for k in value}
            elif bad == "extra":
                value["unknown"] = 1
            f.write_text(bad if bad == "{}" else json.dumps(value))
        count_loads.clear()
        again = run_eval(config)
        assert count_loads and again[0].text == first[0].text and again[0].tasks == first[0].tasks


def test_results_json_follows_the_documented_schema(env):
    install_tasks()
    roofline = install_roofline()
    out = env["root"] / "out"
    config = EvalConfig(models=(env["model"],), text=env["text"],
                        **{**SMALL, **SPEED, "tasks": ("truths",), "out": out})
    (result,) = run_eval(config)
    data = json.loads((out / "results.json").read_text())
    assert data["schema_version"] == SCHEMA_VERSION == 1
    assert set(data) == {"schema_version", "created", "qinfer_version", "settings", "roofline", "models"}
    assert set(data["settings"]) == {
        "models", "baseline", "baseline_kv_cache", "text", "text_description", "max_tokens", "window", "stride",
        "tasks", "limit", "missing_tasks", "speed", "kv_cache", "prompt_tokens", "decode_steps", "repeats",
        "compiled", "device", "threads", "torch_version", "decode_kernels", "weight_pages",
    }
    assert data["settings"]["missing_tasks"] == {}
    assert data["settings"]["models"] == [env["model"]] and data["settings"]["window"] == 64
    assert data["roofline"] == roofline.to_json()
    (m,) = data["models"]
    assert set(m) == {"label", "spec", "path", "content_key", "is_baseline", "size_bytes", "effective_bits", "text",
                      "tasks", "speed", "missing_tasks"}
    assert set(m["text"]) == {"ppl", "nll", "kl", "top1_agreement", "tokens", "window", "stride", "nll_delta",
                              "nll_delta_se", "kl_se"}
    assert set(m["tasks"]["truths"]) == {"accuracy", "accuracy_norm", "n", "accuracy_se", "accuracy_norm_se"}
    truths = result.tasks["truths"]
    assert truths.n >= 2 and truths.accuracy_se > 0  # the table's "acc %" cell: the mean ± its standard error
    (row,) = [line for line in format_table([result]).splitlines() if line.startswith("m (baseline)")]
    assert f"{100 * truths.accuracy:.1f} ±{100 * truths.accuracy_se:.1f}" in row
    assert "multiple_choice_grade" in (out / "results.md").read_text()
    assert set(m["speed"]) == {
        "prompt_tokens", "decode_steps", "repeats", "kv_cache", "compute_dtype", "ttft_s", "prefill_tok_s", "tpot_s",
        "decode_tok_s", "decode_context", "decode_bytes", "decode_flops", "prefill_bytes", "prefill_flops", "mbu",
        "mfu_prefill", "threads", "prefill_flops_by_dtype", "compile_s", "compiled_tpot_s", "compiled_decode_tok_s",
        "compiled_mbu",
    }
    assert m["speed"]["compiled_tpot_s"] is None and "compiled tok/s" not in format_table([result])  # not asked for
    assert m["effective_bits"] == 16.0 and m["speed"]["prompt_tokens"] == 24
    # a bf16 model's linears multiply in bf16, or in fp32 on a CPU without native bf16 GEMMs (qinfer.kernels.dense)
    by_dtype = m["speed"]["prefill_flops_by_dtype"]
    assert set(by_dtype) == ({"bf16"} if native_half_gemm(torch.bfloat16) else {"bf16", "fp32"})
    assert sum(by_dtype.values()) == m["speed"]["prefill_flops"]
    assert m["speed"]["compute_dtype"] == max(by_dtype, key=by_dtype.get)
    assert ModelResult.from_json(m) == result  # the JSON holds the whole result
    assert (out / "results.md").read_text().count("| m (baseline) |") == 1
    assert f"Roofline: {roofline.machine}, " in (out / "results.md").read_text()  # the machine, not only its name
    kernels = data["settings"]["decode_kernels"]
    assert kernels == cpu_library.describe()
    assert kernels.startswith(("qinfer's C GEMVs", "PyTorch's one-row kernels ("))
    assert data["settings"]["weight_pages"] == weight_pages() in ("2 MiB pages", f"4 KiB pages ({huge_pages_reason()})")
    assert f"decode rows through {kernels}, weights in {weight_pages()}." in (out / "results.md").read_text()
    for png in ("pareto.png", "roofline.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "m (baseline)" in format_table([result])


def test_unknown_task_is_a_clear_error_before_any_work(env, count_loads):
    install_tasks()
    with pytest.raises(QinferError, match="unknown BIG-bench task 'nope'"):
        run_eval(EvalConfig(models=(env["model"],), text=env["text"], **{**SMALL, "tasks": ("nope",)}))
    assert count_loads == []


def test_a_folder_where_the_roofline_cache_goes_is_refused_before_any_work(env, count_loads):
    rl.roofline_path(eval_device()).mkdir()
    with pytest.raises(QinferError, match="is a folder, where the .* roofline is cached"):
        run_eval(EvalConfig(models=(env["model"],), text=env["text"], **{**SMALL, **SPEED}))
    assert count_loads == []


def test_missing_model_is_a_clear_error(env):
    with pytest.raises(QinferError, match="no such file or folder"):
        run_eval(EvalConfig(models=(env["model"], "./no/such/model"), text=env["text"], **SMALL))


def test_a_ctrl_c_while_the_results_move_in_waits_until_all_of_them_have(env, monkeypatch):
    # results.json from this run beside results.md from the last would be two runs' files passed off as one
    import signal

    from qinfer.evals import report

    out = env["root"] / "out"
    config = EvalConfig(models=(env["model"],), text=env["text"], **{**SMALL, "out": str(out)})
    run_eval(config)
    replace, moved = os.replace, []

    def replace_then_ctrl_c(src, dst):
        replace(src, dst)
        moved.append(dst)
        if len(moved) == 1:
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(report.os, "replace", replace_then_ctrl_c)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            run_eval(config)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert sorted(Path(p).name for p in moved) == sorted(p.name for p in out.iterdir())  # all of them moved


def test_a_full_disk_names_the_output_folder_and_leaves_no_results(env, monkeypatch):
    # a write() that meets a full disk names no file; the one-line error would say "while writing output"
    from qinfer.evals import plots

    def full(results, text_description, path):
        path.write_bytes(b"\x89PNG")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(plots, "plot_pareto", full)
    out = env["root"] / "out"
    with pytest.raises(OSError) as e:
        run_eval(EvalConfig(models=(env["model"],), text=env["text"], **{**SMALL, "out": str(out)}))
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(out)
    assert list(out.iterdir()) == []  # neither results.json nor the temp folder


def test_a_cache_that_cannot_be_written_is_said_once_and_the_results_still_reach_out(env, monkeypatch, capsys):
    # a read-only shared cache: its folders exist, so only the first store meets it, after the measurements
    def read_only(path, data):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path) + ".tmp-1-x")

    monkeypatch.setattr(result_cache, "write_atomic", read_only)
    out = env["root"] / "out"
    results = run_eval(EvalConfig(models=(env["model"], env["model"]), text=env["text"], **{**SMALL, "out": str(out)}))
    assert len(results) == 2 and json.loads((out / "results.json").read_text())["models"]
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note: results not cached")]
    assert notes == [f"note: results not cached: {env['root'] / 'cache' / 'eval'}: Read-only file system; set "
                     "QINFER_CACHE to a folder you can write to, to keep them"]


def test_text_too_short_for_one_window_is_a_clear_error(env):
    short = env["root"] / "short.txt"
    short.write_text("It is a truth.")
    with pytest.raises(QinferError, match="fewer than one window of 64"):
        run_eval(EvalConfig(models=(env["model"],), text=str(short), **SMALL))


@pytest.mark.parametrize("change, message", [
    (dict(window=256, stride=128, max_tokens=1024), "--window 256 and the BOS before it is longer than m's context of 256"),
    ({**SPEED, "prompt_tokens": 250, "decode_steps": 16}, "250-token prompt and 16 decode steps exceed m's context"),
])
def test_windows_and_speed_runs_past_the_context_are_refused_before_any_work(env, count_loads, change, message):
    # the tiny model reads 256 positions; a window needs one more for the BOS in front of it
    with pytest.raises(QinferError, match=message):
        run_eval(EvalConfig(models=(env["model"],), text=env["text"], **{**SMALL, **change}))
    assert count_loads == []


@pytest.mark.parametrize("change, message", [
    (dict(models=()), "at least one MODEL"),
    (dict(kv_cache="int4"), "--kv-cache"),
    (dict(stride=100), "--stride"),
    (dict(max_tokens=10), "--max-tokens"),
    (dict(repeats=0), "repeats"),
    (dict(window=0, stride=0), "--window must be at least 2 tokens; got 0"),
    (dict(compiled=True), "drop --no-speed, or --compile"),
])
def test_config_is_validated(change, message):
    with pytest.raises(QinferError, match=message):
        EvalConfig(**{"models": ("m",), **SMALL, **change})


def test_a_task_named_twice_is_run_once():
    assert EvalConfig(**{"models": ("m",), **SMALL, "tasks": ("b", "a", "b")}).tasks == ("b", "a")


def test_an_imported_model_is_labelled_by_the_folder_given(env):
    from qinfer.format import QuantScheme
    from qinfer.interop.folders import export_folder
    from qinfer.pipeline.config import CalibConfig
    from qinfer.pipeline.quantize import quantize_model

    quantize_model(env["model"], env["root"] / "q", QuantScheme(method="rtn", group_size=32), CalibConfig())
    export_folder(env["root"] / "q", env["root"] / "q-ct", "compressed-tensors")
    _, native, imported = run_eval(EvalConfig(
        models=(env["model"], str(env["root"] / "q"), str(env["root"] / "q-ct") + "/"), text=env["text"], **SMALL))
    assert (native.label, imported.label) == ("q", "q-ct")  # not the converted copy's cache folder
    assert imported.text.kl == native.text.kl  # the same weights, read back exactly


@pytest.mark.parametrize("memory, rounds_together", [(1 << 40, True), (1, False), (None, False)])
def test_speeds_are_measured_in_rounds_when_the_models_fit_together(env, monkeypatch, memory, rounds_together):
    from qinfer.evals import speed

    install_roofline()
    other = _perturbed_copy(env["model"], env["root"] / "other")
    monkeypatch.setattr(runner, "available_memory", lambda: memory)
    order, real = [], speed._run

    def recording(model, prompt, steps, kv_dtype):
        order.append(id(model))
        return real(model, prompt, steps, kv_dtype)

    monkeypatch.setattr(speed, "_run", recording)
    results = run_eval(EvalConfig(models=(env["model"], str(other)), text=env["text"], **{**SMALL, **SPEED}))
    a, b = order[0], order[-1]
    assert a != b and len(order) == 2 * (1 + SPEED["repeats"])  # a warm-up and the runs, each model
    if rounds_together:  # warm-ups, then one run of each per round
        assert order == [a, b] + [a, b] * SPEED["repeats"]
    else:  # memory for one model at a time (or unknown): each model's runs together, as before
        assert order == [a] * (1 + SPEED["repeats"]) + [b] * (1 + SPEED["repeats"])
    for r in results:
        assert r.speed.repeats == SPEED["repeats"] and r.speed.tpot_s > 0 and r.speed.decode_bytes > 0


def test_compiled_decode_is_timed_beside_the_eager_one(env, monkeypatch):
    from qinfer.evals import speed

    install_roofline()
    out = env["root"] / "out"
    calls, real = [], speed._run

    def recording(model, prompt, steps, kv_dtype, compiled=None, compiled_first=False):
        calls.append((prompt.shape[1], compiled is not None, compiled_first))
        return real(model, prompt, steps, kv_dtype, compiled, compiled_first)

    monkeypatch.setattr(speed, "_run", recording)
    (result,) = run_eval(EvalConfig(models=(env["model"],), text=env["text"],
                                    **{**SMALL, **SPEED, "repeats": 3, "compiled": True, "out": out}))
    # the eager warm-up, the compiling warm-up at the timed positions, then every run times both, alternating which
    # goes first
    assert calls == [(16, False, False), (24, True, False), (24, True, False), (24, True, True), (24, True, False)]
    s = result.speed
    assert s.compile_s > 0 and s.compiled_tpot_s > 0 and s.compiled_decode_tok_s == pytest.approx(1 / s.compiled_tpot_s)
    assert s.compiled_mbu == pytest.approx(s.mbu * s.tpot_s / s.compiled_tpot_s)  # the same bytes a step
    table = format_table([result])
    assert "compiled tok/s" in table and f"{s.compiled_decode_tok_s:.2f}" in table
    assert "through torch.compile" in (out / "results.md").read_text()
    from qinfer.evals.plots import roofline_points

    assert [p.kind for p in roofline_points([result])] == ["decode", "compiled decode", "prefill"]  # roofline.png
    assert json.loads((out / "results.json").read_text())["settings"]["compiled"] is True
    # cached apart from an eager-only measurement: this one does not stand in for it, nor it for this one
    calls.clear()
    (eager,) = run_eval(EvalConfig(models=(env["model"],), text=env["text"], **{**SMALL, **SPEED, "repeats": 3}))
    assert eager.speed.compiled_tpot_s is None and calls and not any(c[1] for c in calls)


def test_a_failing_compile_is_one_clear_error(env, monkeypatch):
    from qinfer.evals import speed

    def broken(*args):
        raise RuntimeError("no C++ compiler found\nthe rest of a long message")

    install_roofline()
    monkeypatch.setattr(speed, "compiled_decode_step", lambda: broken)
    with pytest.raises(QinferError, match=r"^--compile: torch.compile failed \(RuntimeError: no C\+\+ compiler found\); "
                                          r"measure without --compile$"):
        run_eval(EvalConfig(models=(env["model"],), text=env["text"], **{**SMALL, **SPEED, "compiled": True}))


def test_a_compile_during_the_timed_runs_is_an_error_not_a_timing(env, monkeypatch):
    from torch._dynamo.utils import counters

    from qinfer.evals import speed

    install_roofline()
    real = speed._run

    def recompiling(model, prompt, steps, kv_dtype, compiled=None, compiled_first=False):
        out = real(model, prompt, steps, kv_dtype, compiled, compiled_first)
        if compiled is not None and prompt.shape[1] == SPEED["prompt_tokens"]:
            counters["stats"]["unique_graphs"] += 1  # as a recompile (another position, shape or model) counts
        return out

    monkeypatch.setattr(speed, "_run", recompiling)
    with pytest.raises(QinferError, match="compiled again during the timed runs"):
        run_eval(EvalConfig(models=(env["model"],), text=env["text"], **{**SMALL, **SPEED, "compiled": True}))


def test_windows_start_with_the_bos_the_tokenizer_starts_text_with(env, monkeypatch):
    # as llama.cpp's perplexity: a tokenizer with add_bos_token false (SmolLM2, Qwen) puts none before text, so
    # none goes before a window, though config.json names a BOS id
    plain = shutil.copytree(env["model"], env["root"] / "plain")
    config = json.loads((plain / "tokenizer_config.json").read_text())
    (plain / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": False}))
    leads = []
    real = runner.window_logits
    monkeypatch.setattr(runner, "window_logits", lambda model, kv, bos: leads.append(bos) or real(model, kv, bos))
    (with_bos,) = run_eval(EvalConfig(models=(env["model"],), text=env["text"], **SMALL))
    (without,) = run_eval(EvalConfig(models=(str(plain),), text=env["text"], **SMALL))
    assert leads[0] is not None and leads[1:] == [None]
    assert without.text.ppl != with_bos.text.ppl and without.text.tokens == with_bos.text.tokens


def test_a_model_producing_nan_is_reported_as_nan_and_results_json_stays_strict(env):
    install_tasks(("truths",))
    broken = shutil.copytree(env["model"], env["root"] / "broken")
    tensors = load_file(str(broken / "model.safetensors"))
    tensors["model.layers.0.mlp.down_proj.weight"][0, 0] = float("nan")
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    out = env["root"] / "out"
    base, r = run_eval(EvalConfig(models=(env["model"], str(broken)), text=env["text"],
                                  **{**SMALL, "tasks": ("truths",), "out": out}))
    assert math.isnan(r.text.ppl) and math.isnan(r.tasks["truths"].accuracy)
    assert not math.isnan(base.tasks["truths"].accuracy)  # the other model's results are all there
    data = json.loads((out / "results.json").read_text(), parse_constant=lambda name: pytest.fail(name))
    broken_json = data["models"][1]
    assert broken_json["text"]["ppl"] is None and broken_json["tasks"]["truths"]["accuracy"] is None
    (row,) = [line for line in format_table([base, r]).splitlines() if line.startswith("broken")]
    assert "nan" in row
    again = run_eval(EvalConfig(models=(str(broken),), baseline=env["model"], text=env["text"],
                                **{**SMALL, "tasks": ("truths",)}))[0]  # from the cache: still NaN, not an error
    assert math.isnan(again.text.ppl) and math.isnan(again.tasks["truths"].accuracy)


def test_a_model_with_another_vocabulary_size_is_refused_before_any_work(env, count_loads):
    # one tokenizer, the embedding padded to another size (as Qwen2.5's sizes differ): KL needs equal vocabularies
    padded = shutil.copytree(env["model"], env["root"] / "padded")
    tensors = load_file(str(padded / "model.safetensors"))
    embed = tensors["model.embed_tokens.weight"]
    tensors["model.embed_tokens.weight"] = torch.cat([embed, torch.zeros(64, embed.shape[1], dtype=embed.dtype)])
    save_file(tensors, str(padded / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((padded / "config.json").read_text())
    (padded / "config.json").write_text(json.dumps({**config, "vocab_size": config["vocab_size"] + 64}))
    with pytest.raises(QinferError, match=f"padded has {config['vocab_size'] + 64} tokens .* the baseline m "
                                          f"{config['vocab_size']}: KL and agreement need the same vocabulary"):
        run_eval(EvalConfig(models=(env["model"], str(padded)), text=env["text"], **SMALL))
    assert count_loads == []


def test_the_mean_accuracy_over_tasks_carries_their_standard_errors():
    from qinfer.evals.report import _acc
    from qinfer.evals.tasks import MCResult

    a = MCResult(accuracy=0.5, accuracy_norm=0.5, n=10, accuracy_se=0.1, accuracy_norm_se=0.2)
    b = MCResult(accuracy=0.3, accuracy_norm=0.1, n=1, accuracy_se=float("nan"), accuracy_norm_se=float("nan"))
    c = MCResult(accuracy=0.3, accuracy_norm=0.1, n=10, accuracy_se=0.05, accuracy_norm_se=0.0)
    assert _acc([a, c], "accuracy") == "40.0 ±5.6"  # sqrt(0.1^2 + 0.05^2) / 2 = 0.0559: tasks independent
    assert _acc([a, c], "accuracy_norm") == "30.0 ±10.0"
    assert _acc([a, b], "accuracy") == "40.0"  # a task of one example has no spread: no ± for the mean
    assert _acc([], "accuracy") == "-"
