"""Bad input gets one clear line and a non-zero exit, never a traceback (run as a user would)."""

import json
import os
import subprocess
import sys

import pytest

from tests.tiny_models import make_model


def run_qinfer(*args, env=None, timeout=300, cwd=None):
    env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "qinfer", *args], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=cwd)


def assert_one_line_error(proc, *needles):
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("Error:")]
    assert len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_missing_path():
    assert_one_line_error(run_qinfer("generate", "./no/such/model", "hi"), "no such file or folder", "gemma3-270m")


def test_the_cli_module_runs_as_a_script_too():
    # `python -m qinfer.cli` ran nothing and exited 0; it is the same command line as `python -m qinfer`
    def run(*args):
        return subprocess.run([sys.executable, "-m", "qinfer.cli", *args], capture_output=True, text=True, timeout=300)

    assert_one_line_error(run("generate", "./no/such/model", "hi"), "no such file or folder")
    help_text = run("--help")
    assert help_text.returncode == 0 and "quantize" in help_text.stdout


def test_an_empty_model_is_named_not_read_as_the_working_directory():
    assert_one_line_error(run_qinfer("generate", "", "hi"), "the model is '', empty", "gemma3-270m")


def test_unknown_builtin():
    assert_one_line_error(run_qinfer("generate", "gemma9-1t", "hi"), "unknown model 'gemma9-1t'", "gemma3-270m")
    assert_one_line_error(run_qinfer("pull", "gemma9-1t"), "unknown built-in model")


def test_folder_without_config(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert_one_line_error(run_qinfer("generate", str(tmp_path), "hi"), "no config.json")


def test_truncated_safetensors(tmp_path):
    make_model("llama", tmp_path)
    weights = tmp_path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    assert_one_line_error(run_qinfer("generate", str(tmp_path), "hi"), "truncated")


@pytest.mark.parametrize("edit", ["no data_offsets", "offsets past the shape", "a string shape"])
def test_a_safetensors_header_that_does_not_describe_its_tensors_is_one_line(tmp_path, edit):
    make_model("llama", tmp_path)
    weights = tmp_path / "model.safetensors"
    data = weights.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    info = header["model.norm.weight"]
    if edit == "no data_offsets":
        info["offsets"] = info.pop("data_offsets")
    elif edit == "offsets past the shape":
        info["data_offsets"][1] += 4
    else:
        info["shape"] = ["64"]
    text = json.dumps(header).encode()
    text += b" " * (n - len(text))  # the same length, so every tensor stays where it was
    weights.write_bytes(data[:8] + text + data[8 + n :])
    assert_one_line_error(run_qinfer("generate", str(tmp_path), "hi"), "model.safetensors has a corrupt safetensors header")


def test_text_that_is_not_utf8_is_one_line(tmp_path):
    make_model("llama", tmp_path)
    proc = subprocess.run([sys.executable, "-m", "qinfer", "generate", str(tmp_path), b"Hello \xff world"],
                          capture_output=True, text=True, timeout=300)
    assert_one_line_error(proc, "not valid UTF-8 (byte 0xff at character 6)")
    chat = subprocess.run([sys.executable, "-m", "qinfer", "chat", str(tmp_path), "--max-tokens", "3"],
                          input=b"Hi \xfe\nhello\n", capture_output=True, timeout=300)
    replies = chat.stdout.decode().strip().splitlines()
    assert chat.returncode == 0 and len(replies) == 2 and "UTF-8" not in replies[1]
    assert "byte 0xfe at character 3" in replies[0]  # where in the line typed
    proc = subprocess.run([sys.executable, "-m", "qinfer", "chat", str(tmp_path), "--system", b"be \xff"],
                          input="hi\n", capture_output=True, text=True, timeout=300)
    assert_one_line_error(proc, "--system: the text is not valid UTF-8")


def test_unsupported_architecture(tmp_path):
    make_model("llama", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["model_type"] = "mamba"
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert_one_line_error(run_qinfer("generate", str(tmp_path), "hi"), "unsupported architecture 'mamba'")


def test_config_without_model_type(tmp_path):
    make_model("llama", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["model_type"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert_one_line_error(run_qinfer("generate", str(tmp_path), "hi"), "config.json has no model_type")


def test_config_that_is_not_json(tmp_path):
    make_model("llama", tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "llama",\n "hidden_size": }')
    assert_one_line_error(run_qinfer("generate", str(tmp_path), "hi"), "config.json is not valid JSON",
                          "at line 2", "copy the model's config.json again")


def test_config_that_is_a_folder(tmp_path):
    make_model("llama", tmp_path)
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").mkdir()
    for command in (("generate", str(tmp_path), "hi"), ("quantize", str(tmp_path), "-o", str(tmp_path / "q"))):
        assert_one_line_error(run_qinfer(*command), "config.json cannot be read (Is a directory)",
                              "make it a readable file")


def test_no_network_while_pulling(tmp_path):
    # pip pointed at nothing stands in for a machine without network.
    env = {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(tmp_path), "PIP_EXTRA_INDEX_URL": "", "PIP_CONSTRAINT": "",
           "QINFER_CACHE": str(tmp_path / "cache")}  # an empty cache: nothing pulled before by another test
    assert_one_line_error(run_qinfer("pull", "smollm2-135m-instruct", env=env), "could not download")


@pytest.mark.parametrize("args", [["--max-tokens", "0"], ["--top-p", "1.5"], ["--top-p", "nan"], ["--temperature", "-1"],
                                  ["--temperature", "nan"], ["--temperature", "inf"], ["--seed", str(2**64)]])
def test_bad_sampling_options(args):
    assert_one_line_error(run_qinfer("generate", "gemma3-270m", "hi", *args))


@pytest.mark.parametrize("method", ["gptq", "awq", "rtn"])
def test_group_size_that_does_not_divide_a_linear(tmp_path, method):
    # the tiny llama's down_proj reads 96 channels: groups of 64 do not fit, groups of 32 do
    make_model("llama", tmp_path / "src")
    proc = run_qinfer("quantize", str(tmp_path / "src"), "-o", str(tmp_path / "out"), "--method", method,
                      "--group-size", "64", "--samples", "8", "--seq-len", "32")
    assert_one_line_error(proc, "model.layers.0.mlp.down_proj", "does not divide in_features K=96", "--group-size 32")
    assert "quantizing" not in proc.stderr  # refused before any block is calibrated
    assert not (tmp_path / "out").exists()


def test_out_of_memory_is_one_line(tmp_path, monkeypatch):
    # the allocator's own refusal, raised where quantization would run: one line naming it and what to lower
    import torch
    from click.testing import CliRunner

    import qinfer.pipeline.quantize
    from qinfer.cli.commands import cli

    def allocate_too_much(*args, **kwargs):
        return torch.empty(1 << 50, dtype=torch.uint8)  # 1 PiB

    monkeypatch.setattr(qinfer.pipeline.quantize, "quantize_model", allocate_too_much)
    make_model("llama", tmp_path / "src")
    result = CliRunner().invoke(cli, ["quantize", str(tmp_path / "src"), "-o", str(tmp_path / "out")])
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)  # no traceback: a ClickException
    assert "Error: out of memory (a request for 1048576.0 GiB)" in result.output
    assert "fewer --samples or a shorter --seq-len" in result.output


def test_a_map_the_address_space_limit_refuses_is_out_of_memory(tmp_path, monkeypatch):
    # under ulimit -v (or strict overcommit) mmap fails with ENOMEM, an OSError, not the allocator's RuntimeError
    import errno

    from click.testing import CliRunner

    import qinfer.pipeline.quantize
    from qinfer.cli.commands import cli

    def refuse(*args, **kwargs):
        raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))

    monkeypatch.setattr(qinfer.pipeline.quantize, "quantize_model", refuse)
    make_model("llama", tmp_path / "src")
    result = CliRunner().invoke(cli, ["quantize", str(tmp_path / "src"), "-o", str(tmp_path / "out")])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert result.output.startswith("Error: out of memory: close other programs, or ask for less")


@pytest.mark.parametrize("terminal", [True, False])
def test_ctrl_c_message_starts_its_own_line_at_a_terminal(terminal):
    # a terminal echoes ^C where the cursor is; the Error line must not run on after it
    import io

    from qinfer.cli.command import _Interrupted

    class Stream(io.StringIO):
        def isatty(self):
            return terminal

    stream = Stream()
    _Interrupted("interrupted; nothing half-written was kept").show(stream)
    assert stream.getvalue() == ("\n" if terminal else "") + "Error: interrupted; nothing half-written was kept\n"


@pytest.mark.parametrize("tool", ["block_errors", "block_swap", "decode_profile", "gemv_bench", "prefill_bench",
                                  "text_spread"])
def test_evals_tools_give_the_same_one_line_errors(tool, monkeypatch):
    # the python -m qinfer.evals.* tools share the qinfer command's handling: here the allocator's refusal
    import importlib

    from click.testing import CliRunner

    module = importlib.import_module(f"qinfer.evals.diagnostics.{tool}")

    def refuse(*args, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 2147483648 bytes")

    monkeypatch.setattr(module, "comparison" if tool == "text_spread" else "resolve_model", refuse)
    args = ["a"] if tool in ("decode_profile", "gemv_bench", "prefill_bench") else ["a", "b"]
    result = CliRunner().invoke(module.main, args)
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)  # no traceback: a ClickException
    assert result.output.startswith("Error: out of memory (a request for 2.0 GiB)")
    assert len(result.output.strip().splitlines()) == 1


def test_force_replaces_only_a_model_folder(tmp_path):
    make_model("llama", tmp_path / "src")
    keep = tmp_path / "documents"
    keep.mkdir()
    (keep / "notes.txt").write_text("keep me")
    base = ["quantize", str(tmp_path / "src"), "--method", "rtn", "--group-size", "32", "--force", "-o"]
    assert_one_line_error(run_qinfer(*base, str(keep)), "without a model in it", "choose another -o")
    assert_one_line_error(run_qinfer(*base, str(tmp_path / "src")), "is the model being read")
    assert_one_line_error(run_qinfer(*base, str(keep / "notes.txt" / "out")), "notes.txt is a file, not a folder")
    assert (keep / "notes.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["documents", "src"]
    assert run_qinfer(*base, str(tmp_path / "out")).returncode == 0
    proc = run_qinfer("export", str(tmp_path / "out"), "--format", "gptq", "-o", str(keep), "--force")
    assert_one_line_error(proc, "without a model in it")
    assert run_qinfer(*base, str(tmp_path / "out")).returncode == 0  # a model folder is replaced


def test_cache_that_cannot_be_written(tmp_path):
    # QINFER_CACHE where no folder can be made (under a file): one line naming it and the variable, for a
    # command that writes there (the Austen text for calibration) as for one that only reads a local model
    make_model("llama", tmp_path / "src")
    (tmp_path / "file").write_text("")
    env = {"QINFER_CACHE": str(tmp_path / "file" / "cache")}
    args = ["--group-size", "32", "--samples", "2", "--seq-len", "16", "-o", str(tmp_path / "q")]
    proc = run_qinfer("quantize", str(tmp_path / "src"), *args, env=env)
    assert_one_line_error(proc, "cannot write", "set QINFER_CACHE to a folder you can write to")
    assert not (tmp_path / "q").exists()


@pytest.mark.parametrize("code", ["EROFS", "EACCES"])
def test_unwritable_paths_are_one_line(tmp_path, monkeypatch, code):
    # a read-only file system or a refused permission (which root, running the tests, never meets): the path,
    # the reason and the fix; in the cache, the variable that moves it
    import errno

    from click.testing import CliRunner

    import qinfer.sources.resolve
    from qinfer.cli.commands import cli

    monkeypatch.setenv("QINFER_CACHE", str(tmp_path / "cache"))
    reason = os.strerror(getattr(errno, code))
    for where, fix in ((tmp_path / "cache" / "converted", "set QINFER_CACHE to a folder you can write to"),
                       (tmp_path / "out", "choose a folder you can write to")):
        def refuse(*args, **kwargs):
            raise OSError(getattr(errno, code), reason, str(where))

        monkeypatch.setattr(qinfer.sources.resolve, "resolve_model", refuse)
        result = CliRunner().invoke(cli, ["generate", "anything", "hi"])
        assert result.exit_code == 1, result.output
        assert result.exception is None or isinstance(result.exception, SystemExit)
        assert result.output.strip() == f"Error: cannot write {where}: {reason}; {fix}"


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer.model"])
def test_tokenizer_file_that_cannot_be_read(tmp_path, name):
    # a damaged tokenizer file: one line naming it, from the commands that read it and from quantize (which
    # would copy it into a model no other command could then open), before any output is written
    make_model("llama", tmp_path / "src")
    (tmp_path / "src" / "tokenizer.json").unlink()
    (tmp_path / "src" / name).write_bytes(b"garbage, not a tokenizer\n" * 8)
    needle = f"{name} is not a tokenizer file its library can read"
    assert_one_line_error(run_qinfer("generate", str(tmp_path / "src"), "hi"), needle)
    proc = run_qinfer("quantize", str(tmp_path / "src"), "--method", "rtn", "--group-size", "32", "-o", str(tmp_path / "q"))
    assert_one_line_error(proc, needle)
    assert not (tmp_path / "q").exists()


def test_eval_out_that_cannot_be_written(tmp_path):
    # refused before any model is resolved or measured (a file stands where the folder would go)
    (tmp_path / "file").write_text("")
    proc = run_qinfer("eval", "gemma3-270m", "--tasks", "none", "--no-speed", "--out", str(tmp_path / "file" / "x"))
    assert_one_line_error(proc, "cannot write", "--out")


@pytest.mark.parametrize("options,stored", [
    (("--group-size", "32"), "qweight (packed)"),
    (("--bits", "8", "--format", "fp8"), "weight"),  # FP8 keeps the name .weight (and adds .scale)
])
def test_quantized_folder_missing_a_linear(tmp_path, options, stored):
    from safetensors.torch import load_file, save_file

    make_model("llama", tmp_path / "src")
    assert run_qinfer("quantize", str(tmp_path / "src"), "-o", str(tmp_path / "q"), "--method", "rtn",
                      *options).returncode == 0
    path = tmp_path / "q" / "model.safetensors"
    tensors = {k: t for k, t in load_file(path).items() if not k.startswith("model.layers.1.mlp.down_proj.")}
    save_file(tensors, path)
    assert_one_line_error(run_qinfer("generate", str(tmp_path / "q"), "hi"),
                          f"missing model.layers.1.mlp.down_proj.{stored})")


def test_a_signal_while_torch_is_imported_is_delivered_after_it(monkeypatch):
    # handled inside torch's C++ initialisation, it aborted the process (pybind11's terminate, exit 134)
    import importlib
    import signal

    from qinfer.cli import command

    imported = []

    def importing(name):
        signal.raise_signal(signal.SIGINT)  # Ctrl-C half-way through the import
        imported.append(name)

    monkeypatch.setattr(importlib, "import_module", importing)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # as a command starts (whatever ran before)
    try:
        with pytest.raises(KeyboardInterrupt):
            command._import_torch()
        assert imported == ["torch"]  # the import ran to its end first
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, before)



def test_a_ctrl_c_after_the_command_has_finished_is_no_traceback():
    # a Ctrl-C while the interpreter exits (torch's exit hooks, after quantize printed its summary) gave
    # "Exception ignored in atexit callback ... KeyboardInterrupt", or exit 130 after a success
    probe = ("import atexit, os, signal, sys, time\n"
             "atexit.register(lambda: (os.kill(os.getpid(), signal.SIGINT), time.sleep(0.2), print('exited')))\n"
             "signal.signal(signal.SIGINT, signal.default_int_handler)\n"  # (a CI shell's background jobs ignore it)
             "from qinfer.cli.commands import main\n"
             "sys.argv = ['qinfer', '--version']\n"
             "main()")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("exited"), proc.stdout + proc.stderr
    assert "KeyboardInterrupt" not in proc.stderr, proc.stderr

def test_a_commands_help_does_not_import_torch():
    probe = "import sys; from qinfer.cli.commands import main; sys.argv = ['qinfer', 'generate', '--help']\n" \
            "try:\n    main()\nexcept SystemExit:\n    print('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip().endswith("False"), proc.stdout + proc.stderr
