import re

from click.testing import CliRunner

from qinfer.evals.diagnostics.decode_profile import main
from qinfer.kernels import cpu_library
from tests.tiny_models import VOCAB

HEADER = re.compile(r"^\S+: (\S+) ms a decode step \(median of 2; (\S+) under the profiler\)", re.M)
ROW = re.compile(r"^\s*(\d+\.\d+)\s+(\d+)  (\S.*)$", re.M)


def test_decode_profile_lists_the_ops_and_the_lm_head(tiny):
    result = CliRunner().invoke(main, [str(tiny), "--prompt-tokens", "16", "--steps", "2", "--top", "4",
                                       "--min-share", "0"])
    assert result.exit_code == 0, result.output
    step, profiled = map(float, HEADER.search(result.stdout).groups())
    assert step > 0 and profiled > 0
    rows = ROW.findall(result.stdout)
    assert len(rows) == 5 and rows[-1][2] == "(all other ops)"  # --top ops, then the rest
    times = [float(ms) for ms, _, _ in rows]
    assert times[:4] == sorted(times[:4], reverse=True)
    assert sum(times) <= profiled + 0.01 * len(times)  # self times on one thread: within the step (rounding)
    product = " qinfer::bf16_gemv on " if cpu_library.available() else " aten::mm on "  # the C kernel's operator
    lm_head = [line for line in result.stdout.splitlines() if line.startswith("vocabulary-wide:") and product in line]
    assert len(lm_head) == 1 and str(VOCAB) in lm_head[0]  # one product as wide as the vocabulary a step


def test_decode_profile_names_a_bad_model_or_a_long_prompt_in_one_line(tiny, tmp_path):
    for args in ([str(tmp_path / "missing")], [str(tiny), "--prompt-tokens", "100000"]):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 1 and "Traceback" not in result.output
        assert len(result.output.strip().splitlines()) == 1 and result.output.startswith("Error: ")



def test_decode_profile_words_a_long_prompt_in_the_options_given(tiny):
    # the tiny model reads 256 positions; --steps 8 times 8 steps and profiles 8 more, after 4 warm-up steps
    result = CliRunner().invoke(main, [str(tiny), "--prompt-tokens", "250"])
    assert result.exit_code == 1 and len(result.output.strip().splitlines()) == 1
    assert ("--prompt-tokens 250 with --steps 8 runs past the model's context of 256 tokens (20 decode steps follow "
            "the prompt, 4 of them warm-up): use --prompt-tokens 236 or fewer") in result.output, result.output
    result = CliRunner().invoke(main, [str(tiny), "--prompt-tokens", "16", "--steps", "2", "--compile", "--rounds",
                                       "200"])
    assert result.exit_code == 1 and "with --steps 2, --rounds 200 runs past" in result.output, result.output
    assert "lower --steps or --rounds" in result.output


def test_decode_profile_refuses_a_min_share_outside_0_to_1(tiny):
    for share in ("-0.5", "1.5", "nan"):
        result = CliRunner().invoke(main, [str(tiny), "--prompt-tokens", "16", "--steps", "1", "--min-share", share])
        assert result.exit_code == 1 and "--min-share is a share of the profiled time, in 0..1" in result.output


COMPILED = re.compile(r"^torch\.compile\(decode_step, dynamic=True\): (\d+) s to compile \(the first step\); then "
                      r"(\S+) ms a step against (\S+) eager \((\S+)x; medians of (\d+) steps each, alternating "
                      r"rounds\); greedy tokens (the same|differ)$", re.M)


def test_decode_profile_compares_a_compiled_decode_step(tiny):
    result = CliRunner().invoke(main, [str(tiny), "--prompt-tokens", "16", "--steps", "2", "--top", "2",
                                       "--compile", "--rounds", "2"])
    assert result.exit_code == 0, result.output
    calls = re.search(r"^(\d+) op calls a step", result.stdout, re.M)
    assert calls and int(calls.group(1)) > 0
    match = COMPILED.search(result.stdout)
    assert match, result.stdout
    _, compiled, eager, ratio, steps, tokens = match.groups()
    compiled, eager, ratio = float(compiled), float(eager), float(ratio)
    assert compiled > 0 and eager > 0 and int(steps) == 4
    # the ratio of the unrounded times; the times are printed to 0.1 ms, the ratio to 0.01
    assert (eager - 0.05) / (compiled + 0.05) - 0.005 <= ratio <= (eager + 0.05) / (compiled - 0.05) + 0.005
    graphs = re.search(r"^torch\.compile\(decode_step, dynamic=True\): (\d+) graphs, (\d+) graph breaks",
                       result.stdout, re.M)
    assert graphs and int(graphs.group(1)) >= 1  # the step was traced, not left to run eagerly
    assert tokens == "the same"  # the compiled step computes the same model (fp32 tiny model: greedy agrees)
