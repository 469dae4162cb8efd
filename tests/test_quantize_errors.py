"""quantize on checkpoints it must refuse or work around: NaN and Inf weights, weights too large for a scale,
activations that overflow, Hessians GPTQ must damp more."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from qinfer.pipeline.config import TuneConfig
from qinfer.errors import QinferError
from qinfer.format import QuantScheme
from qinfer.pipeline.config import CalibConfig
from qinfer.pipeline.quantize import quantize_model
from tests.tiny_models import make_model

CALIB = CalibConfig(samples=16, seq_len=64)  # (the rtn cases read no text)


def test_nan_weight_names_the_layer(tmp_path):
    make_model("llama", tmp_path / "src")
    path = tmp_path / "src" / "model.safetensors"
    tensors = load_file(path)
    tensors["model.layers.1.mlp.up_proj.weight"][3, 5] = float("nan")
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(QinferError, match="model.layers.1.mlp.up_proj"):
        quantize_model(tmp_path / "src", tmp_path / "out", QuantScheme(method="rtn", group_size=32), CALIB)
    assert not (tmp_path / "out").exists()



@pytest.mark.parametrize("name", ["model.layers.2.input_layernorm.weight", "model.embed_tokens.weight"])
def test_nan_outside_the_linears_is_named_before_any_work(tmp_path, name):
    # no quantizer reads a norm or the embedding: without the check RTN wrote a model whose outputs are NaN
    make_model("llama", tmp_path / "src")
    path = tmp_path / "src" / "model.safetensors"
    tensors = load_file(path)
    tensors[name].view(-1)[7] = float("inf")
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(QinferError, match=f"{name} contains NaN or Inf"):
        quantize_model(tmp_path / "src", tmp_path / "out", QuantScheme(method="rtn", group_size=32), CALIB)
    assert not (tmp_path / "out").exists()



OVERFLOWS = {  # every path that runs the calibration text: each stops at the block whose activations overflow
    "gptq": ("gptq", {}, {}),
    "gptq --fp-target": ("gptq", {"fp_target": True}, {}),
    "awq": ("awq", {}, {}),
    "awq --true-sequential": ("awq", {"true_sequential": True}, {}),
    "awq --fp-target": ("awq", {"fp_target": True}, {}),
    "rtn --kv-cache fp8": ("rtn", {}, {}),
    "rtn --tune-steps 2": ("rtn", {}, {"steps": 2}),
    "rtn --e2e-steps 1": ("rtn", {}, {"e2e_steps": 1}),
}



@pytest.mark.parametrize("case", OVERFLOWS)
def test_activations_that_overflow_name_the_layer_and_what_to_check(tmp_path, calib_file, case):
    # finite weights whose activations overflow (a norm weight of 1e30): an error naming block 1 and the checkpoint,
    # where AWQ named no layer, the KV ranges neither layer nor fix, and end-to-end tuning exited 0 at KL nan
    method, calib, tune = OVERFLOWS[case]
    make_model("llama", tmp_path / "src")
    path = tmp_path / "src" / "model.safetensors"
    tensors = load_file(path)
    tensors["model.layers.1.post_attention_layernorm.weight"].fill_(1e30)
    save_file(tensors, path, metadata={"format": "pt"})
    scheme = QuantScheme(method=method, group_size=32, kv_cache="fp8" if "kv" in case else "none")
    with pytest.raises(QinferError, match=r"model\.layers\.1\b[^:]*: .*overflow.*check the checkpoint"):
        quantize_model(tmp_path / "src", tmp_path / "out", scheme,
                       CalibConfig(source=str(calib_file), samples=4, seq_len=16, **calib), tune=TuneConfig(**tune))
    assert not (tmp_path / "out").exists()



@pytest.mark.parametrize("method", ["rtn", "gptq", "awq"])
def test_a_weight_too_large_for_its_scale_is_named(tmp_path, calib_file, method):
    make_model("llama", tmp_path / "src")
    path = tmp_path / "src" / "model.safetensors"
    tensors = load_file(path)
    tensors["model.layers.1.self_attn.q_proj.weight"][3, 5] = 1e30
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(QinferError, match=r"model\.layers\.1\.self_attn\.q_proj: .*too large"):
        quantize_model(tmp_path / "src", tmp_path / "out", QuantScheme(method=method, group_size=32),
                       CalibConfig(source=str(calib_file), samples=4, seq_len=16))



def test_a_damping_gptq_had_to_raise_is_reported(tmp_path, calib_file, monkeypatch):
    import qinfer.pipeline.quantize as pipeline

    make_model("llama", tmp_path / "src")
    real = pipeline.gptq_quantize_ex
    bent = "model.layers.1.mlp.down_proj"

    def indefinite_at_one(W, H, scheme, *, name):  # as a Hessian summed in low precision can be: a few
        if name == bent:  # eigenvalues below zero, which the default damping of 0.01 x mean(diag H) does not lift
            H = H - 0.05 * float(H.diagonal().mean()) * torch.eye(H.shape[0])
        return real(W, H, scheme, name=name)

    monkeypatch.setattr(pipeline, "gptq_quantize_ex", indefinite_at_one)
    report = quantize_model(tmp_path / "src", tmp_path / "out", QuantScheme(method="gptq", group_size=32),
                            CalibConfig(source=str(calib_file), samples=4, seq_len=16))
    assert report.raised_damping[bent] == pytest.approx(0.1)  # (bf16 sums can leave o_proj's indefinite too)
    assert all(damp > 0.01 for damp in report.raised_damping.values())
    n = len(report.raised_damping)
    assert f"GPTQ raised the damping of {n} linear" in report.summary()
    assert "not positive definite" in report.summary() and "quantize_report.json: raised_damping" in report.summary()
    written = json.loads((tmp_path / "out" / "quantize_report.json").read_text())
    assert written["raised_damping"] == report.raised_damping

