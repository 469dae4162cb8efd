import re
import shutil

from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from qinfer.evals.block_swap import main
from tests.test_quantize import calib_file, tiny  # noqa: F401 (fixtures)
from tests.tiny_models import make_model

LINE = re.compile(r"^(as quantized|block (\d) restored): perplexity (\S+), KL (\S+), top-1", re.M)


def test_block_swap_finds_the_one_block_that_differs(tiny, tmp_path, calib_file):  # noqa: F811
    # a copy of the model with only block 1 changed: putting block 1 back must remove all divergence,
    # putting any other block back none of it
    out = tmp_path / "perturbed"
    shutil.copytree(tiny, out)
    tensors = load_file(out / "model.safetensors")
    name = next(n for n in tensors if n.startswith("model.layers.1.") and n.endswith("up_proj.weight"))
    tensors[name] = tensors[name] * 3
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    args = [str(tiny), str(out), "--text", str(calib_file), "--max-tokens", "96", "--window", "32", "--stride", "16"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    rows = {(m.group(2) or "none"): float(m.group(4)) for m in LINE.finditer(result.stdout)}  # (the bar: stderr)
    assert set(rows) == {"none", "0", "1", "2"}  # the tiny models have 3 blocks
    assert rows["none"] > 0 and rows["1"] == 0  # the same weights give the same logits
    assert rows["0"] == rows["none"] and rows["2"] == rows["none"]


def test_block_swap_names_a_bad_model_folder_in_one_line(tiny, tmp_path):  # noqa: F811
    result = CliRunner().invoke(main, [str(tiny), str(tmp_path / "missing")])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1 and "missing" in result.output
    make_model("qwen3", tmp_path / "other")  # not the model's quantized copy: its blocks do not swap in
    result = CliRunner().invoke(main, [str(tiny), str(tmp_path / "other")])
    assert result.exit_code == 1 and "is not a quantized copy of" in result.output, result.output
