"""The outputs of ``qinfer eval``: a terminal table, ``results.json``, ``results.md`` and two plots.

``results.json`` (``SCHEMA_VERSION`` 1), strict JSON: numbers plain JSON numbers, ``null`` where one is NaN or
infinite (a model that produced NaN; the table shows ``nan``)::

    {
      "schema_version": 1,
      "created": "<ISO 8601 UTC>",
      "qinfer_version": "<version>",
      "settings": {
        "models": [<MODEL arguments>], "baseline": "<MODEL argument>", "baseline_kv_cache": "bf16",
        "text": "heldout" | "<file>", "text_description": "<what was read, and how many tokens>",
        "max_tokens", "window", "stride": <int>,
        "tasks": [<task names asked for>], "limit": <int examples per task>,
        "missing_tasks": {"<task>": "<why it was not scored: its source could not be fetched>"},
        "speed": <bool>, "kv_cache": "bf16" | "int8" | "fp8",
        "prompt_tokens", "decode_steps", "repeats": <int>, "compiled": <bool, the compiled decode step timed too>,
        "device": "cpu" | "cuda", "threads": <int>, "torch_version": "<version>",
        "decode_kernels": "<what a CPU decode row multiplies through: qinfer's C GEMVs, or PyTorch's and why>",
        "weight_pages": "<the pages a CPU model's weights lie in: 2 MiB pages, or 4 KiB pages and why>"
      },
      "roofline": null | <qinfer.evals.roofline.Roofline.to_json()>,
      "models": [{
        "label": "<row name>", "spec": "<MODEL argument>", "path": "<resolved folder>",
        "content_key": "<sha256 hex>", "is_baseline": <bool>,
        "size_bytes": <int, safetensors bytes>, "effective_bits": <float, bits per linear weight>,
        "text": {"ppl", "nll", "kl", "top1_agreement": <float>, "tokens", "window", "stride": <int>,
                 "nll_delta", "nll_delta_se", "kl_se": <float, or null with fewer than two blocks of text>},
        "tasks": {"<task>": {"accuracy", "accuracy_norm": <float>, "n": <int>,
                             "accuracy_se", "accuracy_norm_se": <float, or null for one example>}, ...},
        "missing_tasks": {"<task>": "<why>"} (the tasks asked for and not scored; also under "settings"),
        "speed": null | {
          "prompt_tokens", "decode_steps", "repeats": <int>, "kv_cache",
          "compute_dtype": <str, the dtype most prefill FLOPs multiply in>,
          "ttft_s", "prefill_tok_s", "tpot_s", "decode_tok_s", "decode_context": <float>,
          "decode_bytes", "decode_flops", "prefill_bytes", "prefill_flops": <int>,
          "mbu", "mfu_prefill": <float, fractions of the roofline>, "threads": <int>,
          "prefill_flops_by_dtype": {"bf16" | "fp32": <int, prefill FLOPs multiplied in that dtype>},
          "compile_s", "compiled_tpot_s", "compiled_decode_tok_s", "compiled_mbu": <float, or null without
              "compiled": the torch.compile'd decode step, timed beside the eager one>
        }
      }, ...]
    }

``nll`` and ``kl`` are nats per scored token; ``kl`` is KL(baseline || model); ``nll_delta`` is the mean of
nll(model) - nll(baseline) per token, so ppl / ppl_baseline = exp(nll_delta); ``nll_delta_se`` and ``kl_se`` are
standard errors over the text (:mod:`qinfer.evals.divergence`); ``effective_bits`` counts scales and zeros.
The tables show ``vs base %`` = 100 (exp(nll_delta) - 1) and, after ``±``, one standard error of it and of
KL. ``accuracy`` is BIG-bench's ``multiple_choice_grade`` (:mod:`qinfer.evals.tasks`), ``accuracy_se`` its standard
error over the examples; ``acc %`` in the tables is the mean over the tasks scored, ± one standard error of that
mean, and reads ``missing`` where tasks were asked for and none could be scored.
``pareto.png`` plots perplexity (lower is better) against decode tokens/s (against size on disk when
speed was not measured); ``roofline.png`` places each model's decode and prefill on the measured roofline
(only with speed).
"""

import json
import math
import os
import shutil
from datetime import datetime, timezone
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch

from qinfer.store.atomic import naming_full_disk
from qinfer.store.signals import signals_held
from qinfer.store.temp import release, temp_path
from qinfer.errors import QinferError
from qinfer.evals.divergence import SE_BLOCKS, SE_MIN_BLOCK
from qinfer.evals.forward import BASELINE_KV, eval_device
from qinfer.evals.roofline import Roofline, threads_text
from qinfer.kernels import cpu_library
from qinfer.model.loader import weight_pages

SCHEMA_VERSION = 1
RESULTS_JSON, RESULTS_MD, PARETO_PNG, ROOFLINE_PNG = "results.json", "results.md", "pareto.png", "roofline.png"
REPORT_FILES = (RESULTS_JSON, RESULTS_MD, PARETO_PNG, ROOFLINE_PNG)
_MIB = 1 << 20


def results_json(config, results, roofline: Roofline | None, text_description: str) -> dict:
    try:
        qinfer_version = version("qinfer-llm")
    except PackageNotFoundError:
        qinfer_version = "unknown"
    settings = {
        "models": list(config.models), "baseline": config.baseline_spec, "baseline_kv_cache": BASELINE_KV,
        "text": config.text, "text_description": text_description, "max_tokens": config.max_tokens,
        "window": config.window, "stride": config.stride, "tasks": list(config.tasks), "limit": config.limit,
        "missing_tasks": dict(results[0].missing_tasks) if results else {},
        "speed": config.speed, "kv_cache": config.kv_cache, "prompt_tokens": config.prompt_tokens,
        "decode_steps": config.decode_steps, "repeats": config.repeats, "compiled": config.compiled,
        "device": eval_device(),
        "threads": torch.get_num_threads(), "torch_version": torch.__version__,
        "decode_kernels": cpu_library.describe(),
        "weight_pages": weight_pages(),
    }
    return {
        "schema_version": SCHEMA_VERSION,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "qinfer_version": qinfer_version,
        "settings": settings,
        "roofline": None if roofline is None else roofline.to_json(),
        "models": [r.to_json() for r in results],
    }


def _with_se(value: str, se: float | None, fmt: str) -> str:
    return value if se is None else f"{value} ±{se:{fmt}}"


def _acc(tasks: list, field: str) -> str:
    """The mean of ``field`` over ``tasks`` in percent, ± one standard error of that mean (tasks independent)."""
    if not tasks:
        return "-"
    value = 100 * sum(getattr(t, field) for t in tasks) / len(tasks)
    se = 100 * math.sqrt(sum(getattr(t, field + "_se") ** 2 for t in tasks)) / len(tasks)
    return _with_se(f"{value:.1f}", se if math.isfinite(se) else None, ".1f")


def _vs_base(text) -> str:
    """100 (ppl / ppl_baseline - 1) ± one standard error."""
    return "-" if text.ppl_change is None else _with_se(f"{text.ppl_change:+.1f}", text.ppl_change_se, ".1f")


def _rows(results) -> tuple[list[str], list[list[str]]]:
    """Header and cells of the summary table (shared by the terminal and markdown)."""
    header = ["model", "size MiB", "bits/w", "ppl", "vs base %", "KL nats", "top-1 %", "acc %", "acc_norm %",
              "prefill tok/s", "TTFT s", "decode tok/s", "TPOT ms", "MBU %", "MFU %"]
    compiled = any(r.speed is not None and r.speed.compiled_tpot_s is not None for r in results)
    if compiled:
        header += ["compiled tok/s", "compiled MBU %"]
    rows = []
    for r in results:
        s = r.speed
        rows.append([
            r.label + (" (baseline)" if r.is_baseline else ""),
            f"{r.size_bytes / _MIB:.1f}", f"{r.effective_bits:.3f}", f"{r.text.ppl:.3f}", _vs_base(r.text),
            _with_se(f"{r.text.kl:.4f}", r.text.kl_se, ".4f"),
            f"{100 * r.text.top1_agreement:.1f}",
            *(["missing"] * 2 if r.missing_tasks and not r.tasks else
              [_acc(list(r.tasks.values()), "accuracy"), _acc(list(r.tasks.values()), "accuracy_norm")]),
            *(["-"] * 6 if s is None else [
                f"{s.prefill_tok_s:.1f}", f"{s.ttft_s:.3f}", f"{s.decode_tok_s:.2f}", f"{1e3 * s.tpot_s:.1f}",
                f"{100 * s.mbu:.1f}", f"{100 * s.mfu_prefill:.1f}",
            ]),
        ])
        if compiled:
            timed = s is not None and s.compiled_tpot_s is not None
            rows[-1] += [f"{s.compiled_decode_tok_s:.2f}", f"{100 * s.compiled_mbu:.1f}"] if timed else ["-", "-"]
    return header, rows


def format_table(results) -> str:
    """The summary table as aligned plain text."""
    header, rows = _rows(results)
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|"]
    cell = lambda text: str(text).replace("|", "\\|")  # noqa: E731  (a "|" in a model's name would end a cell)
    return "\n".join(lines + ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows])


def results_markdown(data: dict, results) -> str:
    s = data["settings"]
    parts = [
        "# qinfer eval",
        "",
        f"Text: {s['text_description']} (window {s['window']}, stride {s['stride']}); "
        f"KL is KL(baseline ‖ model) in nats per token against **{s['baseline']}** (bf16 KV cache); "
        "vs base is the perplexity's change against it; ± is one standard error over the text "
        f"(batch means over blocks of max({SE_MIN_BLOCK}, scored tokens / {SE_BLOCKS}) consecutive tokens; on a short "
        "text a floor, as passages differ over longer spans; it covers the choice of text, not of calibration samples; "
        f"none below {2 * SE_MIN_BLOCK} scored tokens); "
        + ("models run with a bf16 KV cache. " if s["kv_cache"] == "bf16" else
           f"models run with an {s['kv_cache']} KV cache (a scale per position and KV head, set as each is "
           "written, times the scales per KV head and channel a model's folder stores, where it has them). ")
        + (f"Tasks: {', '.join(s['tasks'])}, at most {s['limit']} examples each (n below), zero-shot, scored by "
           "log-likelihood with the models run in bf16: acc is BIG-bench's multiple_choice_grade (the choice with the "
           "highest log-likelihood earns its target score), acc_norm the same for the highest log-likelihood per "
           "character; the summary's acc is the mean over tasks; ± is one standard error over the examples. "
           if s["tasks"] else "Tasks: none. ")
        + (f"Speed at batch 1: {s['prompt_tokens']}-token prompt, {s['decode_steps']} decode steps, median of "
           f"{s['repeats']} runs, {threads_text(s['threads'])}"
           + (f"; decode rows through {s['decode_kernels']}, weights in {s.get('weight_pages', '4 KiB pages')}."
              if s["device"] == "cpu" else ".")
           + (" The compiled columns time the same decode steps through torch.compile (as `qinfer generate "
              "--compile`), from a copy of each run's prefilled cache; compiling is not counted."
              if s.get("compiled") else "") if s["speed"] else "Speed not measured."),
        "",
        _md_table(*_rows(results)),
    ]
    missing = s.get("missing_tasks", {})
    tasks = [t for t in s["tasks"] if t not in missing]
    if missing:
        parts += ["", "**Missing:** " + "; ".join(f"{t}: {why}" for t, why in missing.items())]
    if tasks:
        header = ["model"] + [f"{t} acc / acc_norm %" for t in tasks]
        rows = [[r.label] + [f"{_acc([r.tasks[t]], 'accuracy')} / {_acc([r.tasks[t]], 'accuracy_norm')}"
                             for t in tasks] for r in results]
        parts += ["", "Per task (n = examples scored):", "",
                  _md_table(header, rows), "", ", ".join(f"{t}: n = {results[0].tasks[t].n}" for t in tasks)]
    if data["roofline"] is not None:
        rf = data["roofline"]
        peaks = ", ".join(f"{k} {v:.3g} TFLOP/s" for k, v in rf["peak_tflops"].items())
        parts += ["", f"Roofline: {rf.get('machine') or rf['cpu_name']}, {threads_text(rf['threads'])}, read bandwidth "
                  f"{rf['bandwidth_gbs']:.1f} GB/s, matmul peaks {peaks}."]
    return "\n".join(parts) + "\n"


def _strict(value):
    """``value`` with every NaN or infinite float replaced by None (JSON has no NaN: parsers other than Python's
    refuse it)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(v) for v in value]
    return value


def check_out(out: Path) -> None:
    """Refuse an ``--out`` where one of the files eval writes is a folder (before anything is measured)."""
    for name in (RESULTS_JSON, RESULTS_MD, PARETO_PNG, ROOFLINE_PNG):
        if (Path(out) / name).is_dir():
            raise QinferError(f"--out {out}: {name} there is a folder, where eval writes a file: move it, or choose "
                              "another --out")


def write_outputs(config, results, roofline: Roofline | None, text_description: str) -> list[Path]:
    """Write results.json, results.md, pareto.png and (with speed) roofline.png into ``config.out``: all of them
    into a temp folder there first, then each renamed into place, so a failure on the way (a plot that cannot be
    drawn or written) leaves the earlier run's files as they were, not a mix of two runs."""
    from qinfer.evals.plots import plot_pareto, plot_models_roofline

    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    data = results_json(config, results, roofline, text_description)
    tmp = temp_path(out, ".results-", folder=True)
    try:
        with naming_full_disk(out):
            text = json.dumps(_strict(data), indent=2, allow_nan=False) + "\n"
            (tmp / RESULTS_JSON).write_text(text, encoding="utf-8")
            (tmp / RESULTS_MD).write_text(results_markdown(data, results), encoding="utf-8")
            plot_pareto(results, text_description, tmp / PARETO_PNG)
            if roofline is not None:
                plot_models_roofline(results, roofline, tmp / ROOFLINE_PNG)
            names = sorted(f.name for f in tmp.iterdir())
            with signals_held():  # a Ctrl-C between the renames would leave two runs' files side by side
                for name in names:
                    os.replace(tmp / name, out / name)
                if roofline is None:  # an earlier run's plot beside these results would show speeds they do not have
                    (out / ROOFLINE_PNG).unlink(missing_ok=True)
    finally:
        release(tmp)
        shutil.rmtree(tmp, ignore_errors=True)
    return [out / name for name in (RESULTS_JSON, RESULTS_MD, PARETO_PNG, ROOFLINE_PNG) if name in names]
