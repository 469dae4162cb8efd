"""``qinfer eval``: accuracy against speed against the roofline, for several models, cached.

For each model: perplexity over a text, mean KL(baseline || model) and top-1 agreement on the same
tokens (:mod:`qinfer.evals.divergence`), zero-shot BIG-bench accuracy (:mod:`qinfer.evals.accuracy`),
size on disk and bits per weight (:mod:`qinfer.evals.checkpoint`), and batch-1 speed with MBU and MFU
(:mod:`qinfer.evals.speed`). The baseline defaults to the first model and is the reference as stored,
run with a bf16 KV cache; the models run with ``kv_cache``, so with "int8" even the baseline's own row
shows what the quantized cache costs.

Every measured part is cached on its own (:mod:`qinfer.evals.result_cache`), keyed by the models'
content keys and the settings that part depends on; models are loaded only when some part is missing,
so a repeated run is instant. Outputs (:mod:`qinfer.evals.report`) go to ``out``.
"""

import dataclasses
import hashlib
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from qinfer.model.arch import ModelConfig
from qinfer.store.atomic import check_writable
from qinfer.store.memory import available_memory
from qinfer.store.paths import cache_dir
from qinfer.errors import QinferError
from qinfer.evals import benchmarks, result_cache
from qinfer.evals.accuracy import HELDOUT, load_text, task_accuracy, text_tokens
from qinfer.evals.benchmarks import SourceUnavailable
from qinfer.evals.checkpoint import content_key, effective_bits, size_on_disk
from qinfer.evals.divergence import SE_BLOCKS, SE_MIN_BLOCK, TextMetrics, text_metrics
from qinfer.evals.forward import BASELINE_KV, eval_device, window_logits
from qinfer.evals.roofline import Roofline, busy_cpu_seconds, busy_while, check_roofline_path, measure_roofline
from qinfer.evals.speed import SpeedResult, measure_speeds
from qinfer.evals.tasks import MCResult, load_task
from qinfer.model.kv_cache import KV_DTYPES
from qinfer.model.loader import load_model
from qinfer.sources.registry import BUILTINS
from qinfer.sources.resolve import resolve_model
from qinfer.sources.tokenizer import Tokenizer

DEFAULT_TASKS = ("arc_easy", "piqa")  # published benchmarks a 270M model scores well above chance on


@dataclass(frozen=True)
class EvalConfig:
    """Settings of one eval. ``tasks=()`` skips tasks; ``out=None`` writes no files."""

    models: tuple[str, ...]
    baseline: str | None = None  # None: the first model
    text: str = HELDOUT  # "heldout" or a UTF-8 file
    max_tokens: int = 2048  # tokens of the text used (~8 windows at the default window/stride)
    window: int = 512
    stride: int | None = None  # None: half the window (each later window scores its second half)
    tasks: tuple[str, ...] = DEFAULT_TASKS
    limit: int = 250  # examples per task
    bigbench_sdist: Path | None = None  # bigbench-1.0.0.tar.gz, for BIG-bench task names
    speed: bool = True
    kv_cache: str = "bf16"
    prompt_tokens: int = 512
    decode_steps: int = 16
    repeats: int = 3  # speed runs; the medians are reported
    compiled: bool = False  # also time the torch.compile'd decode step (a compile per model: minutes)
    out: Path | None = Path("qinfer-results")
    cache: bool = True
    progress: bool = True

    def __post_init__(self):
        object.__setattr__(self, "models", tuple(self.models))
        object.__setattr__(self, "tasks", tuple(self.tasks))
        if self.out is not None:
            object.__setattr__(self, "out", Path(self.out))
        if self.bigbench_sdist is not None:
            object.__setattr__(self, "bigbench_sdist", Path(self.bigbench_sdist))
        if not self.models:
            raise QinferError("qinfer eval needs at least one MODEL")
        if self.kv_cache not in KV_DTYPES:
            raise QinferError(f"--kv-cache must be one of {', '.join(KV_DTYPES)}; got {self.kv_cache!r}")
        if self.window < 2:
            raise QinferError(f"--window must be at least 2 tokens; got {self.window}")
        if self.stride is None:
            object.__setattr__(self, "stride", self.window // 2)
        if not 0 < self.stride <= self.window:
            raise QinferError(f"--stride must be in 1..--window ({self.window}); got {self.stride}")
        if self.max_tokens < self.window:
            raise QinferError(f"--max-tokens ({self.max_tokens}) must be at least one --window ({self.window})")
        if len(set(self.tasks)) < len(self.tasks):
            object.__setattr__(self, "tasks", tuple(dict.fromkeys(self.tasks)))  # a task named twice is run once
        if self.compiled and not self.speed:
            raise QinferError("--compile times the compiled decode step beside the eager one: drop --no-speed, "
                              "or --compile")
        for name in ("limit", "prompt_tokens", "decode_steps", "repeats"):
            if type(getattr(self, name)) is not int or getattr(self, name) < 1:
                raise QinferError(f"--{name.replace('_', '-')} must be a positive integer; got {getattr(self, name)!r}")

    @property
    def baseline_spec(self) -> str:
        return self.baseline if self.baseline is not None else self.models[0]


@dataclass(frozen=True)
class ModelResult:
    label: str
    spec: str
    path: str
    content_key: str
    is_baseline: bool  # the same folder as the baseline
    size_bytes: int  # safetensors bytes on disk
    effective_bits: float  # stored bits per weight of the quantizable linears
    text: TextMetrics
    tasks: dict[str, MCResult] = field(default_factory=dict)
    speed: SpeedResult | None = None
    missing_tasks: dict[str, str] = field(default_factory=dict)  # task -> why it was not scored

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "ModelResult":
        data = dict(data)
        data["text"] = TextMetrics(**data["text"])
        data["tasks"] = {name: MCResult(**r) for name, r in data["tasks"].items()}
        data["speed"] = None if data["speed"] is None else SpeedResult(**data["speed"])
        return cls(**data)


@dataclass(frozen=True)
class _Model:
    spec: str
    label: str
    folder: Path
    key: str
    tokenizer: Tokenizer = field(compare=False)  # read once per model


def check_destinations(config: EvalConfig) -> None:
    """Refuse, before anything is measured, an ``--out`` or a cache that ``run_eval(config)`` could not write."""
    if config.out is not None:
        from qinfer.evals.report import check_out

        check_writable(config.out, option="--out")
        check_out(config.out)
    if config.speed:
        check_roofline_path(eval_device())  # its cache could not be written after the text part's minutes
    cache_dir("eval")  # nor the results' (a file in the way)


def load_tasks(config: EvalConfig) -> tuple[dict[str, list], dict[str, str]]:
    """``({task: examples}, {task: why it is missing})`` for the tasks of ``config``. A task whose source cannot be
    fetched (no network, a release withdrawn) is left out with its reason, so that the rest of an eval still runs;
    an unknown task name is an error, raised here, before anything is measured."""
    examples, missing = {}, {}
    published = [task for task in config.tasks if task in benchmarks.TASKS]
    try:
        if published:
            benchmarks.fetch()  # once for all of them: an unreachable index is asked once
    except SourceUnavailable as exc:
        missing = {task: str(exc) for task in published}
    for task in config.tasks:
        if task not in missing:
            examples[task] = load_task(task, config.limit, config.bigbench_sdist)
    if missing:
        print(f"qinfer eval: {missing_tasks_line(missing)}; measuring the rest", file=sys.stderr)
    return examples, missing


def missing_tasks_line(missing: dict[str, str]) -> str:
    """One line: which accuracy columns are missing, and why."""
    reasons = "; ".join(dict.fromkeys(missing.values()))
    return f"accuracy not measured for {', '.join(missing)}: {reasons}"


def run_eval(config: EvalConfig, loaded_tasks: tuple[dict, dict] | None = None) -> list[ModelResult]:
    """Measure every model of ``config``, write the outputs to ``config.out``, return one result per model.
    ``loaded_tasks``: what :func:`load_tasks` returned for ``config``, if the caller has already called it."""
    check_destinations(config)
    examples, missing = load_tasks(config) if loaded_tasks is None else loaded_tasks
    models, baseline, tokens, text_desc = comparison(config)
    text_fields = dict(baseline=baseline.key, baseline_kv=BASELINE_KV, kv=config.kv_cache, window=config.window,
                       stride=config.stride, tokens=hashlib.sha256(tokens.numpy().tobytes()).hexdigest(),
                       se=[SE_BLOCKS, SE_MIN_BLOCK])
    texts = _text_part(config, models, baseline, tokens, text_fields)
    roofline = measure_roofline(eval_device()) if config.speed else None
    all_tasks, speeds = _model_parts(config, models, examples, roofline)
    results = []
    for m in models:
        tasks, speed = all_tasks[m.label], speeds.get(m.label)
        results.append(ModelResult(
            label=m.label, spec=m.spec, path=str(m.folder), content_key=m.key, is_baseline=m.folder == baseline.folder,
            size_bytes=size_on_disk(m.folder), effective_bits=effective_bits(m.folder), text=texts[m.label],
            tasks=tasks, speed=speed, missing_tasks=dict(missing),
        ))
    if config.out is not None:
        from qinfer.evals.report import write_outputs  # matplotlib: only when writing

        write_outputs(config, results, roofline, text_desc)
    return results


def comparison(config: EvalConfig) -> tuple[list[_Model], _Model, torch.Tensor, str]:
    """(models, baseline, the text's tokens, what text they are) of ``config``, every model checked comparable with
    the baseline on that text, before any model is loaded: its windows fit its context, its vocabulary is the
    baseline's and it tokenizes the text as the baseline does."""
    models = _resolve(config.models)
    baseline = _resolve([config.baseline_spec])[0]
    text, text_desc = load_text(config.text)
    tokens = text_tokens(baseline.tokenizer, text, config.max_tokens)
    if tokens.numel() < config.window:
        raise QinferError(
            f"the text ({text_desc}) has {tokens.numel()} tokens, fewer than one window of {config.window}; "
            "use a longer text or a smaller --window"
        )
    _check_context(config, [*models, baseline])
    _check_vocab(models, baseline)
    for m in models:
        if m.folder != baseline.folder and not torch.equal(text_tokens(m.tokenizer, text, config.max_tokens), tokens):
            raise QinferError(f"{m.label} tokenizes the text differently from the baseline {baseline.label}: "
                              "KL and agreement need one shared vocabulary")
    return models, baseline, tokens, f"{text_desc}, first {tokens.numel()} tokens"


def _load(folder: Path):
    return load_model(folder, dtype=torch.bfloat16, device=eval_device(), run=True)


def _log(config: EvalConfig, message: str) -> None:
    if config.progress:
        print(f"qinfer eval: {message}", file=sys.stderr)


def _resolve(specs) -> list[_Model]:
    out, seen = [], {}
    for spec in specs:
        folder = resolve_model(spec).resolve()
        # the name the user gave, not the cache folder an imported GPTQ/compressed-tensors model is converted into
        label = spec if spec in BUILTINS else Path(spec).name or folder.name
        seen[label] = seen.get(label, 0) + 1
        if seen[label] > 1:
            label = f"{label}#{seen[label]}"
        out.append(_Model(spec, label, folder, content_key(folder), Tokenizer.from_folder(folder)))
    return out


def _check_context(config: EvalConfig, models: list[_Model]) -> None:
    """Refuse a --window (with the BOS put in front of it) or a speed run's prompt and steps past a model's context."""
    for m in models:
        c = ModelConfig.from_folder(m.folder)
        lead = m.tokenizer.leading_bos is not None
        if config.window + lead > c.max_position_embeddings:
            raise QinferError(
                f"--window {config.window}{' and the BOS before it' if lead else ''} is longer than {m.label}'s "
                f"context of {c.max_position_embeddings} tokens: lower --window (and --stride)"
            )
        if config.speed and config.prompt_tokens + config.decode_steps > c.max_position_embeddings:
            raise QinferError(
                f"the speed run's {config.prompt_tokens}-token prompt and {config.decode_steps} decode steps exceed "
                f"{m.label}'s context of {c.max_position_embeddings} tokens: lower --prompt-tokens, or pass --no-speed"
            )


def _check_vocab(models: list[_Model], baseline: _Model) -> None:
    """Refuse a model whose logits cover another vocabulary size than the baseline's (one tokenizer, an embedding
    padded to another size): KL and agreement compare the two distributions token by token, as llama.cpp's do."""
    size = ModelConfig.from_folder(baseline.folder).vocab_size
    for m in models:
        other = ModelConfig.from_folder(m.folder).vocab_size
        if other != size:
            raise QinferError(f"{m.label} has {other} tokens (config.json vocab_size), the baseline {baseline.label} "
                              f"{size}: KL and agreement need the same vocabulary; pick a baseline of {m.label}'s "
                              "own family and size")


def _text_part(config, models: list[_Model], baseline: _Model, tokens, fields: dict) -> dict[str, TextMetrics]:
    """Text metrics of every model: cached ones read, the rest measured in one pass over the text."""
    # the BOS each tokenizer starts text with (None: none), put before every window
    keys = {m.label: result_cache.cache_key("text", model=m.key, bos=[baseline.tokenizer.leading_bos,
                                                                      m.tokenizer.leading_bos], **fields)
            for m in models}
    found = {label: result_cache.load("text", key, TextMetrics) if config.cache else None
             for label, key in keys.items()}
    out = {label: metrics for label, metrics in found.items() if metrics is not None}
    todo = [m for m in models if m.label not in out]
    if not todo:
        return out
    _log(config, f"perplexity and KL against {baseline.label} for {', '.join(m.label for m in todo)}")
    base_model = _load(baseline.folder)
    base_fn = window_logits(base_model, BASELINE_KV, baseline.tokenizer.leading_bos)
    fns = {}
    for m in todo:
        if m.folder == baseline.folder and config.kv_cache == BASELINE_KV:
            fns[m.label] = base_fn  # the very same forward: its logits are computed once
            continue
        fns[m.label] = window_logits(_load(m.folder), config.kv_cache, m.tokenizer.leading_bos)
    measured = text_metrics(base_fn, fns, tokens, config.window, config.stride, progress=config.progress)
    for label, metrics in measured.items():
        result_cache.store("text", keys[label], dataclasses.asdict(metrics))
    return {**out, **measured}


def _model_parts(config, models: list[_Model], examples: dict, roofline: Roofline | None):
    """({label: task results}, {label: speed}) of every model: from the cache, or measured with each model
    loaded once, as many at a time as half the available memory holds; the speeds of the models loaded together
    are measured in rounds (:func:`qinfer.evals.speed.measure_speeds`). No speeds without a ``roofline``."""
    task_keys = {m.label: {task: result_cache.cache_key("task", model=m.key, task=task, limit=config.limit,
                                                        kv=config.kv_cache) for task in examples} for m in models}
    speed_keys = {} if roofline is None else {m.label: result_cache.cache_key(
        "speed", model=m.key, kv=config.kv_cache, prompt=config.prompt_tokens, steps=config.decode_steps,
        repeats=config.repeats, threads=torch.get_num_threads(), roofline=roofline.to_json(), order="rounds",
        compiled=config.compiled, speed_code=result_cache.speed_fingerprint(),
    ) for m in models}
    tasks = {m.label: {} for m in models}
    for label, keys in task_keys.items():
        for task, key in keys.items():
            value = result_cache.load("task", key, MCResult) if config.cache else None
            if value is not None:
                tasks[label][task] = value
    speeds = {}
    for label, key in speed_keys.items():
        value = result_cache.load("speed", key, SpeedResult) if config.cache else None
        if value is not None:
            speeds[label] = value
    untimed = [label for label in speed_keys if label not in speeds]
    todo = [m for m in models if len(tasks[m.label]) < len(examples) or m.label in untimed]
    for batch in _memory_batches(todo):
        loaded = [_load(m.folder) for m in batch]
        for m, model in zip(batch, loaded):
            missing = [task for task in examples if task not in tasks[m.label]]
            for task in missing:
                tasks[m.label][task] = task_accuracy(model, m.tokenizer, examples[task], config.kv_cache,
                                                     f"{m.label}: {task}", progress=config.progress)
                result_cache.store("task", task_keys[m.label][task], dataclasses.asdict(tasks[m.label][task]))
        timed = [(m, model) for m, model in zip(batch, loaded) if m.label in untimed]
        if len(timed) > 1:
            _log(config, f"speed of {', '.join(m.label for m, _ in timed)}, one run of each in turn, "
                         f"{config.repeats} round{'s' if config.repeats != 1 else ''}")
        if timed:
            busy, start = busy_cpu_seconds(), time.perf_counter()
            measured = measure_speeds([model for _, model in timed], roofline, config.kv_cache, config.prompt_tokens,
                                      config.decode_steps, config.repeats, desc="speed", progress=config.progress,
                                      compiled=config.compiled)
            others = busy_while(busy, start)
            if others is not None:  # slowed: shown (side by side), not kept for later runs
                print(f"qinfer eval: other processes kept {others:.1f} CPUs busy while the speeds were measured, so "
                      "they read low; they were not cached: measure again on an idle machine", file=sys.stderr)
            for (m, _), speed in zip(timed, measured):
                speeds[m.label] = speed
                if others is None:
                    result_cache.store("speed", speed_keys[m.label], dataclasses.asdict(speed))
    return {label: {task: found[task] for task in examples} for label, found in tasks.items()}, speeds


def _memory_batches(models: list[_Model]) -> list[list[_Model]]:
    """``models`` in consecutive groups whose weights (their size on disk) fit in half the available memory
    together; one model a group where that memory is unknown."""
    available = available_memory()
    budget = 0 if available is None else available // 2
    batches, used = [], 0
    for m in models:
        size = size_on_disk(m.folder)
        if not batches or used + size > budget:
            batches.append([])
            used = 0
        batches[-1].append(m)
        used += size
    return batches
