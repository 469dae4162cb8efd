"""``qinfer generate MODEL --prompts FILE``, run as a user runs it, on a tiny model with a chat template."""

import json

import pytest
import torch

from qinfer.engine.generate import generate
from qinfer.engine.sampling import SamplingParams
from qinfer.model.loader import load_model
from qinfer.sources.tokenizer import Tokenizer
from tests.test_cli_errors import assert_one_line_error, run_qinfer
from tests.tiny_models import make_model


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    make_model("llama", folder)
    return folder


def write(tmp_path, *lines) -> str:
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    return str(path)


def test_every_request_gets_one_result_line_in_input_order(folder, tmp_path):
    requests = [{"prompt": "It is a truth", "max_tokens": 9}, {"prompt": "However little", "max_tokens": 3},
                {"messages": [{"role": "user", "content": "a single man"}], "max_tokens": 5},
                {"prompt": "the rightful", "temperature": 0.9, "seed": 4, "max_tokens": 6}]
    proc = run_qinfer("generate", str(folder), "--prompts", write(tmp_path, *requests[:2], "", *requests[2:]),
                      "--dtype", "fp32", "--max-running", "2", "--kv-memory", "64KiB")
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [line["index"] for line in lines] == [0, 1, 2, 3]
    assert [line["completion_tokens"] for line in lines] == [9, 3, 5, 6]
    assert all(line["finish_reason"] == "length" and line["ttft_s"] > 0 for line in lines)
    assert "4 requests, 23 tokens generated" in proc.stderr
    # the same text as each prompt continued alone
    model, tokenizer = load_model(folder, dtype=torch.float32), Tokenizer.from_folder(folder)
    ids = tokenizer.encode("It is a truth")
    alone = list(generate(model, ids, SamplingParams(max_tokens=9), stop_ids=()))
    assert lines[0]["prompt_tokens"] == len(ids)
    assert lines[0]["text"] == tokenizer.decode(ids[-1:] + alone, True)[len(tokenizer.decode(ids[-1:], True)):]


@pytest.mark.parametrize("line, needle", [
    ("{not json", "line 2: not JSON"),
    ('["a list"]', "line 2: not a JSON object"),
    ('{"prompt": "x", "messages": []}', 'line 2: give one of "prompt"'),
    ('{"prompt": "x", "temprature": 1}', "line 2: unknown field 'temprature'"),
    ('{"prompt": "x", "max_tokens": "many"}', 'line 2: "max_tokens" must be an integer'),
    ('{"prompt": "x", "top_p": 2}', "line 2: --top-p must be in (0, 1]"),
    ('{"prompt": "x", "stop": [1]}', 'line 2: "stop" must be a string or a list of strings'),
    ('{"messages": "hi"}', 'line 2: "messages" must be a non-empty list'),
])
def test_a_bad_line_is_named_before_anything_runs(folder, tmp_path, line, needle):
    proc = run_qinfer("generate", str(folder), "--prompts", write(tmp_path, {"prompt": "fine"}, line))
    assert_one_line_error(proc, needle)
    assert proc.stdout == ""


def test_prompt_and_prompts_file_are_one_or_the_other(folder, tmp_path):
    assert_one_line_error(run_qinfer("generate", str(folder)), "give a PROMPT or --prompts FILE")
    file = write(tmp_path, {"prompt": "fine"})
    assert_one_line_error(run_qinfer("generate", str(folder), "hi", "--prompts", file), "one of them")
    assert_one_line_error(run_qinfer("generate", str(folder), "--prompts", file, "--compile"), "drop --compile")
    assert_one_line_error(run_qinfer("generate", str(folder), "--prompts", str(tmp_path / "none.jsonl")),
                          "cannot read it")
    assert_one_line_error(run_qinfer("generate", str(folder), "--prompts", file, "--kv-memory", "lots"),
                          "is not a size")
    assert_one_line_error(run_qinfer("generate", str(folder), "--prompts", file, "--kv-memory", "10"),
                          "less than one KV-cache block")
