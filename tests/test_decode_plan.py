"""A decode step's layers in one C call (``qinfer.model.decode_plan``): the eager layers' outputs bit for bit, at
batch 1 (``decode_step``) and over an engine's rows; the greedy tokens of the built-in models the same as the
eager path's (slow)."""

import contextlib

import pytest
import torch

from qinfer.engine.engine import Engine, EngineConfig
from qinfer.engine.generate import decode_step, generate, prefill
from qinfer.engine.sampling import SamplingParams
from qinfer.format import QuantScheme
from qinfer.kernels import cpu_library, decode_cpu
from qinfer.model.decode_plan import layer_by_layer, plan_for
from qinfer.model.kv_cache import make_cache
from qinfer.model.loader import load_model
from qinfer.pipeline.config import CalibConfig
from qinfer.pipeline.quantize import quantize_model
from tests.tiny_models import make_model

needs_kernels = pytest.mark.skipif(not cpu_library.available(), reason="the C kernels are not built here")

SCHEMES = {
    "bf16": None,
    "rtn int4": QuantScheme(method="rtn", bits=4, group_size=32, symmetric=False),
    "rtn int8": QuantScheme(method="rtn", bits=8, group_size=32, symmetric=True),
    "fp8": QuantScheme(method="fp8", format="fp8", bits=8, group_size=-1),
}


@pytest.fixture
def calls(monkeypatch):
    """How many times the one C call ran."""
    count = [0]
    run = decode_cpu.decode_layers

    def counted(model, step):
        count[0] += 1
        return run(model, step)

    monkeypatch.setattr(decode_cpu, "decode_layers", counted)
    return count


def _model(tmp_path, kind: str, scheme: str):
    folder = tmp_path / "src"
    make_model(kind, folder)
    if SCHEMES[scheme] is not None:
        quantize_model(folder, tmp_path / "q", SCHEMES[scheme], CalibConfig(samples=2, seq_len=16))
        folder = tmp_path / "q"
    return load_model(folder, run=True)


def _decode(model, ids: torch.Tensor, steps: int) -> torch.Tensor:
    """Logits [steps, B, V] of greedy decode steps after ``ids`` [B, T]."""
    cache = make_cache(model, ids.shape[0], ids.shape[1] + steps, "bf16")
    with torch.no_grad():
        token, logits = prefill(model, ids, cache).argmax(-1), []
        for pos in range(ids.shape[1], ids.shape[1] + steps):
            logits.append(decode_step(model, token, pos, cache))
            token = logits[-1].argmax(-1)
    return torch.stack(logits)


@needs_kernels
@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "mistral", "gemma3"])
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_a_decode_step_in_one_call_gives_the_eager_logits_bit_for_bit(tmp_path, kind, scheme, calls):
    # qwen2: q/k/v biases; qwen3 and gemma3: q/k norms; mistral and gemma3: sliding windows the steps pass
    model = _model(tmp_path, kind, scheme)
    assert plan_for(model) is not None
    for batch in (1, 2):  # 2 rows: in one call where the C GEMVs take 2 rows of every linear (as eagerly)
        ids = torch.randint(2, 300, (batch, 6), generator=torch.Generator().manual_seed(batch))
        before = calls[0]
        fast = _decode(model, ids, 12)
        if batch == 1:
            assert calls[0] - before == 12
        with layer_by_layer():
            eager = _decode(model, ids, 12)
        assert torch.equal(fast, eager)


@needs_kernels
@pytest.mark.parametrize("scheme", ["bf16", "rtn int4"])
def test_an_engines_rows_in_one_call_give_each_request_the_eager_tokens(tmp_path, scheme, calls):
    model = _model(tmp_path, "gemma3", scheme)
    g = torch.Generator().manual_seed(3)
    requests = [(f"r{i}", torch.randint(2, 300, (n,), generator=g).tolist(), SamplingParams(max_tokens=12))
                for i, n in enumerate([1, 7, 16, 3])]
    tokens = {}
    for name, context in (("fast", contextlib.nullcontext), ("eager", layer_by_layer)):
        config = EngineConfig(block_size=8, max_step_tokens=24, max_running=8, prefill_chunk=16)
        engine = Engine(model, config=config, eos_ids=())
        with context():
            outputs = engine.run(requests)
        tokens[name] = {i: [t for o in outs for t in o.token_ids] for i, outs in outputs.items()}
        if name == "fast":
            assert calls[0] > 0
    assert tokens["fast"] == tokens["eager"]


@needs_kernels
def test_a_plan_follows_a_weight_replaced_after_it_was_built(tmp_path, calls):
    model = _model(tmp_path, "llama", "bf16")
    ids = torch.tensor([[1, 7, 7, 300]])
    first = _decode(model, ids, 2)
    plan = plan_for(model)
    k_proj = model.model.layers[0].self_attn.k_proj
    k_proj.weight = torch.nn.Parameter(torch.randn_like(k_proj.weight), requires_grad=False)
    norm = model.model.layers[1].input_layernorm
    norm.weight.data = norm.weight.data * 2  # new data under the same Parameter
    fast = _decode(model, ids, 2)
    assert plan_for(model) is not plan and not torch.equal(fast, first)
    with layer_by_layer():
        assert torch.equal(fast, _decode(model, ids, 2))


@needs_kernels
def test_an_fp32_model_and_a_quantized_kv_cache_run_their_layers_as_modules(tmp_path, calls):
    folder = tmp_path / "m"
    make_model("llama", folder)
    assert plan_for(load_model(folder, dtype=torch.float32, run=True)) is None
    model = load_model(folder, run=True)
    cache = make_cache(model, 1, 8, "int8")
    with torch.no_grad():
        token = prefill(model, torch.tensor([[1, 7, 7]]), cache).argmax(-1)
        decode_step(model, token, 3, cache)
    assert calls[0] == 0


@needs_kernels
def test_the_activation_table_holds_pytorchs_bits():
    x = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    for act, f in (("silu", torch.nn.functional.silu),
                   ("gelu_tanh", lambda t: torch.nn.functional.gelu(t, approximate="tanh"))):
        table = decode_cpu.activation_table(act, torch.bfloat16)
        sample = x[torch.randperm(1 << 16)[:4096]]  # in another order and length than the table's
        got = table[sample.view(torch.int16).to(torch.int32) & 0xFFFF]
        assert torch.equal(got.view(torch.int16), f(sample).view(torch.int16))


HELD_OUT = ["The history of the printing press begins", "def fibonacci(n):\n", "Photosynthesis is the process by",
            "Q: What is the boiling point of water at sea level?\nA:"]


@pytest.mark.slow
@needs_kernels
@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "gemma3-270m"])
@pytest.mark.parametrize("scheme", ["bf16", "rtn int4"])
def test_greedy_tokens_of_the_builtin_models_are_the_eager_paths(tmp_path, name, scheme, calls):
    from qinfer.sources.registry import pull
    from qinfer.sources.tokenizer import Tokenizer

    folder = pull(name)
    tokenizer = Tokenizer.from_folder(folder)
    if scheme != "bf16":
        quantize_model(folder, tmp_path / "q", QuantScheme(method="rtn", bits=4, group_size=64, symmetric=False,
                                                           quantize_lm_head=True),
                       CalibConfig(samples=2, seq_len=16))
        folder = tmp_path / "q"
    model = load_model(folder, run=True)
    params = SamplingParams(max_tokens=32)
    for prompt in HELD_OUT:
        ids = tokenizer.encode(prompt)
        fast = list(generate(model, ids, params))  # the engine, as `qinfer generate` runs it
        with layer_by_layer():
            eager = list(generate(model, ids, params))
        assert fast == eager, prompt
        steps = _decode(model, torch.tensor([ids]), 32)  # decode_step, as `qinfer eval --speed` times it
        with layer_by_layer():
            assert torch.equal(steps, _decode(model, torch.tensor([ids]), 32)), prompt
    assert calls[0] > 0
