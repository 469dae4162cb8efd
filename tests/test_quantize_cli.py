"""``qinfer quantize`` run as a user runs it, on tiny models: its options, notes, errors and interruption."""

import json
import signal
import subprocess
import sys
import time

import pytest
import transformers
from safetensors.torch import load_file

from qinfer.format import QuantScheme
from qinfer.model.loader import load_model
from tests.test_cli_errors import assert_one_line_error, run_qinfer
from tests.tiny_models import COMMON, TEXT, make_model, write_tokenizer


def test_same_options_write_the_same_bytes(tiny, tmp_path, calib_file):
    # two processes (safetensors orders several metadata keys per process), the same options and seed: the same
    # files byte for byte, so a checksum verifies a model
    args = ["--group-size", "32", "--calib", str(calib_file), "--samples", "4", "--seq-len", "32", "--seed", "3"]
    for name in ("a", "b"):
        proc = run_qinfer("quantize", str(tiny), "-o", str(tmp_path / name), *args)
        assert proc.returncode == 0, proc.stderr
    for name in ("model.safetensors", "quant_config.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


def test_cli_quantize_then_generate(tiny, tmp_path, calib_file):
    out = tmp_path / "cli"
    proc = run_qinfer("quantize", str(tiny), "-o", str(out), "--bits", "4", "--group-size", "32",
                      "--calib", str(calib_file), "--samples", "8", "--seq-len", "32")
    assert proc.returncode == 0, proc.stderr
    assert "bits per quantized weight" in proc.stdout
    scheme = QuantScheme.load(out)  # the defaults: GPTQ, act-order, asymmetric groups, the clip search
    assert (scheme.method, scheme.act_order, scheme.symmetric, scheme.mse_clip) == ("gptq", True, False, True)
    assert json.loads((out / "quantize_report.json").read_text())["calibration"]["true_sequential"]
    fp8 = run_qinfer("quantize", str(tiny), "-o", str(tmp_path / "fp8"), "--bits", "8", "--format", "fp8",
                     "--calib", str(calib_file), "--samples", "8", "--seq-len", "32")
    assert fp8.returncode == 0, fp8.stderr  # FP8 needs no --sym
    assert (QuantScheme.load(tmp_path / "fp8").format, QuantScheme.load(tmp_path / "fp8").symmetric) == ("fp8", True)
    assert not QuantScheme.load(tmp_path / "fp8").mse_clip  # FP8 keeps each channel's full range
    tuned = run_qinfer("quantize", str(tiny), "-o", str(tmp_path / "tuned"), "--method", "rtn", "--group-size", "32",
                       "--tune-steps", "2", "--tune-batch", "3", "--tune-rounding", "--tune-holdout", "2",
                       "--calib", str(calib_file), "--samples", "8", "--seq-len", "32")
    assert tuned.returncode == 0, tuned.stderr
    assert "held-out check kept step" in tuned.stdout
    saved = json.loads((tmp_path / "tuned" / "quantize_report.json").read_text())
    assert (saved["tuning"]["steps"], saved["tuning"]["batch"], saved["tuning"]["rounding"]) == (2, 3, True)
    assert saved["tuning"]["holdout"] == 2
    layers = load_model(tiny).config.num_layers
    assert len(saved["tune_best_steps"]) == layers and set(saved["tune_best_steps"].values()) <= {0, 1, 2}
    assert all([step for step, _ in checks] == [0, 1, 2] for checks in saved["tune_held_out"].values())
    gen = run_qinfer("generate", str(out), "a single", "--max-tokens", "5")
    assert gen.returncode == 0, gen.stderr
    assert gen.stdout.startswith("a single")
    for folder in (out, tmp_path / "fp8"):  # a quantized folder copied without its quant_config.json
        (folder / "quant_config.json").unlink()
        proc = run_qinfer("generate", str(folder), "a single", "--max-tokens", "5")
        assert_one_line_error(proc, "holds quantized weights", "but no quant_config.json", "copy it back")


@pytest.mark.parametrize("args,mse_clip", [
    (["--no-mse-clip"], False),  # GPTQ as its authors run it
    (["--method", "rtn"], False),  # RTN stays the plain min/max baseline
    (["--method", "rtn", "--mse-clip"], True),
    (["--method", "awq"], False),  # AWQ's own clip search
])
def test_the_clip_search_is_gptqs_default_only(tiny, tmp_path, calib_file, args, mse_clip):
    proc = run_qinfer("quantize", str(tiny), "-o", str(tmp_path / "q"), "--group-size", "32",
                      "--calib", str(calib_file), "--samples", "4", "--seq-len", "32", *args)
    assert proc.returncode == 0, proc.stderr
    assert QuantScheme.load(tmp_path / "q").mse_clip is mse_clip


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--bits", "5"], "bits"),
        (["--seed", str(2**64), "--group-size", "32"], r"--seed must be in [-2**63, 2**64 - 1] (got 18446744073709551616)"),
        (["--group-size", "100"], "group"),
        (["--format", "fp8", "--bits", "4"], "bits (--bits) must be 8"),
        (["--bits", "8", "--format", "fp8", "--method", "awq"], "AWQ produces integer weights"),
        (["--method", "rtn", "--act-order"], "act_order"),
        (["--seq-len", "200", "--calib", "SHORT", "--group-size", "32"], "too short"),
        (["--seq-len", "1000", "--group-size", "32"], "longer than the model's context of 256 tokens"),
        (["--samples", "100000000", "--seq-len", "64", "--group-size", "32"], "GiB of memory is available: lower --samples or --seq-len"),
        (["--samples", "100000000", "--seq-len", "64", "--method", "rtn", "--kv-cache", "int8", "--group-size", "32"], "lower --samples"),
        (["--bits", "8", "--format", "fp8", "--tune-steps", "5"], "FP8 weights have none"),
        (["--tune-steps", "-1"], "--tune-steps >= 0"),
        (["--tune-steps", "2", "--tune-batch", "0"], "--tune-batch >= 1"),
        (["--bits", "8", "--format", "fp8", "--e2e-steps", "5"], "FP8 weights have none"),
        (["--e2e-steps", "-1"], "--e2e-steps >= 0"),
        (["--tune-rounding"], "add --tune-steps"),
        (["--tune-rounding", "--e2e-steps", "2"], "add --tune-steps"),
        (["--tune-holdout", "4"], "add --tune-steps"),
        (["--tune-steps", "2", "--tune-holdout", "8", "--samples", "8"], "leaves none of the 8 calibration samples"),
        (["--bits", "8", "--format", "fp8", "--mse-clip"], "drop --mse-clip"),
        (["--method", "rtn", "--true-sequential"], "drop it for --method rtn"),
        (["--method", "rtn", "--fp-target"], "drop it for --method rtn"),
        (["--method", "rtn", "--bits", "8", "--format", "fp8", "--fp-target"], "drop it for --method rtn --format fp8"),
        (["--fp-target", "--no-true-sequential"], "drop --no-true-sequential"),
        (["--fp-target", "--fp-target-damp", "0"], "--fp-target-damp must be a finite number > 0"),
        (["--fp-target", "--fp-target-damp", "inf"], "--fp-target-damp must be a finite number > 0"),
        (["--tune-steps", "2", "--tune-lr", "inf"], "a finite positive --tune-lr"),
        (["--method", "rtn", "--bits", "8", "--format", "fp8", "--act-order"], "--act-order applies only to --method gptq, not rtn"),
        (["--fp-target-damp", "0.1"], "add --fp-target"),
        (["--bits", "8", "--format", "fp8", "--group-size", "32"], "drop --group-size"),
        (["--bits", "8", "--format", "fp8", "--quantize-lm-head", "--lm-head-bits", "4"], "drop --lm-head-bits"),
        (["--lm-head-bits", "4", "--group-size", "32", "--no-quantize-lm-head"], "drop --no-quantize-lm-head"),
        (["--format", "fp8", "--lm-head-bits", "8"], "add --quantize-lm-head"),  # (fp8 keeps it bf16 by default)
        (["--bits", "8", "--format", "fp8", "--asym"], "drop --asym"),
        (["--method", "awq", "--act-order", "--group-size", "32"], "drop --act-order"),
        (["--method", "awq", "--mse-clip", "--group-size", "32"], "drop --mse-clip for --method awq"),
        (["--tune-lr", "0.5", "--group-size", "32"], "--tune-lr is the rate of the tuning stages"),
        (["--method", "rtn", "--tune-lr", "0.5"], "add --tune-steps N or --e2e-steps N"),
        (["--tune-batch", "3", "--e2e-steps", "2", "--group-size", "32"], "--tune-batch is the block tuning stage's"),
        (["--calib", "", "--group-size", "32"], "--calib is empty: name austen (the default)"),
    ],
)
def test_cli_bad_options(tiny, tmp_path, args, needle):
    short = tmp_path / "short.txt"
    short.write_text("Too short.")
    args = [str(short) if a == "SHORT" else a for a in args]
    proc = run_qinfer("quantize", str(tiny), "-o", str(tmp_path / "out"), *args)
    assert_one_line_error(proc, needle)
    assert not (tmp_path / "out").exists()



@pytest.mark.parametrize("args", [["--method", "rtn", "--fp-target", "--samples", "4"],  # a note: rtn reads no text
                                  ["--bits", "8", "--format", "fp8", "--tune-steps", "1", "--samples", "2"]])  # batch
def test_a_refused_setting_is_the_only_line_not_after_notes_on_it(tiny, tmp_path, args):
    proc = run_qinfer("quantize", str(tiny), "-o", str(tmp_path / "out"), *args)
    assert_one_line_error(proc, "drop")
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr

@pytest.mark.parametrize("command", ["quantize", "export"])
def test_an_empty_output_name_is_refused(tiny, tmp_path, command):
    # not taken for "." (this folder) and refused as one that exists
    extra = ["--format", "gptq"] if command == "export" else []
    assert_one_line_error(run_qinfer(command, str(tiny), "-o", " ", *extra), "--out is empty: name a folder")


def test_without_out_the_model_and_scheme_name_a_folder_here(tiny, tmp_path):
    # `qinfer quantize gemma3-270m --bits 4` as the goal states it: OUT defaults to ./gemma3-270m-gptq-w4g128
    proc = run_qinfer("quantize", str(tiny), "--method", "rtn", "--group-size", "32", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / f"{tiny.name}-rtn-w4g32"
    assert f"wrote {out.name}" in proc.stdout
    assert QuantScheme.load(out) == QuantScheme(method="rtn", bits=4, group_size=32, symmetric=False,
                                                quantize_lm_head=True)  # int8 lm_head, the default
    # run again: the folder is there, refused as any OUT is without --force
    again = run_qinfer("quantize", str(tiny) + "/", "--method", "rtn", "--group-size", "32", cwd=tmp_path)
    assert_one_line_error(again, out.name, "--force")


def test_the_default_folder_names_the_group_size_the_run_used(tiny, tmp_path):
    # the tiny models' linears read 64 and 96 channels: 128 (the default) does not fit, 32 is used and named
    proc = run_qinfer("quantize", str(tiny), "--method", "rtn", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / f"{tiny.name}-rtn-w4g32"
    assert f"wrote {out.name}" in proc.stdout and QuantScheme.load(out).group_size == 32
    # FP8 is 8 bits whatever --bits defaults to: no --bits is not "--bits 4"
    fp8 = run_qinfer("quantize", str(tiny), "--method", "rtn", "--format", "fp8", cwd=tmp_path)
    assert fp8.returncode == 0, fp8.stderr
    assert QuantScheme.load(tmp_path / f"{tiny.name}-fp8").bits == 8
    assert QuantScheme.load(tmp_path / f"{tiny.name}-fp8").quantize_lm_head is False  # (bf16 unless asked)
    # --no-quantize-lm-head keeps an integer model's lm_head (and tied embedding) in bf16
    bf16 = run_qinfer("quantize", str(tiny), "--method", "rtn", "--no-quantize-lm-head", "-o", "bf16-head",
                      cwd=tmp_path)
    assert bf16.returncode == 0, bf16.stderr
    assert QuantScheme.load(tmp_path / "bf16-head").quantize_lm_head is False
    assert "lm_head.qweight" not in load_file(tmp_path / "bf16-head" / "model.safetensors")
    assert "lm_head.qweight" in load_file(out / "model.safetensors")
    assert_one_line_error(run_qinfer("quantize", str(tiny), "--format", "fp8", "--bits", "4", cwd=tmp_path),
                          "bits (--bits) must be 8; got 4")


@pytest.mark.parametrize("args, notes", [
    (["--tune-batch", "100"], ["--tune-batch 100 is more than the 8 samples the tuning steps draw from"]),
    (["--tune-holdout", "7"], ["--tune-batch 4 is more than the 1 sample the tuning steps draw from"]),
    (["--tune-holdout", "4"], []),
])
def test_tuning_settings_the_samples_cannot_meet_are_noted(tiny, tmp_path, calib_file, args, notes):
    proc = run_qinfer("quantize", str(tiny), "-o", str(tmp_path / "q"), "--method", "rtn", "--group-size", "32",
                      "--tune-steps", "1", "--calib", str(calib_file), "--samples", "8", "--seq-len", "16", *args)
    assert proc.returncode == 0, proc.stderr
    said = [line for line in proc.stderr.splitlines() if line.startswith("note: --tune")]
    assert len(said) == len(notes) and all(n in line for n, line in zip(notes, said)), said


@pytest.mark.parametrize("how", ["closed", "reader gone"])
def test_a_stderr_no_one_reads_does_not_stop_the_run(tiny, tmp_path, calib_file, how):
    # `2>&-`, or a log reader that died: the notes and progress bars are lost, not the model
    import os

    args = [sys.executable, "-m", "qinfer", "quantize", str(tiny), "-o", str(tmp_path / "q"), "--group-size", "32",
            "--calib", str(calib_file), "--samples", "4", "--seq-len", "32"]
    if how == "closed":
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                preexec_fn=lambda: os.close(2))
    else:
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        proc.stderr.close()
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0 and out.startswith(f"wrote {tmp_path / 'q'}"), out
    assert QuantScheme.load(tmp_path / "q").method == "gptq"


def test_the_default_group_size_fits_the_model(tiny, tmp_path):
    # the tiny llama's linears read 64 and 96 channels: the default 128 fits neither, 32 both (as 64 does SmolLM2's
    # 576); a group size the user chose is kept, and refused if it does not fit (test_cli_errors)
    proc = run_qinfer("quantize", str(tiny), "-o", str(tmp_path / "q"), "--method", "rtn")
    assert proc.returncode == 0, proc.stderr
    notes = [line for line in proc.stderr.splitlines() if line.startswith("note:")]
    assert notes == ["note: group size 32: the largest that divides every linear's in_features "
                     "(model.layers.0.mlp.down_proj reads 96, which 64 does not divide); --group-size chooses"]
    assert QuantScheme.load(tmp_path / "q").group_size == 32
    assert load_model(tmp_path / "q").model.layers[0].mlp.down_proj.weight.group_size == 32
    per_channel = run_qinfer("quantize", str(tiny), "-o", str(tmp_path / "pc"), "--method", "rtn", "--group-size", "-1")
    assert per_channel.returncode == 0 and "note:" not in per_channel.stderr
    assert QuantScheme.load(tmp_path / "pc").group_size == -1
    # a group size given that fits no linear: the fix named fits all of them (32, not q_proj's 64)
    assert_one_line_error(run_qinfer("quantize", str(tiny), "-o", str(tmp_path / "x"), "--group-size", "128"),
                          "model.layers.0.self_attn.q_proj: group_size 128 does not divide in_features K=64; use "
                          "--group-size 32 (it divides every linear's in_features) or -1 (per channel)")


def test_a_model_no_group_size_fits_is_told_to_quantize_per_channel(tmp_path):
    # in_features 64 and 80: none of 32, 64, 128 divides both, so the default refuses and names -1
    config = transformers.LlamaConfig(**{**COMMON, "intermediate_size": 80})
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "src")
    write_tokenizer(tmp_path / "src")
    args = ["quantize", str(tmp_path / "src"), "--method", "rtn", "-o"]
    assert_one_line_error(run_qinfer(*args, str(tmp_path / "q")),
                          "model.layers.0.self_attn.q_proj: group_size 128 does not divide in_features K=64; use "
                          "--group-size -1 (per channel): none of 32, 64, 128 divides every linear's in_features")
    assert run_qinfer(*args, str(tmp_path / "q"), "--group-size", "-1").returncode == 0


def test_cli_says_when_rtn_reads_no_calibration_text(tiny, tmp_path):
    # RTN alone reads no text: calibration options given for it are named as unused, not silently dropped
    missing = str(tmp_path / "missing.txt")
    rtn = run_qinfer("quantize", str(tiny), "-o", str(tmp_path / "rtn"), "--method", "rtn", "--group-size", "32",
                     "--calib", missing, "--samples", "8")
    assert rtn.returncode == 0, rtn.stderr
    notes = [line for line in rtn.stderr.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and "--calib, --samples not used" in notes[0]
    assert (tmp_path / "rtn" / "quant_config.json").exists()
    assert json.loads((tmp_path / "rtn" / "quantize_report.json").read_text())["calibration"] is None  # none read
    # with KV-cache scales to calibrate, RTN reads the text: the missing file is an error, and no note
    kv = run_qinfer("quantize", str(tiny), "-o", str(tmp_path / "kv"), "--method", "rtn", "--group-size", "32",
                    "--kv-cache", "int8", "--seq-len", "64", "--calib", missing)
    assert_one_line_error(kv, "missing.txt", "does not exist")
    assert "note:" not in kv.stderr


def test_cli_notes_calibration_windows_that_repeat_the_text(tiny, tmp_path, calib_file):
    # windows taking more tokens than the text holds are drawn anyway, overlapping: a note says how often each
    # token is read, and the report records the text's length; a text long enough gets no note
    short = tmp_path / "short.txt"
    short.write_text(TEXT)
    proc = run_qinfer("quantize", str(tiny), "-o", str(tmp_path / "q"), "--group-size", "32", "--calib", str(short),
                      "--samples", "64", "--seq-len", "32")
    assert proc.returncode == 0, proc.stderr
    tokens = json.loads((tmp_path / "q" / "quantize_report.json").read_text())["calibration_text_tokens"]
    assert 0 < tokens < 64 * 31
    notes = [line for line in proc.stderr.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and f"holds {tokens:,} tokens" in notes[0] and "read" in notes[0], proc.stderr
    enough = run_qinfer("quantize", str(tiny), "-o", str(tmp_path / "q2"), "--group-size", "32",
                        "--calib", str(calib_file), "--samples", "4", "--seq-len", "32")
    assert enough.returncode == 0 and "note:" not in enough.stderr, enough.stderr
    assert json.loads((tmp_path / "q2" / "quantize_report.json").read_text())["calibration_text_tokens"] >= 4 * 31


def test_interrupt_leaves_no_output(tmp_path, calib_file):
    make_model("llama", tmp_path / "src")
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "qinfer", "quantize", str(tmp_path / "src"), "-o", str(out), "--group-size", "32",
           "--calib", str(calib_file), "--samples", "40000", "--seq-len", "64"]
    log = tmp_path / "stderr.txt"
    with log.open("w") as stderr:
        # SIGINT back to its default in the child: a shell's background job (`pytest &`) inherits it ignored,
        # and Python only turns SIGINT into KeyboardInterrupt when it starts with the default disposition
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=stderr, text=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        deadline = time.monotonic() + 120
        while "quantizing" not in log.read_text() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)  # until the block loop has started (40000 samples keep it busy)
        assert proc.poll() is None, f"finished before it could be interrupted: {log.read_text()[-500:]}"
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail(f"still running 120 s after SIGINT; stderr: {log.read_text()[-500:]}")
    err = log.read_text()
    assert proc.returncode == 130 and "Error: interrupted; nothing half-written was kept" in err  # as every command
    assert "Traceback" not in err
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]
