"""Whole-folder export and import: qinfer -> GPTQ / compressed-tensors -> qinfer gives the same logits, a
foreign folder works as MODEL in every command, and transformers reads the compressed-tensors export."""

import dataclasses
import json
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from qinfer.store.paths import cache_dir
from qinfer.errors import QinferError
from qinfer.format import QUANT_CONFIG_FILE, QuantizedWeight, QuantScheme
from qinfer.interop import compressed_tensors as ct
from qinfer.interop.folders import export_folder, foreign_quant_config, import_folder
from qinfer.model.loader import load_model, read_folder_tensors
from qinfer.pipeline.config import CalibConfig
from qinfer.pipeline.quantize import quantize_model
from qinfer.sources.resolve import resolve_model
from tests.test_cli_errors import assert_one_line_error, run_qinfer
from tests.tiny_models import make_model

IDS = torch.arange(3, 40)[None]
SCHEMES = {
    "int4-sym": QuantScheme(method="rtn", bits=4, group_size=32, symmetric=True),
    "int4-asym": QuantScheme(method="rtn", bits=4, group_size=32, symmetric=False),
    "int3-sym": QuantScheme(method="rtn", bits=3, group_size=32, symmetric=True),
    "int8-channel": QuantScheme(method="rtn", bits=8, group_size=-1, symmetric=True),
    "fp8": QuantScheme(method="fp8", format="fp8", bits=8, group_size=-1),
    "int4-lm-head": QuantScheme(method="rtn", bits=4, group_size=32, quantize_lm_head=True, lm_head_bits=4),
    # qinfer quantize's default: an int8 lm_head beside 4-bit linears (GPTQ's dynamic override, a second
    # compressed-tensors group)
    "int4-lm-head8": QuantScheme(method="rtn", bits=4, group_size=32, symmetric=False, quantize_lm_head=True),
}


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    make_model("llama", folder)
    return folder


@pytest.fixture(scope="module")
def quantized(src, tmp_path_factory):
    root = tmp_path_factory.mktemp("quantized")
    for name, scheme in SCHEMES.items():
        # without the stored BOS position, which no other layout has: an export computes what the folder does
        quantize_model(src, root / name, scheme, CalibConfig(samples=2, seq_len=16, keep_bos=False))
    return root


def logits(folder):
    with torch.no_grad():
        return load_model(folder, dtype=torch.float32)(IDS)


@pytest.mark.parametrize("fmt", ["gptq", "compressed-tensors"])
@pytest.mark.parametrize("name", list(SCHEMES))
def test_export_then_import_is_exact(quantized, tmp_path, fmt, name):
    if fmt == "gptq" and SCHEMES[name].format == "fp8":
        with pytest.raises(QinferError, match="FP8 weights have no GPTQ layout"):
            export_folder(quantized / name, tmp_path / "out", fmt)
        return
    report = export_folder(quantized / name, tmp_path / "out", fmt)
    n_linears = 3 * 7 + SCHEMES[name].quantize_lm_head
    assert report.linears == n_linears
    # vLLM's compressed-tensors kernels take 4- and 8-bit integers: a 3-bit export there says so; transformers
    # loads no asymmetric one, and an asymmetric export says that
    scheme, ct = SCHEMES[name], fmt == "compressed-tensors"
    said = [note.split(" ")[0] for note in report.notes]
    assert said == ["vLLM"] * (ct and scheme.bits == 3) + ["asymmetric"] * (ct and not scheme.symmetric)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == fmt
    assert not (tmp_path / "out" / QUANT_CONFIG_FILE).exists()
    tensors = read_folder_tensors(tmp_path / "out")
    key = "qweight" if fmt == "gptq" else ("weight_scale" if SCHEMES[name].format == "fp8" else "weight_packed")
    assert sum(k.endswith("." + key) for k in tensors) == n_linears
    back = resolve_model(str(tmp_path / "out"))  # a foreign folder is converted once, into the cache
    assert back != tmp_path / "out" and (back / QUANT_CONFIG_FILE).exists()
    assert resolve_model(str(tmp_path / "out")) == back
    assert torch.equal(logits(back), logits(quantized / name))
    back_scheme = QuantScheme.load(back)
    assert back_scheme.bits == SCHEMES[name].bits and back_scheme.quantize_lm_head == SCHEMES[name].quantize_lm_head
    assert back_scheme.lm_head_bits == SCHEMES[name].lm_head_bits


@pytest.mark.parametrize("fmt", ["gptq", "compressed-tensors"])
def test_tied_embedding_exports_as_a_table_beside_an_untied_lm_head(tmp_path, fmt):
    # qinfer reads a tied embedding from the quantized lm_head; other readers get the table (bf16) and untied
    make_model("gemma3", tmp_path / "gemma")
    q, out = tmp_path / "q", tmp_path / "out"
    scheme = QuantScheme(method="rtn", bits=4, group_size=32, quantize_lm_head=True)  # an int8 lm_head
    quantize_model(tmp_path / "gemma", q, scheme, CalibConfig(samples=2, seq_len=16))
    assert "model.embed_tokens.weight" not in read_folder_tensors(q)
    export_folder(q, out, fmt)
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    head = load_model(q).lm_head.weight
    assert torch.equal(read_folder_tensors(out)["model.embed_tokens.weight"], head.dequantize(torch.bfloat16))
    # the import ties them again: the same logits in every compute dtype, not only in bf16
    back = resolve_model(str(out))
    assert "model.embed_tokens.weight" not in read_folder_tensors(back)
    assert json.loads((back / "config.json").read_text())["tie_word_embeddings"] is True
    assert torch.equal(logits(back), logits(q))


def test_act_order_groups_round_trip_through_a_gptq_folder(quantized, tmp_path):
    # a qinfer folder whose linears store permuted columns (as an imported desc_act checkpoint does) exports
    # with desc_act true and a g_idx per linear, and imports back to the same logits
    src = tmp_path / "perm"
    shutil.copytree(quantized / "int4-asym", src)
    scheme = QuantScheme.load(src)
    tensors = read_folder_tensors(src)
    g = torch.Generator().manual_seed(0)
    for prefix in sorted({k.removesuffix(".qweight") for k in tensors if k.endswith(".qweight")}):
        w = QuantizedWeight.from_tensors(prefix, tensors, scheme)
        perm = torch.randperm(w.shape[1], generator=g).to(torch.int32)
        tensors.update(dataclasses.replace(w, perm=perm).tensors(prefix))
    save_file({k: v.contiguous() for k, v in tensors.items()}, src / "model.safetensors")
    export_folder(src, tmp_path / "out", "gptq")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]["desc_act"] is True
    g_idx = read_folder_tensors(tmp_path / "out")["model.layers.0.mlp.up_proj.g_idx"]
    assert not torch.equal(g_idx, torch.sort(g_idx).values)  # groups are not contiguous
    back = resolve_model(str(tmp_path / "out"))
    a, b = load_model(src, dtype=torch.float32), load_model(back, dtype=torch.float32)
    for name, m in a.named_modules():
        if hasattr(m, "weight") and isinstance(m.weight, QuantizedWeight):  # the same weights, each in channel order
            assert torch.equal(m.weight.dequantize(torch.float32), b.get_submodule(name).weight.dequantize(torch.float32))
    # each group's columns may come back in another order (sorted by channel), so sums may round differently
    assert torch.allclose(logits(back), logits(src), rtol=1e-4, atol=1e-4)
    assert not torch.allclose(logits(src), logits(quantized / "int4-asym"), rtol=1e-2, atol=1e-2)
    with pytest.raises(QinferError, match="export with --format gptq"):
        export_folder(src, tmp_path / "ct", "compressed-tensors")


def test_gptq_refuses_zero_point_zero(quantized, tmp_path):
    """GPTQ v1 stores zero - 1; a forced zero point of 0 has no encoding and is refused, not corrupted."""
    src = tmp_path / "zero"
    shutil.copytree(quantized / "int4-asym", src)
    tensors = load_file(src / "model.safetensors")
    tensors["model.layers.0.mlp.up_proj.zero"][0, 0] = 0
    save_file(tensors, src / "model.safetensors")
    with pytest.raises(QinferError, match="zero point 0"):
        export_folder(src, tmp_path / "out", "gptq")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["int4-sym", "int8-channel", "fp8"])
def test_transformers_reads_compressed_tensors_export(quantized, tmp_path, name):
    """The compressed-tensors library, through transformers, decompresses the export to the same model."""
    export_folder(quantized / name, tmp_path / "ct", "compressed-tensors")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ct", dtype=torch.float32)
    with torch.no_grad():
        theirs = model(IDS).logits
    ours = logits(quantized / name)
    assert torch.allclose(theirs, ours, atol=1e-4, rtol=0), (theirs - ours).abs().max()



def test_linears_a_compressed_tensors_checkpoint_leaves_out_stay_out(quantized, tmp_path):
    # llm-compressor writes layers it skipped dense and names them in `ignore`, often by pattern: qinfer runs
    # them dense, records what is quantized from the tensors, and writes them back to `ignore` on export
    export_folder(quantized / "int4-sym", tmp_path / "ct", "compressed-tensors")
    tensors = load_file(tmp_path / "ct" / "model.safetensors")
    for prefix in [k.removesuffix(".weight_packed") for k in tensors if k.endswith("down_proj.weight_packed")]:
        weight = ct.from_compressed_tensors(prefix, tensors, SCHEMES["int4-sym"]).dequantize(torch.float32)
        for suffix in ("weight_packed", "weight_scale", "weight_shape"):
            del tensors[f"{prefix}.{suffix}"]
        tensors[f"{prefix}.weight"] = weight + 0.01  # not on any 4-bit grid
    save_file(tensors, tmp_path / "ct" / "model.safetensors")
    config = json.loads((tmp_path / "ct" / "config.json").read_text())
    config["quantization_config"]["ignore"] = ["re:.*lm_head", "re:.*down_proj$"]
    (tmp_path / "ct" / "config.json").write_text(json.dumps(config))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ct", dtype=torch.float32)
    with torch.no_grad():
        reference = theirs(IDS).logits

    import_folder(tmp_path / "ct", tmp_path / "back")
    assert QuantScheme.load(tmp_path / "back").quantize_lm_head is False  # the pattern's lm_head is dense
    assert torch.allclose(logits(tmp_path / "back"), reference, atol=1e-4, rtol=0)
    export_folder(tmp_path / "back", tmp_path / "again", "compressed-tensors")
    ignore = json.loads((tmp_path / "again" / "config.json").read_text())["quantization_config"]["ignore"]
    layers = config["num_hidden_layers"]
    assert ignore == ["lm_head"] + [f"model.layers.{i}.mlp.down_proj" for i in range(layers)]
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "again", dtype=torch.float32)
    with torch.no_grad():
        assert torch.allclose(again(IDS).logits, reference, atol=1e-4, rtol=0)
    with pytest.raises(QinferError, match="model.layers.0.mlp.down_proj is not quantized .* --format compressed"):
        export_folder(tmp_path / "back", tmp_path / "gptq", "gptq")
    assert not (tmp_path / "gptq").exists()


def test_import_folder_writes_qinfer_format(quantized, tmp_path):
    export_folder(quantized / "int4-sym", tmp_path / "gptq", "gptq")
    import_folder(tmp_path / "gptq", tmp_path / "back")
    assert QuantScheme.load(tmp_path / "back").method == "gptq"
    assert "quantization_config" not in json.loads((tmp_path / "back" / "config.json").read_text())
    assert (tmp_path / "back" / "tokenizer.json").exists()
    assert torch.equal(logits(tmp_path / "back"), logits(quantized / "int4-sym"))


def test_an_imported_copy_follows_its_tokenizer_files(quantized, tmp_path):
    # the cached qinfer-format copy of a foreign folder is made again when a file copied beside the weights
    # changes (a chat template removed here), not only the config or the weights
    export_folder(quantized / "int4-sym", tmp_path / "gptq", "gptq")
    first = resolve_model(str(tmp_path / "gptq"))
    assert resolve_model(str(tmp_path / "gptq")) == first
    config = json.loads((tmp_path / "gptq" / "tokenizer_config.json").read_text())
    assert config.pop("chat_template")
    (tmp_path / "gptq" / "tokenizer_config.json").write_text(json.dumps(config))
    again = resolve_model(str(tmp_path / "gptq"))
    assert again != first
    assert "chat_template" not in json.loads((again / "tokenizer_config.json").read_text())


def test_an_imported_copy_made_by_an_older_import_is_made_again(quantized, tmp_path, monkeypatch):
    import qinfer.interop.folders as folders

    export_folder(quantized / "int4-sym", tmp_path / "gptq", "gptq")
    first = resolve_model(str(tmp_path / "gptq"))
    monkeypatch.setattr(folders, "IMPORT_REVISION", folders.IMPORT_REVISION + b"+1")
    again = resolve_model(str(tmp_path / "gptq"))
    assert again != first and (again / QUANT_CONFIG_FILE).exists()


def test_a_damaged_imported_copy_is_made_again(quantized, tmp_path):
    export_folder(quantized / "int4-sym", tmp_path / "gptq", "gptq")
    copy = resolve_model(str(tmp_path / "gptq"))
    expected = logits(copy)
    (copy / "model.safetensors").write_bytes((copy / "model.safetensors").read_bytes()[:1000])
    assert resolve_model(str(tmp_path / "gptq")) == copy
    torch.testing.assert_close(logits(copy), expected, atol=0, rtol=0)


def test_an_import_the_loader_refuses_names_the_folder_and_is_not_kept(quantized, tmp_path):
    # a tensor beside the packed ones that no layer has: the conversion runs, the loader refuses it
    export_folder(quantized / "int4-sym", tmp_path / "gptq", "gptq")
    tensors = load_file(tmp_path / "gptq" / "model.safetensors")
    save_file({**tensors, "model.layers.0.mlp.extra": torch.zeros(4)}, tmp_path / "gptq" / "model.safetensors",
              metadata={"format": "pt"})
    converted = cache_dir("converted")
    before = set(converted.iterdir())
    with pytest.raises(QinferError) as e:
        resolve_model(str(tmp_path / "gptq"))
    assert str(e.value).startswith(f"{tmp_path / 'gptq'}: weights do not match") and "mlp.extra" in str(e.value)
    assert set(converted.iterdir()) == before  # nothing for `qinfer list` to show as imported


@pytest.mark.parametrize("fmt, tensor", [("gptq", "qzeros"), ("compressed-tensors", "weight_packed")])
def test_a_foreign_checkpoint_without_its_quantization_config_names_it(quantized, tmp_path, fmt, tensor):
    export_folder(quantized / "int4-sym", tmp_path / "x", fmt)
    config = json.loads((tmp_path / "x" / "config.json").read_text())
    del config["quantization_config"]
    (tmp_path / "x" / "config.json").write_text(json.dumps(config))
    with pytest.raises(QinferError, match=rf"holds GPTQ or compressed-tensors weights \(model\.[\w.]+\.{tensor}\) but "
                                          "its config.json has no quantization_config"):
        load_model(resolve_model(str(tmp_path / "x")))


@pytest.mark.parametrize("scheme", ["int4-sym", "int4-asym"])
def test_a_compressed_tensors_row_length_off_the_groups_is_named(quantized, tmp_path, scheme):
    export_folder(quantized / scheme, tmp_path / "ct", "compressed-tensors")
    tensors = load_file(tmp_path / "ct" / "model.safetensors")
    key = "model.layers.0.mlp.down_proj.weight_shape"
    N, K = tensors[key].tolist()
    tensors[key] = torch.tensor([N, K - 4], dtype=tensors[key].dtype)  # the same packed words hold K - 4 codes
    save_file(tensors, tmp_path / "ct" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(QinferError, match=rf"weight_shape: K={K - 4} is not a multiple of the group size 32"):
        resolve_model(str(tmp_path / "ct"))


@pytest.mark.parametrize("fmt", ["gptq", "compressed-tensors"])
def test_export_leaves_the_stored_bos_position_out_and_kv_scales_where_the_layout_has_none(src, tmp_path, fmt):
    scheme = dataclasses.replace(SCHEMES["int4-sym"], kv_cache="int8")
    quantize_model(src, tmp_path / "q", scheme, CalibConfig(samples=2, seq_len=16))
    assert load_model(tmp_path / "q").bos_hidden is not None
    report = export_folder(tmp_path / "q", tmp_path / "out", fmt)
    assert not [k for k in read_folder_tensors(tmp_path / "out") if "bos" in k]
    assert "model.bos_hidden" in report.dropped and "model.layers.2.self_attn.bos_v" in report.dropped
    bos_note = (f"the stored BOS position (keys, values, output) is not part of the {fmt} layout and was left out")
    if fmt == "gptq":
        assert "model.layers.2.self_attn.k_scale" in report.dropped
        assert report.notes == ["KV-cache scales (3 layers' keys and values) are not part of the gptq layout and were "
                                "left out", bos_note]
    else:  # written as compressed-tensors' static FP8 KV cache: test_kv_cache_scales_export_per_tensor_as_fp8
        assert not [k for k in report.dropped if k.endswith("_scale")] and len(report.notes) == 2
    assert load_model(resolve_model(str(tmp_path / "out"))).bos_hidden is None


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_kv_cache_scales_export_per_tensor_as_fp8(src, tmp_path, kv):
    # llm-compressor's static FP8 KV cache, as vLLM reads it: one scale per layer's keys and values, the largest
    # calibrated absmax over 448 (int8's scales are that absmax over 127); an import reads them back per tensor
    scheme = dataclasses.replace(SCHEMES["int4-sym"], kv_cache=kv)
    quantize_model(src, tmp_path / "q", scheme, CalibConfig(samples=2, seq_len=16, keep_bos=False))
    report = export_folder(tmp_path / "q", tmp_path / "ct", "compressed-tensors")
    assert report.notes == ["KV-cache scales written per tensor for an FP8 cache (kv_cache_scheme, as vLLM's "
                            "--kv-cache-dtype fp8 reads them): 3 layers' keys and values, each its largest "
                            "calibrated absmax over 448 (the finer scales are not kept)"]
    config = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]
    assert config["kv_cache_scheme"] == {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
                                         "symmetric": True}
    ours, theirs = read_folder_tensors(tmp_path / "q"), load_file(tmp_path / "ct" / "model.safetensors")
    qmax = {"int8": 127.0, "fp8": 448.0}[kv]
    for i in range(3):
        for n in ("k", "v"):
            name = f"model.layers.{i}.self_attn.{n}_scale"
            assert ours[name].shape == (2, 16) and theirs[name].shape == (1,) and theirs[name].dtype == torch.float32
            torch.testing.assert_close(theirs[name], (ours[name].amax() * qmax / 448).reshape(1), rtol=1e-6, atol=0)
    back = load_model(resolve_model(str(tmp_path / "ct")), dtype=torch.float32)
    assert QuantScheme.load(resolve_model(str(tmp_path / "ct"))).kv_cache == "fp8"
    torch.testing.assert_close(back.kv_scales[1][0], theirs["model.layers.1.self_attn.k_scale"].expand(2))
    # (that the compressed-tensors library declares these shapes: test_compressed_tensors)


def test_cli_export_and_generate_from_export(quantized, tmp_path):
    out = tmp_path / "ct"
    proc = run_qinfer("export", str(quantized / "int4-sym"), "-o", str(out), "--format", "compressed-tensors")
    assert proc.returncode == 0, proc.stderr
    assert "21 quantized linears" in proc.stdout
    direct = run_qinfer("generate", str(quantized / "int4-sym"), "It is a truth", "--max-tokens", "8")
    via_export = run_qinfer("generate", str(out), "It is a truth", "--max-tokens", "8")
    assert via_export.returncode == 0, via_export.stderr
    assert via_export.stdout == direct.stdout and direct.stdout.strip()
    assert_one_line_error(run_qinfer("export", str(quantized / "int4-sym"), "-o", str(out), "--format", "gptq"),
                          "already exists", "--force")
    # quantizing it again names the folder given, not the cache's converted copy
    assert_one_line_error(run_qinfer("quantize", str(out), "--method", "rtn", "-o", str(tmp_path / "again")),
                          f"{out} is already quantized (compressed-tensors): quantize the original model")
    assert f"(imported)               {resolve_model(str(out))}" in run_qinfer("list").stdout


def test_cli_export_bad_input(src, quantized, tmp_path):
    assert_one_line_error(run_qinfer("export", str(src), "-o", str(tmp_path / "x"), "--format", "gptq"),
                          "not a qinfer-quantized folder")
    assert_one_line_error(run_qinfer("export", str(quantized / "fp8"), "-o", str(tmp_path / "x"), "--format", "gptq"),
                          "FP8", "compressed-tensors")
    assert not (tmp_path / "x").exists()


def test_unsupported_foreign_quantization_is_one_line(src, tmp_path):
    folder = tmp_path / "awq"
    shutil.copytree(src, folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (folder / "config.json").write_text(json.dumps(config))
    assert_one_line_error(run_qinfer("generate", str(folder), "hi"), "quant_method 'awq' is not supported")
    # AutoAWQ also writes its own quant_config.json (qinfer's file name): named as AutoAWQ's, not as a version
    (folder / "quant_config.json").write_text(json.dumps({"zero_point": True, "q_group_size": 128, "w_bit": 4}))
    assert_one_line_error(run_qinfer("generate", str(folder), "hi"), f"{folder / 'quant_config.json'} is AutoAWQ's")


def test_older_autogptq_quantize_config_json_is_read(quantized, tmp_path):
    # AutoGPTQ before quantization_config: the GPTQ settings in quantize_config.json beside config.json
    export_folder(quantized / "int4-asym", tmp_path / "gptq", "gptq")
    config = json.loads((tmp_path / "gptq" / "config.json").read_text())
    settings = config.pop("quantization_config")
    del settings["quant_method"], settings["checkpoint_format"]  # older files name neither
    (tmp_path / "gptq" / "config.json").write_text(json.dumps(config))
    (tmp_path / "gptq" / "quantize_config.json").write_text(json.dumps(settings))
    assert torch.equal(logits(resolve_model(str(tmp_path / "gptq"))), logits(quantized / "int4-asym"))
    assert_one_line_error(run_qinfer("quantize", str(tmp_path / "gptq"), "-o", str(tmp_path / "q")),
                          "is already quantized (gptq)")


@pytest.mark.parametrize("text, message", [
    (b"[4, 128]", "quantize_config.json holds a JSON list, not an object: fix or remove it"),
    (b'{"bits": 4,', "quantize_config.json is not valid JSON \\(Expecting property name enclosed in double quotes at line 1\\): fix"),
    (b'{"bits": "\xff"}', r"quantize_config.json is not UTF-8 text \(byte 10\): fix or remove it"),
])
def test_a_broken_older_autogptq_quantize_config_json_is_one_line(tmp_path, text, message):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "quantize_config.json").write_bytes(text)
    with pytest.raises(QinferError, match=message):
        foreign_quant_config(tmp_path)


def test_force_never_deletes_a_foreign_folder_being_read(quantized, tmp_path):
    """The check is on the path given, not only on the qinfer-format copy in the cache that is read."""
    export_folder(quantized / "int4-sym", tmp_path / "outer" / "gptq", "gptq")
    (tmp_path / "outer" / "config.json").write_text("{}")  # looks like a model folder --force may replace
    for out in ("outer", "outer/gptq"):
        proc = run_qinfer("export", str(tmp_path / "outer" / "gptq"), "-o", str(tmp_path / out), "--force",
                          "--format", "compressed-tensors")
        assert_one_line_error(proc, "the model being read")
    assert (tmp_path / "outer" / "gptq" / "model.safetensors").is_file()


def test_compressed_tensors_kv_cache_scales_are_imported_per_head(quantized, tmp_path):
    # llm-compressor's static FP8 KV cache: one k_scale / v_scale per layer (0-d or [1]), amax / 448, with a
    # kv_cache_scheme naming the dtype; imported as qinfer's per-head scales, the dtype recorded
    export_folder(quantized / "fp8", tmp_path / "ct", "compressed-tensors")
    config = json.loads((tmp_path / "ct" / "config.json").read_text())
    tensors = load_file(tmp_path / "ct" / "model.safetensors")
    layers, n_kv = config["num_hidden_layers"], config["num_key_value_heads"]
    for i in range(layers):
        for n, value in (("k", 0.5 + i), ("v", 0.25 + i)):
            tensors[f"model.layers.{i}.self_attn.{n}_scale"] = torch.tensor(value) if i % 2 else torch.tensor([value])
    save_file(tensors, tmp_path / "ct" / "model.safetensors")
    without_scheme = shutil.copytree(tmp_path / "ct", tmp_path / "no-scheme")
    config["quantization_config"]["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "symmetric": True,
                                                        "strategy": "tensor", "dynamic": False}
    (tmp_path / "ct" / "config.json").write_text(json.dumps(config))
    import_folder(tmp_path / "ct", tmp_path / "back")
    assert QuantScheme.load(tmp_path / "back").kv_cache == "fp8"
    model = load_model(tmp_path / "back", dtype=torch.float32)
    assert len(model.kv_scales) == layers
    for i, (k, v) in model.kv_scales.items():
        assert torch.equal(k, torch.full((n_kv,), 0.5 + i)) and torch.equal(v, torch.full((n_kv,), 0.25 + i))
    with pytest.raises(QinferError, match="no static kv_cache_scheme saying which cache dtype they scale"):
        import_folder(without_scheme, tmp_path / "refused")
    assert not (tmp_path / "refused").exists()
    # scales that would read every cached key back as NaN or 0, and a k_scale without its v_scale: refused
    for bad in (float("nan"), float("inf"), 0.0, -1.0, None):
        damaged = dict(tensors)
        if bad is None:
            del damaged["model.layers.1.self_attn.v_scale"]
        else:
            damaged["model.layers.1.self_attn.k_scale"] = torch.tensor([bad])
        save_file(damaged, tmp_path / "ct" / "model.safetensors")
        want = "k_scale has no v_scale beside it" if bad is None else f"k_scale holds {bad:g}, not a finite positive"
        with pytest.raises(QinferError, match=want):
            import_folder(tmp_path / "ct", tmp_path / "refused")
        assert not (tmp_path / "refused").exists()


def test_kv_cache_scales_the_format_cannot_place_are_refused_on_load(quantized, tmp_path):
    folder = shutil.copytree(quantized / "int4-sym", tmp_path / "q")
    tensors = load_file(folder / "model.safetensors")
    n_kv = json.loads((folder / "config.json").read_text())["num_key_value_heads"]
    tensors["model.layers.0.self_attn.k_scale"], tensors["model.layers.0.self_attn.v_scale"] = torch.ones(2, n_kv)
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(QinferError, match="says kv_cache none"):  # scales for an unknown cache dtype
        load_model(folder)
    scheme = json.loads((folder / QUANT_CONFIG_FILE).read_text())
    (folder / QUANT_CONFIG_FILE).write_text(json.dumps({**scheme, "kv_cache": "int8"}))
    tensors["model.layers.0.self_attn.k_scale"] = torch.tensor(1.0)
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(QinferError, match=r"layers.0.self_attn.k_scale has shape \(\), not one per KV head"):
        load_model(folder)
    config = json.loads((folder / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    tensors["model.layers.0.self_attn.k_scale"] = torch.ones(n_kv, head_dim + 8)
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(QinferError, match=rf"k_scale has shape \({n_kv}, {head_dim + 8}\), not one per KV head and ch"):
        load_model(folder)
    layers = config["num_hidden_layers"]
    for i in range(layers):  # per channel (k) beside per head (v), in every layer: loads
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.full((n_kv, head_dim), 0.5)
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.ones(n_kv)
    save_file(tensors, folder / "model.safetensors")
    assert [tuple(t.shape) for t in load_model(folder).kv_scales[layers - 1]] == [(n_kv, head_dim), (n_kv,)]
    del tensors["model.layers.1.self_attn.k_scale"], tensors["model.layers.1.self_attn.v_scale"]
    save_file(tensors, folder / "model.safetensors")  # scales on some layers only: the others' were lost
    with pytest.raises(QinferError, match="layer 1 has no KV-cache scales but the others do: the checkpoint is "
                                          "incomplete; quantize the original model again with --kv-cache"):
        load_model(folder)
    for i in range(2, layers):
        del tensors[f"model.layers.{i}.self_attn.k_scale"], tensors[f"model.layers.{i}.self_attn.v_scale"]
    for value in (float("nan"), float("inf"), 0.0, -0.5):  # NaN reads every key back as NaN, 0 as 0
        tensors["model.layers.0.self_attn.k_scale"] = torch.full((n_kv,), value)
        tensors["model.layers.0.self_attn.v_scale"] = torch.ones(n_kv)
        save_file(tensors, folder / "model.safetensors")
        with pytest.raises(QinferError, match=rf"model.layers.0.self_attn.k_scale holds {value:g}, not a finite"):
            load_model(folder)
    del tensors["model.layers.0.self_attn.k_scale"]  # a lone v_scale was dropped without a word
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(QinferError, match="layer 0 has a v_scale but no k_scale"):
        load_model(folder)
