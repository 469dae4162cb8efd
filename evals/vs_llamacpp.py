"""qinfer against llama.cpp on the same model and machine, measured side by side.

    python -m qinfer.evals.vs_llamacpp [MODEL ...] [--threads 2] [--repeats 5] [--decode-tokens 128]
        [--prompt-tokens 512] [--out vs-llamacpp.json] [--quantized DIR] [--qinfer-only]

MODEL: built-in names (default: every built-in) or ``.gguf`` files. Each is run by three engines:

- **llama.cpp** (through ``llama-cpp-python``, the optional extra ``llamacpp``) on the very GGUF qinfer pulled
  (``qinfer.sources.registry.fetch_gguf``; a ``.gguf`` MODEL as given);
- **qinfer bf16**: the reference qinfer converts that GGUF to (``resolve_model``);
- **qinfer 4-bit**: the default 4-bit quantization of the reference, found or made as the main job makes it
  (``qinfer.evals.main_job.quantized``: GPTQ, 4 bits, groups of 128, or the largest size below that divides every
  linear, bf16 lm_head, the main job's calibration), or ``--quantized``.

Every run is one subprocess per engine (llama.cpp and torch each start their own thread pools; one process each keeps
them apart), with the same thread count (``--threads``: ``n_threads`` and ``n_threads_batch`` for llama.cpp,
``torch.set_num_threads`` for qinfer, ``OMP_NUM_THREADS`` for both). A round runs every model's engines once, the
engines in an order rotated from round to round; each figure is the median over ``--repeats`` rounds. A run warms up
(a short prefill and two decode steps, then a prefill of the long prompt: pages the weights in, starts the threads,
builds qinfer's weight layouts), then times:

- **decode**: ``--decode-tokens`` greedy steps after a 16-token prompt, the prefill excluded; qinfer through
  :func:`qinfer.evals.speed._run` (``qinfer eval``'s speed run: fresh bf16 KV cache, ``prefill``, ``decode_step``,
  argmax), llama.cpp through ``Llama.eval`` one token at a time and a numpy argmax of its logits;
- **prefill**: the time to the first token of a ``--prompt-tokens`` prompt (prefill and argmax), in one batch
  on llama.cpp where the prompt fits its ``n_batch`` of 512.

Without llama-cpp-python the command stops with one line naming the command that installs it (the extra's
``pip install -e ".[llamacpp]"`` would build llama.cpp natively); ``--qinfer-only`` runs qinfer's two engines alone.

Both engines get the same prompt: ``qinfer eval``'s fixed pseudo-random token ids (the work does not depend on the
tokens), fed as ids, so no tokenizer differs.

Bytes read per decode step, and MBU = bytes x decode tokens/s / ``qinfer roofline``'s read bandwidth (measured at
the run's thread count):

- qinfer: :func:`qinfer.evals.costs.decode_bytes` of the loaded model at the mean context of the decode steps
  (every linear as stored, the lm_head whole, one embedding row, the norms, the bf16 KV cache read);
- llama.cpp (:func:`gguf_decode_bytes`): every tensor of the GGUF at its stored size, except the token embedding,
  of which one row is read (the token's), unless the output projection is tied to it (no ``output.weight``): then
  the projection reads it whole, plus the row; and its f16 KV cache (llama.cpp's default), keys and values of every
  layer at the same mean context (every layer reads every cached position: true while the context stays inside any
  sliding window, as it does at these lengths).

Outputs: a table, the JSON (``--out``, written atomically), and last the headline of the first model, e.g.
``gemma3-270m 4-bit decode = 2.10x llama.cpp Q4_K_M``. Timings on a shared machine vary: compare figures of one run.
Each run records how many CPUs other processes kept busy meanwhile (``/proc/stat`` less this process and the run's
own); above ``qinfer.evals.roofline.BUSY_CPUS`` a note before the headline says the figures may read low. llama.cpp
suffers most: its threads wait for each other at every op, so one descheduled thread stalls the step.
"""

import importlib.util
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import click

# torch (and numpy) only inside functions: the llama.cpp run imports this module, and torch would bring its own
# OpenMP runtime into llama.cpp's process
from qinfer.cli.command import Command
from qinfer.errors import QinferError
from qinfer.store.atomic import write_atomic

LLAMACPP_VERSION = "0.3.36"
LLAMACPP_MODULE = "llama_cpp"  # what llama-cpp-python installs
# a native build (-DGGML_NATIVE=ON, llama-cpp-python's default) crashed on an AMX Xeon: the ISA is named instead
INSTALL = ('CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON '
           f'-DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" pip install llama-cpp-python=={LLAMACPP_VERSION}')
ENGINES = ("llama.cpp", "qinfer bf16", "qinfer 4-bit")
DECODE_PROMPT = 16  # tokens before the timed decode steps
QUANTIZATION = "gptq-w4g128"  # the main job's (and `qinfer quantize`'s) default 4-bit scheme
KV_BYTES = 2  # llama.cpp's default KV cache type, f16


@dataclass(frozen=True)
class BenchConfig:
    models: tuple[str, ...] = ()  # empty: every built-in
    threads: int = 2
    repeats: int = 5
    decode_tokens: int = 128
    prompt_tokens: int = 512
    out: Path = Path("vs-llamacpp.json")
    quantized: Path | None = None  # the 4-bit folder to use instead of the main job's (one MODEL only)
    llamacpp: bool = True

    def __post_init__(self):
        for name in ("threads", "repeats", "decode_tokens", "prompt_tokens"):
            if getattr(self, name) < 1:
                raise QinferError(f"--{name.replace('_', '-')} must be at least 1; got {getattr(self, name)}")
        if self.quantized is not None and len(self.models) != 1:
            raise QinferError("--quantized names one model's 4-bit folder: give exactly one MODEL with it")
        if not str(self.out).strip():
            raise QinferError("--out is empty: name a JSON file")


@dataclass
class EngineResult:
    engine: str  # one of ENGINES
    path: str  # the GGUF or model folder it ran
    decode_bytes: int  # bytes read per decode step
    runs: list[dict] = field(default_factory=list)  # each run's {"decode_tok_s", "prefill_tok_s", "others_cpus"}
    decode_tok_s: float = 0.0  # medians over the runs
    prefill_tok_s: float = 0.0
    mbu: float = 0.0


def llamacpp_missing() -> str | None:
    """The one line that says how to install llama.cpp's binding, or None where it can be imported."""
    if importlib.util.find_spec(LLAMACPP_MODULE) is not None:
        return None
    return (f"llama-cpp-python is not installed (the extra 'llamacpp'); install it with: {INSTALL} "
            "(or pass --qinfer-only)")


def gguf_type(path: Path) -> str:
    """The GGUF's quantization as llama.cpp names it (``general.file_type``), e.g. ``Q4_K_M``."""
    import gguf

    from qinfer.sources.gguf_convert import open_gguf, read_metadata

    file_type = read_metadata(open_gguf(path)).get("general.file_type")
    try:
        return gguf.LlamaFileType(file_type).name.removeprefix("MOSTLY_")
    except ValueError:
        return "GGUF"


def gguf_decode_bytes(path: Path, context: int) -> int:
    """Bytes llama.cpp reads for one decode step of the GGUF at ``path`` with ``context`` positions cached (the rule in
    the module docstring)."""
    from qinfer.sources.gguf_convert import GGUFHParams, open_gguf, read_metadata

    reader = open_gguf(path)
    meta = read_metadata(reader)
    tensors = {t.name: int(t.n_bytes) for t in reader.tensors}
    embedding = next(t for t in reader.tensors if t.name == "token_embd.weight")
    row = int(embedding.n_bytes) // int(embedding.shape[-1])  # ggml order: shape is (hidden, vocab)
    weights = sum(tensors.values()) + row - (0 if "output.weight" not in tensors else tensors["token_embd.weight"])
    hp = GGUFHParams.from_metadata(meta, meta["general.architecture"])
    return weights + hp.num_layers * 2 * hp.num_kv_heads * hp.head_dim * KV_BYTES * context


def prompt_ids(vocab_size: int, tokens: int) -> list[int]:
    """``qinfer eval``'s fixed prompt (:func:`qinfer.evals.speed.checked_prompt`) as a list of ids."""
    import torch

    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab_size, (1, tokens), generator=generator)[0].tolist()


def decode_context(decode_tokens: int) -> int:
    """The mean number of cached positions over the timed decode steps, as :mod:`qinfer.evals.speed` counts it."""
    return round(DECODE_PROMPT + (decode_tokens - 1) / 2)


# --- one run, in its own process ---------------------------------------------------------------------------------

def worker(spec_json: str) -> None:
    """One timed run of one engine (the spec: engine, path, threads, prompt, decode_tokens); prints its figures as
    JSON on the last line of stdout."""
    spec = json.loads(spec_json)
    run = _llamacpp_run if spec["engine"] == "llama.cpp" else _qinfer_run
    print(json.dumps(run(spec["path"], spec["threads"], spec["prompt"], spec["decode_tokens"])), flush=True)


def _qinfer_run(path: str, threads: int, prompt: list[int], decode_tokens: int) -> dict:
    import torch

    from qinfer.evals.costs import decode_bytes
    from qinfer.evals.speed import _run
    from qinfer.model.loader import load_model

    torch.set_num_threads(threads)
    model = load_model(Path(path), dtype=torch.bfloat16, run=True)
    ids = torch.tensor([prompt])
    _run(model, ids[:, :DECODE_PROMPT], 2, "bf16")  # warm-up: pages, threads, weight layouts of each path
    _run(model, ids, 1, "bf16")
    _, tpot, cache, _ = _run(model, ids[:, :DECODE_PROMPT], decode_tokens, "bf16")
    ttft, _, _, _ = _run(model, ids, 1, "bf16")
    return {"decode_tok_s": 1 / tpot, "prefill_tok_s": len(prompt) / ttft,
            "decode_bytes": decode_bytes(model, cache, decode_context(decode_tokens))}


def _llamacpp_run(path: str, threads: int, prompt: list[int], decode_tokens: int) -> dict:
    import llama_cpp
    import numpy as np

    n_ctx = -(-max(len(prompt) + 1, DECODE_PROMPT + decode_tokens + 1) // 256) * 256
    llm = llama_cpp.Llama(model_path=path, n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_threads=threads,
                          n_threads_batch=threads, verbose=False)
    vocab = llm.n_vocab()

    def greedy() -> int:  # the last position's logits, read in place
        return int(np.argmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(vocab,))))

    def run(ids: list[int], steps: int) -> tuple[float, float]:  # (seconds to first token, seconds per step)
        llm.reset()  # the next eval drops the cached positions
        t0 = time.perf_counter()
        llm.eval(ids)
        token = greedy()
        ttft = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(steps):
            llm.eval([token])
            token = greedy()
        return ttft, (time.perf_counter() - t0) / steps

    run(prompt[:DECODE_PROMPT], 2)  # warm-up, as qinfer's
    run(prompt, 1)
    _, tpot = run(prompt[:DECODE_PROMPT], decode_tokens)
    ttft, _ = run(prompt, 1)
    return {"decode_tok_s": 1 / tpot, "prefill_tok_s": len(prompt) / ttft}


def _spawn(engine: str, path: str, threads: int, prompt: list[int], decode_tokens: int, label: str) -> dict:
    """:func:`worker` in a subprocess with ``threads`` threads; its figures."""
    import qinfer
    from qinfer.evals.roofline import busy_cpu_seconds

    spec = json.dumps({"engine": engine, "path": path, "threads": threads, "prompt": prompt,
                       "decode_tokens": decode_tokens})
    root = str(Path(qinfer.__file__).resolve().parents[1])  # the qinfer this process runs, not another install
    # GGML_NO_BACKTRACE: a ggml abort says its reason last, not a debugger's backtrace after it
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "GGML_NO_BACKTRACE": "1",
           "PYTHONPATH": os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])}
    code = "import sys; from qinfer.evals.vs_llamacpp import worker; worker(sys.argv[1])"
    busy, children, start = busy_cpu_seconds(), _children_cpu_seconds(), time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code, spec], capture_output=True, text=True, env=env)
    wall, after = time.perf_counter() - start, busy_cpu_seconds()
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        said = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise QinferError(f"the {engine} run of {label} failed (exit status {proc.returncode}): {said}")
    run = json.loads(lines[-1])
    if busy is not None and after is not None:
        # every CPU's busy time less this process's and the run's own: what other processes took meanwhile
        mine = after[1] - busy[1] + _children_cpu_seconds() - children
        run["others_cpus"] = max(0.0, after[0] - busy[0] - mine) / wall
    return run


def _children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # the subprocesses waited for
    return usage.ru_utime + usage.ru_stime


# --- the paired benchmark -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Subject:
    label: str  # the MODEL as given
    gguf: Path
    reference: Path
    quantized: Path
    vocab_size: int
    max_positions: int


def _subjects(config: BenchConfig) -> list[_Subject]:
    """Each MODEL's GGUF, reference folder and 4-bit folder (the 4-bit one made where it is missing)."""
    from qinfer.evals.main_job import quantized
    from qinfer.model.arch import ModelConfig
    from qinfer.sources.registry import BUILTINS, fetch_gguf
    from qinfer.sources.resolve import resolve_model

    subjects = []
    for label in config.models or tuple(BUILTINS):
        if label in BUILTINS:
            gguf = fetch_gguf(BUILTINS[label])
        elif label.lower().endswith(".gguf") and Path(label).is_file():
            gguf = Path(label)
        else:
            raise QinferError(f"{label}: llama.cpp runs a GGUF: give a built-in name ({', '.join(BUILTINS)}) or a "
                              ".gguf file")
        reference = resolve_model(label)
        four_bit = config.quantized or quantized(Path(label).stem if label not in BUILTINS else label, reference,
                                                 QUANTIZATION)
        model_config = ModelConfig.from_folder(reference)
        subjects.append(_Subject(label, gguf, reference, Path(four_bit), model_config.vocab_size,
                                 model_config.max_position_embeddings))
    return subjects


def run_bench(config: BenchConfig) -> dict:
    """Measure (see the module docstring), print the table and the headline, write the JSON; returns the JSON."""
    import torch

    from qinfer.evals.roofline import BUSY_CPUS, measure_roofline, threads_text

    missing = config.llamacpp and llamacpp_missing()
    if missing:
        raise QinferError(missing)
    subjects = _subjects(config)
    for s in subjects:
        if max(config.prompt_tokens + 1, DECODE_PROMPT + config.decode_tokens) > s.max_positions:
            raise QinferError(f"{s.label} reads {s.max_positions} positions: a {config.prompt_tokens}-token prompt or "
                              f"{DECODE_PROMPT} + {config.decode_tokens} decode tokens do not fit; lower them")
    torch.set_num_threads(config.threads)  # the roofline at the runs' thread count
    roofline = measure_roofline("cpu")
    engines = ENGINES if config.llamacpp else ENGINES[1:]
    context = decode_context(config.decode_tokens)
    results = {s.label: {} for s in subjects}
    for s in subjects:
        paths = {"llama.cpp": s.gguf, "qinfer bf16": s.reference, "qinfer 4-bit": s.quantized}
        for engine in engines:
            size = gguf_decode_bytes(s.gguf, context) if engine == "llama.cpp" else 0  # qinfer's: from its runs
            results[s.label][engine] = EngineResult(engine, str(paths[engine]), size)
    prompts = {s.label: prompt_ids(s.vocab_size, config.prompt_tokens) for s in subjects}
    print(f"{len(subjects)} model(s) x {len(engines)} engines, {threads_text(config.threads)}, {config.repeats} "
          "rounds", file=sys.stderr)
    for r in range(config.repeats):
        order = engines[r % len(engines):] + engines[:r % len(engines)]
        for s in subjects:
            for engine in order:
                result = results[s.label][engine]
                run = _spawn(engine, result.path, config.threads, prompts[s.label], config.decode_tokens, s.label)
                result.decode_bytes = run.pop("decode_bytes", result.decode_bytes)
                result.runs.append(run)
                busy = f"; other processes kept {run['others_cpus']:.1f} CPUs busy" if "others_cpus" in run else ""
                print(f"round {r + 1}/{config.repeats} {s.label} {engine}: {run['decode_tok_s']:.1f} decode tok/s, "
                      f"{run['prefill_tok_s']:.0f} prefill tok/s{busy}", file=sys.stderr, flush=True)
    for per_model in results.values():
        for result in per_model.values():
            result.decode_tok_s = statistics.median(run["decode_tok_s"] for run in result.runs)
            result.prefill_tok_s = statistics.median(run["prefill_tok_s"] for run in result.runs)
            result.mbu = result.decode_bytes * result.decode_tok_s / (roofline.bandwidth_gbs * 1e9)
    types = {s.label: gguf_type(s.gguf) for s in subjects}
    data = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "cpu": roofline.machine or roofline.cpu_name,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "llama_cpp_python": _llamacpp_version() if config.llamacpp else None,
        "threads": config.threads,
        "repeats": config.repeats,
        "decode_prompt_tokens": DECODE_PROMPT,
        "decode_tokens": config.decode_tokens,
        "prompt_tokens": config.prompt_tokens,
        "roofline": roofline.to_json(),
        "models": {s.label: {"gguf": str(s.gguf), "gguf_type": types[s.label], "scheme": _tag(s.quantized),
                             "engines": {e: asdict(r) for e, r in results[s.label].items()}} for s in subjects},
    }
    data["headline"] = headline(data)
    print(format_table(data))
    busiest = max((run.get("others_cpus", 0.0) for m in results.values() for e in m.values() for run in e.runs))
    if busiest > BUSY_CPUS:
        print(f"note: other processes kept up to {busiest:.1f} CPUs busy during a run, so some figures may read low: "
              "measure again on an idle machine")
    write_atomic(Path(config.out), json.dumps(data, indent=2) + "\n")
    print(f"written: {config.out}")
    print(data["headline"])
    return data


def _tag(folder: Path) -> str:
    """The quantization of a qinfer model folder, e.g. ``gptq-w4g128``."""
    from qinfer.format import QuantScheme

    return QuantScheme.load(folder).tag


def _llamacpp_version() -> str:
    from importlib.metadata import version

    return version("llama-cpp-python")


def format_table(data: dict) -> str:
    """The measured figures of :func:`run_bench`'s JSON as a markdown table, a row per model and engine."""
    bandwidth = data["roofline"]["bandwidth_gbs"]
    lines = [f"{data['cpu']}; {data['threads']} thread(s); medians of {data['repeats']} alternating runs; decode: "
             f"{data['decode_tokens']} greedy tokens after a {data['decode_prompt_tokens']}-token prompt; prefill: a "
             f"{data['prompt_tokens']}-token prompt; MBU against {bandwidth:.1f} GB/s (qinfer roofline)",
             "",
             "| model | engine | decode tok/s | x llama.cpp | prefill tok/s | x llama.cpp | MB read a step | MBU |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for label, model in data["models"].items():
        base = model["engines"].get("llama.cpp")
        for engine, r in model["engines"].items():
            name = {"llama.cpp": f"llama.cpp {model['gguf_type']}",
                    "qinfer 4-bit": f"qinfer 4-bit {model.get('scheme', '')}".strip()}.get(engine, engine)
            decode_x = f"{r['decode_tok_s'] / base['decode_tok_s']:.2f}x" if base else "-"
            prefill_x = f"{r['prefill_tok_s'] / base['prefill_tok_s']:.2f}x" if base else "-"
            lines.append(f"| {label} | {name} | {r['decode_tok_s']:.1f} | {decode_x} | {r['prefill_tok_s']:.0f} | "
                         f"{prefill_x} | {r['decode_bytes'] / 1e6:.0f} | {r['mbu']:.0%} |")
    return "\n".join(lines)


def headline(data: dict) -> str:
    """``<first model> 4-bit decode = <ratio>x llama.cpp <its GGUF type>``; without llama.cpp, the 4-bit rate."""
    label, model = next(iter(data["models"].items()))
    four_bit = model["engines"]["qinfer 4-bit"]["decode_tok_s"]
    if "llama.cpp" not in model["engines"]:
        return f"{label} 4-bit decode = {four_bit:.1f} tok/s (llama.cpp not measured: --qinfer-only)"
    ratio = four_bit / model["engines"]["llama.cpp"]["decode_tok_s"]
    return f"{label} 4-bit decode = {ratio:.2f}x llama.cpp {model['gguf_type']}"


@click.command(cls=Command)
@click.argument("models", nargs=-1)
@click.option("--threads", type=int, default=2, show_default=True, help="Threads of every engine.")
@click.option("--repeats", type=int, default=5, show_default=True, help="Rounds; the medians are reported.")
@click.option("--decode-tokens", type=int, default=128, show_default=True, help="Greedy decode steps timed.")
@click.option("--prompt-tokens", type=int, default=512, show_default=True, help="The prompt whose prefill is timed.")
@click.option("--out", default="vs-llamacpp.json", show_default=True, help="The JSON of the results.")
@click.option("--quantized", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="A 4-bit model folder to run instead of the main job's quantization (one MODEL only).")
@click.option("--qinfer-only", is_flag=True, help="Run qinfer's engines only (without llama-cpp-python).")
def main(models, threads, repeats, decode_tokens, prompt_tokens, out, quantized, qinfer_only):
    """Decode and prefill of qinfer (bf16 reference, default 4-bit) against llama.cpp on the same GGUF."""
    run_bench(BenchConfig(models=tuple(models), threads=threads, repeats=repeats, decode_tokens=decode_tokens,
                          prompt_tokens=prompt_tokens, out=Path(out), quantized=quantized, llamacpp=not qinfer_only))


if __name__ == "__main__":
    main(prog_name="python -m qinfer.evals.vs_llamacpp")
