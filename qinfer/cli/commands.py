"""The ``qinfer`` command line. Each command builds a dataclass and calls a library function."""

import re
import signal
import sys
from pathlib import Path

import click

from qinfer.cli.command import Group
from qinfer.errors import QinferError, Terminated

DTYPES = ("bf16", "fp32")


@click.group(cls=Group)
@click.version_option(package_name="qinfer-llm")
def cli():
    """qinfer: quantize a model, run it, and measure what the quantization cost."""


def _open(model: str, dtype: str):
    import torch

    from qinfer.model.loader import load_model
    from qinfer.sources.resolve import resolve_model
    from qinfer.sources.tokenizer import Tokenizer

    folder = resolve_model(model)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    return load_model(folder, dtype=torch_dtype, device=device, run=True), Tokenizer.from_folder(folder)


def _kv_scales_note(lm, model: str, kv_cache: str) -> None:
    """Say on stderr when an int8 KV cache has no calibrated scales to use (its accuracy then suffers)."""
    if kv_cache == "int8" and not getattr(lm, "kv_scales", None):
        # int8's even steps suffer from a few wide channels setting a position's range (measured in docs/format.md);
        # FP8's relative precision barely does: no note there
        click.echo(f"note: {model} stores no KV-cache scales, so the int8 cache scales each position's keys and "
                   "values alike over their channels (less accurate: quantizing the original model with --kv-cache "
                   "int8 calibrates scales per channel)", err=True)


def _sampling_options(f):
    f = click.option("--seed", type=int, default=None, help="Random seed for sampling.")(f)
    f = click.option("--top-k", type=int, default=0, show_default=True, help="Keep the k most likely tokens (0 = all).")(f)
    f = click.option("--top-p", type=float, default=1.0, show_default=True, help="Nucleus sampling mass.")(f)
    f = click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy.")(f)
    f = click.option("--max-tokens", type=int, default=128, show_default=True, help="Tokens to generate at most.")(f)
    f = click.option("--dtype", type=click.Choice(DTYPES), default="bf16", show_default=True)(f)
    return f


def _kv_cache_option(f):
    return click.option(
        "--kv-cache", type=click.Choice(["bf16", "int8", "fp8"]), default="bf16", show_default=True,
        help="KV-cache dtype; int8 and fp8 scale each position per KV head as it is written, over the channel "
             "scales `quantize --kv-cache` stored (1 without them).",
    )(f)


def _compile_option(f):
    return click.option(
        "--compile", "compiled", is_flag=True,
        help="Decode through torch.compile (inductor): the decode step compiles at the second token, then runs "
             "somewhat faster than eager (measured in docs/results.md); needs a C++ compiler.",
    )(f)


@cli.command()
@click.argument("name")
@click.option("--force", is_flag=True, help="Download and convert again even if cached.")
def pull(name, force):
    """Fetch a built-in model into the cache and convert it to a safetensors folder."""
    from qinfer.sources.registry import pull as pull_model

    click.echo(pull_model(name, force=force))


@cli.command(name="list")
def list_models():
    """Show the built-in models and which are cached."""
    from qinfer.store.manifest import damage
    from qinfer.store.paths import cache_root
    from qinfer.sources.registry import BUILTINS, is_pulled, model_dir

    for spec in BUILTINS.values():
        folder = model_dir(spec.name)
        broken = damage(folder) if (folder / "config.json").exists() else ""
        state = f"cached at {folder}" if is_pulled(spec.name) else "not pulled"
        if broken:
            state = f"damaged ({broken}): `qinfer pull {spec.name}` converts it again"
        click.echo(f"{spec.name:24s} {state}\n{'':24s} {spec.description}")
    from qinfer.format import QUANT_CONFIG_FILE

    # (not a dot-folder: a conversion killed outright, or the folder a replaced one moved to, left behind)
    converted = sorted(cache_root().joinpath("converted").glob("*/config.json"))
    for c in (c for c in converted if not c.parent.name.startswith(".")):  # a GGUF dequantized to bf16, or a GPTQ / compressed-tensors folder in the qinfer format
        kind = "(imported)" if (c.parent / QUANT_CONFIG_FILE).exists() else "(converted gguf)"
        broken = damage(c.parent)
        click.echo(f"{kind:24s} {c.parent}" + (f" damaged ({broken}): made again on next use" if broken else ""))
    quantized = sorted(cache_root().joinpath("quantized").glob(f"*/{QUANT_CONFIG_FILE}"))
    for q in (q for q in quantized if not q.parent.name.startswith(".")):  # the main job's models (not temp folders)
        click.echo(f"{'(qinfer demo)':24s} {q.parent}")


def _size(text: str) -> int:
    """Bytes in ``text``: a number with an optional unit (``512MiB``, ``2GiB``, ``1.5GB``, ``4096``)."""
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30}
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).upper() not in units:
        raise click.BadParameter(f"{text!r} is not a size (a number of bytes, or with a unit: 512MiB, 2GiB, 1.5GB)")
    return int(float(match.group(1)) * units[match.group(2).upper()])


def _engine_options(f):
    f = click.option("--max-running", type=int, default=64, show_default=True,
                     help="Requests decoding at once (--prompts); more wait their turn.")(f)
    f = click.option("--kv-memory", default="1GiB", show_default=True,
                     help="Memory for the KV cache with --prompts (e.g. 512MiB, 2GiB): more holds more requests at "
                          "once; too little preempts and recomputes, never fails.")(f)
    return f


@cli.command()
@click.argument("model")
@click.argument("prompt", required=False)
@click.option("--prompts", "prompts_file", type=click.Path(dir_okay=False), default=None,
              help="A JSON-lines file of requests ({\"prompt\": ...} or {\"messages\": [...]}, and any sampling "
                   "field) to run together: one JSON result line each on stdout, in input order.")
@_sampling_options
@_kv_cache_option
@_compile_option
@_engine_options
def generate(model, prompt, prompts_file, dtype, max_tokens, temperature, top_p, top_k, seed, kv_cache, compiled,
             kv_memory, max_running):
    """Continue PROMPT with MODEL, streaming tokens to stdout; a timing line goes to stderr. With --prompts FILE
    instead, run every request in FILE together (continuous batching) and write one JSON line per request."""
    from qinfer.engine.generate import GenerationStats, compile_failure_note
    from qinfer.engine.generate import generate as run
    from qinfer.engine.sampling import SamplingParams
    from qinfer.sources.tokenizer import StreamDecoder

    if (prompt is None) == (prompts_file is None):
        raise QinferError("give a PROMPT or --prompts FILE (one of them)")
    if prompts_file is not None and compiled:
        raise QinferError("--compile runs one prompt; --prompts runs on the engine without it: drop --compile")
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    if prompts_file is not None:
        return _generate_batch(model, prompts_file, dtype, params, kv_cache, _size(kv_memory), max_running)
    lm, tok = _open(model, dtype)
    _kv_scales_note(lm, model, kv_cache)
    stats = GenerationStats()
    ids = tok.encode(prompt)
    stream = StreamDecoder(tok, context=ids[-1:])  # the prompt is printed as given: continue it from its last token
    tokens = run(lm, ids, params, stop_ids=tok.eos_ids, stats=stats, compiled=compiled,  # checked
                 kv_dtype=kv_cache)
    sys.stdout.write(prompt)
    try:
        for token in tokens:
            sys.stdout.write(stream.feed(token))
            sys.stdout.flush()
    except KeyboardInterrupt:  # Ctrl-C stops the continuation: end its line, say how far it got
        sys.stdout.write(stream.flush() + "\n")
        sys.stdout.flush()
        click.echo(f"stopped (Ctrl-C): {stats.summary() if stats.generated_tokens else 'before the first token'}",
                   err=True)
        raise SystemExit(128 + signal.SIGINT) from None
    except (Exception, Terminated):  # a failure or SIGTERM mid-way: its Error line must not run on after the text
        sys.stdout.write("\n")
        sys.stdout.flush()
        raise
    sys.stdout.write(stream.flush() + "\n")
    click.echo(stats.summary(), err=True)
    if compiled and compile_failure_note():
        click.echo(compile_failure_note(), err=True)


def _generate_batch(model, prompts_file, dtype, params, kv_cache, kv_memory, max_running):
    """``generate --prompts``: read and check every request, then run them together on the engine."""
    import json
    import time

    from tqdm import tqdm

    from qinfer.engine.batch import read_requests, run_requests
    from qinfer.engine.engine import Engine, EngineConfig

    lm, tok = _open(model, dtype)
    requests = read_requests(prompts_file, tok, params)
    _kv_scales_note(lm, model, kv_cache)
    config = EngineConfig(kv_dtype=kv_cache, kv_memory=kv_memory, max_running=max_running,
                          max_step_tokens=max(EngineConfig.max_step_tokens, max_running + EngineConfig.prefill_chunk))
    engine = Engine(lm, tok, config)
    start, tokens = time.perf_counter(), 0
    with tqdm(total=len(requests), desc="requests", unit="req", file=sys.stderr) as bar:
        for line in run_requests(engine, requests, on_end=lambda out: bar.update(1)):
            tokens += line["completion_tokens"]
            sys.stdout.write(json.dumps(line, ensure_ascii=False) + "\n")
            sys.stdout.flush()
    seconds = time.perf_counter() - start
    click.echo(f"{len(requests)} requests, {tokens} tokens generated in {seconds:.1f} s ({tokens / seconds:.1f} "
               f"tok/s), {engine.steps} steps, {engine.preemptions} preemptions", err=True)


@cli.command()
@click.argument("model")
@click.option("--system", default=None, help="System prompt.")
@_sampling_options
@_kv_cache_option
@_compile_option
def chat(model, system, dtype, max_tokens, temperature, top_p, top_k, seed, kv_cache, compiled):
    """Chat with MODEL in the terminal using its chat template. /reset clears, /exit (or EOF) quits."""
    from qinfer.engine.chat import ChatSession, repl
    from qinfer.engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    lm, tok = _open(model, dtype)
    _kv_scales_note(lm, model, kv_cache)
    if compiled:
        click.echo("note: --compile: the first reply pauses after its first token while the decode step compiles "
                   "(once per session)", err=True)
    repl(ChatSession(lm, tok, params, system=system, compiled=compiled, kv_dtype=kv_cache))


@cli.command()
@click.argument("model")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on; anything but loopback reaches other machines (set --api-key).")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True, help="0 = any free port.")
@click.option("--kv-cache", type=click.Choice(["auto", "bf16", "int8", "fp8"]), default="auto", show_default=True,
              help="KV-cache dtype; auto = the dtype MODEL's stored KV scales were calibrated for "
                   "(`quantize --kv-cache`), else bf16.")
@click.option("--kv-memory", default="1GiB", show_default=True,
              help="Memory for the KV cache (e.g. 512MiB, 2GiB): more holds more requests at once; too little "
                   "preempts and recomputes, never fails.")
@click.option("--max-batch", type=click.IntRange(min=1), default=64, show_default=True,
              help="Requests decoding at once; more wait their turn.")
@click.option("--max-waiting", type=click.IntRange(min=1), default=256, show_default=True,
              help="Requests that may wait; beyond it a request is refused (HTTP 503, retry later).")
@click.option("--api-key", default=None, envvar="QINFER_API_KEY", show_envvar=True,
              help="Require 'Authorization: Bearer KEY' on /v1/ requests.")
@click.option("--name", default=None, help="The model's name in the API (default: MODEL's).")
@click.option("--dtype", type=click.Choice(DTYPES), default="bf16", show_default=True)
@click.option("--grace", type=click.FloatRange(min=0), default=10.0, show_default=True,
              help="Seconds requests in flight may take to finish after SIGTERM or Ctrl-C before they are cancelled.")
def serve(model, host, port, kv_cache, kv_memory, max_batch, max_waiting, api_key, name, dtype, grace):
    """Serve MODEL over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions) with a web chat
    page at /, metrics at /metrics; requests run together on the engine (continuous batching)."""
    import ipaddress

    from qinfer.engine.engine import Engine, EngineConfig
    from qinfer.server.app import create_app
    from qinfer.server.runner import EngineRunner
    from qinfer.server.serve import bind, run, url

    if api_key is not None and not api_key.strip():
        raise QinferError("--api-key is empty: give a key, or drop --api-key")
    memory = _size(kv_memory)
    sock = bind(host, port)  # before the model loads: a port in use is said at once
    try:
        loopback = ipaddress.ip_address(sock.getsockname()[0]).is_loopback
        if not loopback and api_key is None:
            click.echo(f"warning: listening on {host} without --api-key: anyone who reaches this machine can use the "
                       "server", err=True)
        lm, tok = _open(model, dtype)
        if kv_cache == "auto":
            kv_cache = _stored_kv_dtype(model)
        _kv_scales_note(lm, model, kv_cache)
        config = EngineConfig(kv_dtype=kv_cache, kv_memory=memory, max_running=max_batch,
                              max_step_tokens=max(EngineConfig.max_step_tokens, max_batch + EngineConfig.prefill_chunk))
        runner = EngineRunner(Engine(lm, tok, config), max_waiting=max_waiting)
        name = name or _model_name(model)
        where = url(sock)

        def ready():
            click.echo(f"qinfer serve: {name} at {where} (chat page {where}/, OpenAI API {where}/v1; KV cache "
                       f"{kv_cache}, {runner.engine.cache.num_blocks} blocks of {config.block_size} tokens); "
                       "Ctrl-C stops")

        started = run(create_app(runner, tok, name, api_key=api_key, on_ready=ready), sock, runner, grace)
    finally:
        sock.close()
    if runner.failure is not None:
        raise QinferError(f"{runner.failure} (a bug: please report it with the traceback above)")
    if not started:
        raise QinferError("the HTTP server did not start (its error is above)")
    click.echo("qinfer serve: stopped")


def _stored_kv_dtype(model: str) -> str:
    """The KV-cache dtype MODEL's stored scales were calibrated for, else bf16."""
    from qinfer.format import QUANT_CONFIG_FILE, QuantScheme
    from qinfer.sources.resolve import resolve_model

    folder = resolve_model(model)
    if (folder / QUANT_CONFIG_FILE).exists():
        stored = QuantScheme.load(folder).kv_cache
        if stored in ("int8", "fp8"):
            return stored
    return "bf16"


def _model_name(model: str) -> str:
    """What the API calls MODEL: a built-in's name, or a folder's or file's own name."""
    path = Path(model).expanduser()
    if path.exists():
        return path.resolve().name.removesuffix(".gguf") or "model"
    return model.rstrip("/").rsplit("/", 1)[-1]


@cli.command()
@click.argument("model")
@click.option("-o", "--out", type=click.Path(),
              help="Output folder (written atomically); default: MODEL's name and the scheme's in this folder, "
                   "e.g. ./gemma3-270m-gptq-w4g128.")
@click.option("--bits", type=int, default=4, show_default=True, help="2, 3, 4 or 8 (8 with --format fp8 for FP8).")
@click.option("--method", type=click.Choice(["gptq", "awq", "rtn"]), default="gptq", show_default=True)
@click.option("--group-size", type=int, default=128, show_default=True,
              help="32, 64, 128, or -1 for per-channel; not given: 128, or the largest that divides every K.")
@click.option("--sym/--asym", default=None,
              help="Symmetric (implicit zero) or asymmetric (a zero point per group; the default for integers, "
                   "more accurate on gemma3-270m, see docs/results.md). FP8 is always symmetric.")
@click.option("--act-order/--no-act-order", default=None,
              help="GPTQ: visit columns by decreasing Hessian diagonal, with static groups (default on for GPTQ).")
@click.option("--format", "fmt", type=click.Choice(["int", "fp8"]), default="int", show_default=True,
              help="fp8: E4M3 weights, per-channel scales; --method gptq (default) adds error feedback, rtn rounds.")
@click.option("--kv-cache", type=click.Choice(["none", "int8", "fp8"]), default="none", show_default=True,
              help="Calibrate KV-cache scales for this cache dtype.")
@click.option("--calib", default="austen", show_default=True, help="austen, a .txt or .jsonl file, or a dataset name.")
@click.option("--samples", type=int, default=128, show_default=True)
@click.option("--seq-len", type=int, default=512, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--quantize-lm-head/--no-quantize-lm-head", default=None,
              help="Quantize the lm_head (and a tied embedding, read from it) to --lm-head-bits integers in the "
                   "linears' groups. Default on for --format int (most of a small model's bytes a decode step); "
                   "off for fp8, where --quantize-lm-head stores it in FP8.")
@click.option("--lm-head-bits", type=int, default=8, show_default=True,
              help="Bits of the quantized lm_head (--format int): 2, 3, 4 or 8.")
@click.option("--tune-steps", type=int, default=0, show_default=True,
              help="After each block is quantized, tune its group scales and norms for N steps towards the "
                   "unquantized model's block output (integer formats; each step is a forward and backward pass of one "
                   "block over --tune-batch samples; docs/results.md has measured times).")
@click.option("--tune-rounding", is_flag=True,
              help="With --tune-steps: also learn which way each weight rounds (one level up or down from the "
                   "quantizer's), by signed gradient descent as in AutoRound.")
@click.option("--e2e-steps", type=int, default=0, show_default=True,
              help="After all blocks, tune every group scale and norm for N steps (one calibration sample each) on the "
                   "KL divergence to the unquantized model's next-token distribution (integer formats; each step is a "
                   "forward and backward pass of the whole model).")
@click.option("--tune-batch", type=int, default=4, show_default=True,
              help="Calibration samples per --tune-steps step (the step's time grows in proportion).")
@click.option("--tune-lr", type=float, default=2e-3, show_default=True,
              help="Learning rate of --tune-steps and --e2e-steps.")
@click.option("--tune-holdout", type=int, default=0, show_default=True,
              help="With --tune-steps: keep N calibration samples out of the steps and keep, per block, the "
                   "parameters of the check (every steps/10) with the least output error on them.")
@click.option("--mse-clip/--no-mse-clip", default=None,
              help="Integer formats: each group's range is the shrink of its min/max (1, 0.99, ..., 0.21x) "
                   "with the least |w - q(w)|^2.4, instead of the min/max itself. Default on for GPTQ, off for RTN "
                   "(the plain baseline); AWQ searches its own clipping.")
@click.option("--true-sequential/--no-true-sequential", default=None,
              help="GPTQ (default on) and AWQ (default off): inside each block too, calibrate each linear group "
                   "(GPTQ's Hessian; AWQ's scale and clip search) after the groups before it (q/k/v, o, gate/up, "
                   "down) are quantized, running the block in stages. Off: one capture of every group on the "
                   "unquantized block, then a second forward for its output.")
@click.option("--fp-target", is_flag=True,
              help="GPTQ and AWQ: fit each linear to the unquantized model's output on the unquantized model's inputs "
                   "(asymmetric calibration, as GPTAQ), not to its own output on the quantized model's inputs; "
                   "runs an unquantized stream beside the quantized one and implies --true-sequential (slower, "
                   "one more [samples, seq-len, hidden] activation buffer).")
@click.option("--fp-target-damp", type=float, default=None,
              help="--fp-target: ridge of each linear's fit to the unquantized output, as a fraction of the mean "
                   "of diag(X^T X) (default 0.3; GPTQ's own damping stays 0.01).")
@click.option("--keep-bos/--no-keep-bos", default=True, show_default=True,
              help="Store what the unquantized model computes at a leading BOS token (each layer's keys and values, "
                   "as IntactKV, and the output), use it there at inference instead of the quantized model's, and "
                   "leave that position out of the calibration statistics (models with a BOS token).")
@click.option("--force", is_flag=True, help="Replace OUT if it is a model folder (one with config.json) or empty.")
def quantize(model, out, bits, method, group_size, sym, act_order, fmt, kv_cache, calib, samples, seq_len, seed,
             quantize_lm_head, lm_head_bits, tune_steps, tune_rounding, e2e_steps, tune_batch, tune_lr, tune_holdout,
             mse_clip, true_sequential, fp_target, fp_target_damp, keep_bos, force):
    """Quantize MODEL into the qinfer format (safetensors + quant_config.json) at OUT."""
    from qinfer.store.atomic import check_output
    from qinfer.pipeline.config import CalibConfig, TuneConfig, check_settings, quant_scheme, uses_calibration
    from qinfer.pipeline.quantize import quantize_model
    from qinfer.sources.resolve import resolve_model

    if out is not None:
        _check_out_name(out)
    ctx = click.get_current_context()
    given = {name for name in ctx.params if ctx.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE}
    if "lm_head_bits" in given and not (fmt == "int" if quantize_lm_head is None else quantize_lm_head):
        fix = "drop --no-quantize-lm-head" if quantize_lm_head is False else "add --quantize-lm-head"
        raise QinferError(f"--lm-head-bits sets the bits of a quantized lm_head: {fix}, or drop --lm-head-bits")
    if fmt == "fp8":  # GPTQ's error feedback onto the FP8 grid, or (--method rtn) plain round to nearest
        if "group_size" in given and group_size != -1:
            raise QinferError("--format fp8 scales each output channel, not groups: drop --group-size")
        if "lm_head_bits" in given and lm_head_bits != 8:
            raise QinferError("--format fp8 quantizes the lm_head to FP8 (8 bits): drop --lm-head-bits")
    # options not given take the library's defaults for the method and format (qinfer.pipeline.config)
    scheme = quant_scheme(method, format=fmt, symmetric=sym, act_order=act_order, mse_clip=mse_clip, kv_cache=kv_cache,
                          quantize_lm_head=quantize_lm_head, **{name: value for name, value in
                          (("bits", bits), ("group_size", group_size), ("lm_head_bits", lm_head_bits)) if name in given})
    if "tune_lr" in given and not (tune_steps or e2e_steps):
        raise QinferError("--tune-lr is the rate of the tuning stages: add --tune-steps N or --e2e-steps N, or drop it")
    if "tune_batch" in given and not tune_steps:
        raise QinferError("--tune-batch is the block tuning stage's batch: add --tune-steps N, or drop it")
    if fp_target_damp is not None and not fp_target:
        raise QinferError("--fp-target-damp sets the ridge of --fp-target's fit: add --fp-target, or drop it")
    calib_config = CalibConfig(source=calib, samples=samples, seq_len=seq_len, seed=seed, true_sequential=true_sequential,
                               fp_target=fp_target, keep_bos=keep_bos,
                               fp_target_damp=CalibConfig.fp_target_damp if fp_target_damp is None else fp_target_damp)
    tune = TuneConfig(steps=tune_steps, lr=tune_lr, batch=tune_batch, e2e_steps=e2e_steps, seed=seed,
                      rounding=tune_rounding, holdout=tune_holdout)
    check_settings(scheme, calib_config, tune)  # a refusal comes alone, not after notes on the settings it refuses
    unused = [f"--{name.replace('_', '-')}" for name in ("calib", "samples", "seq_len", "seed") if name in given]
    if unused and not uses_calibration(scheme, tune):
        click.echo(f"note: --method rtn rounds to nearest and reads no calibration text: {', '.join(unused)} "
                   "not used (--kv-cache or --tune-steps would use them)", err=True)
    train = samples - tune_holdout  # the samples the block tuning steps draw from (none: refused later)
    if tune_steps and 0 < train < tune_batch:
        click.echo(f"note: --tune-batch {tune_batch} is more than the {train} sample{'s' * (train != 1)} the tuning "
                   f"steps draw from (--samples less --tune-holdout): each batch takes {train}", err=True)
    from qinfer.interop.folders import foreign_quant_method

    path = Path(model).expanduser()
    if (path / "config.json").is_file() and foreign_quant_method(path) is not None:  # before converting it
        raise QinferError(f"{model} is already quantized ({foreign_quant_method(path)}): quantize the original "
                          "model instead")
    source = None
    if out is None:  # named after the group size the run will use (the largest that fits, unless one was given)
        from qinfer.pipeline.preflight import fitted_scheme

        source = resolve_model(model)
        out = _default_out(model, scheme if "group_size" in given else fitted_scheme(source, scheme))
    if path.exists():  # the path given, not only the copy in the cache a GGUF or GPTQ folder is converted into
        check_output(Path(out), force, source=path)
    # Ctrl-C: exit 130 with the line every command gives (OUT as it was, or complete if the rename had begun)
    report = quantize_model(source or resolve_model(model), out, scheme, calib_config, force=force, tune=tune,
                            fit_group_size="group_size" not in given)
    click.echo(report.summary())


@cli.command()
@click.argument("model")
@click.option("-o", "--out", required=True, type=click.Path(), help="Output folder (written atomically).")
@click.option("--format", "fmt", type=click.Choice(["gptq", "compressed-tensors"]), required=True,
              help="gptq: GPTQ v1 (GPTQModel, AutoGPTQ, vLLM). compressed-tensors: llm-compressor and vLLM.")
@click.option("--force", is_flag=True, help="Replace OUT if it is a model folder (one with config.json) or empty.")
def export(model, out, fmt, force):
    """Write the qinfer-quantized MODEL as a GPTQ or compressed-tensors checkpoint at OUT."""
    from qinfer.store.atomic import check_output
    from qinfer.interop.folders import export_folder
    from qinfer.sources.resolve import resolve_model

    _check_out_name(out)
    if Path(model).expanduser().exists():  # the path given, not only its converted copy in the cache
        check_output(Path(out), force, source=Path(model).expanduser())
    report = export_folder(resolve_model(model), out, fmt, force=force)
    click.echo(f"wrote {report.out} ({fmt}, {report.linears} quantized linears)")
    for note in report.notes:
        click.echo(f"note: {note}")


@cli.command(name="eval")
@click.argument("models", nargs=-1, required=True)
@click.option("--baseline", default=None, help="Reference model for KL and agreement (default: the first MODEL).")
@click.option("--text", default="heldout", show_default=True, help="heldout (Austen's Persuasion) or a UTF-8 file.")
@click.option("--max-tokens", type=int, default=2048, show_default=True, help="Tokens of the text to score.")
@click.option("--window", type=int, default=512, show_default=True, help="Perplexity window (tokens).")
@click.option("--stride", type=int, default=None, help="Window advance (tokens)  [default: half the window]")
@click.option("--tasks", default="arc_easy,piqa", show_default=True,
              help="Comma-separated multiple-choice tasks (arc_easy, arc_challenge, boolq, copa, csqa, hellaswag, "
                   "openbookqa, piqa, sciq, socialiqa; BIG-bench task names with --bigbench-sdist), or none.")
@click.option("--limit", type=int, default=250, show_default=True, help="Examples per task.")
@click.option("--bigbench-sdist", type=click.Path(dir_okay=False), default=None,
              help="A copy of bigbench-1.0.0.tar.gz, for BIG-bench task names (PyPI no longer serves it).")
@click.option("--speed/--no-speed", default=True, show_default=True, help="Measure prefill/decode speed, MBU, MFU.")
@_kv_cache_option
@click.option("--prompt-tokens", type=int, default=512, show_default=True, help="Prompt length for prefill speed.")
@click.option("--decode-steps", type=int, default=16, show_default=True, help="Decode steps per speed run.")
@click.option("--repeats", type=int, default=3, show_default=True, help="Speed runs (medians are reported).")
@click.option("--compile", "compiled", is_flag=True, default=False,
              help="Also time the decode step through torch.compile, as generate --compile runs it (compiled "
                   "tok/s and MBU columns; each model is compiled first).")
@click.option("--out", default="qinfer-results", show_default=True, help="Folder for the results and plots.")
@click.option("--no-cache", is_flag=True, help="Measure again instead of reusing cached results.")
def eval_models(models, baseline, text, max_tokens, window, stride, tasks, limit, bigbench_sdist, speed, kv_cache,
                prompt_tokens, decode_steps, repeats, compiled, out, no_cache):
    """Accuracy (perplexity, KL, multiple-choice tasks) against speed against the roofline, for each MODEL."""
    from qinfer.evals.report import format_table
    from qinfer.evals.runner import EvalConfig, missing_tasks_line, run_eval

    task_list = () if tasks.strip().lower() == "none" else tuple(t.strip() for t in tasks.split(",") if t.strip())
    if not task_list and tasks.strip().lower() != "none":
        raise QinferError(f"--tasks {tasks!r} names no task: give a comma-separated list, or none")
    _check_out_name(out)
    config = EvalConfig(models=models, baseline=baseline, text=text, max_tokens=max_tokens, window=window,
                        stride=stride, tasks=task_list, limit=limit, bigbench_sdist=bigbench_sdist, speed=speed,
                        kv_cache=kv_cache, prompt_tokens=prompt_tokens, decode_steps=decode_steps, repeats=repeats,
                        compiled=compiled, out=out, cache=not no_cache)
    results = run_eval(config)
    click.echo(format_table(results))
    if results[0].missing_tasks:
        click.echo(f"note: {missing_tasks_line(results[0].missing_tasks)}")
    click.echo(f"wrote results.json, results.md, pareto.png{', roofline.png' if speed else ''} to {out}")


@cli.command()
@click.option("--force", is_flag=True, help="Measure again even if a cached roofline matches this machine.")
def roofline(force):
    """Measure (or show the cached) memory bandwidth and matmul peaks of this machine."""
    import torch

    from qinfer.evals.roofline import format_roofline, measure_roofline

    click.echo(format_roofline(measure_roofline("cuda" if torch.cuda.is_available() else "cpu", force=force)))


@cli.command()
@click.option("--out", default="qinfer-results", show_default=True, help="Folder for the results and plots.")
def demo(out):
    """The main job: pull gemma3-270m, quantize it (RTN, GPTQ, AWQ 4-bit; FP8), eval all, plot."""
    from qinfer.evals.main_job import MainJobConfig, run_main_job

    run_main_job(MainJobConfig(out=out))


def _default_out(model: str, scheme) -> str:
    """``<model's name>-<scheme's tag>`` in the current folder: ``gemma3-270m-gptq-w4g128``."""
    path = Path(model).expanduser()
    name = path.resolve().name if path.exists() else model.rstrip("/").rsplit("/", 1)[-1]
    return f"{name.removesuffix('.gguf') or 'model'}-{scheme.tag}"


def _check_out_name(out: str) -> None:
    if not out.strip():
        raise QinferError("--out is empty: name a folder (--out . for this one)")


def main():
    try:
        cli(prog_name="qinfer", standalone_mode=True)
    except KeyboardInterrupt:
        click.echo("Error: interrupted", err=True)
        sys.exit(130)
    finally:  # the command is over and has said how: a Ctrl-C now would only interrupt the interpreter's exit
        signal.signal(signal.SIGINT, signal.SIG_IGN)


if __name__ == "__main__":  # `python -m qinfer.cli.commands`, the same as `python -m qinfer.cli` and `python -m qinfer`
    main()
