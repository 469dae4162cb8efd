import re

from click.testing import CliRunner

from qinfer.evals.decode_profile import main
from tests.test_quantize import tiny  # noqa: F401 (fixture)
from tests.tiny_models import VOCAB

HEADER = re.compile(r"^\S+: (\S+) ms a decode step \(median of 2; (\S+) under the profiler\)", re.M)
ROW = re.compile(r"^\s*(\d+\.\d+)\s+(\d+)  (\S.*)$", re.M)


def test_decode_profile_lists_the_ops_and_the_lm_head(tiny):  # noqa: F811
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
    lm_head = [line for line in result.stdout.splitlines()
               if line.startswith("vocabulary-wide:") and " aten::mm on " in line]
    assert len(lm_head) == 1 and str(VOCAB) in lm_head[0]  # one product as wide as the vocabulary a step


def test_decode_profile_names_a_bad_model_or_a_long_prompt_in_one_line(tiny, tmp_path):  # noqa: F811
    for args in ([str(tmp_path / "missing")], [str(tiny), "--prompt-tokens", "100000"]):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 1 and "Traceback" not in result.output
        assert len(result.output.strip().splitlines()) == 1 and result.output.startswith("Error: ")
