"""The README's main job: from nothing to a table and two plots of what quantization costs and buys.

Pulls gemma3-270m, quantizes it 4-bit with group size 128 by RTN, GPTQ and AWQ, and to FP8 (E4M3,
per channel), then evaluates all four against the bf16 reference with :func:`qinfer.evals.runner.run_eval`
and writes the outputs to ``out``. Quantized folders live in ``cache_dir()/quantized/`` and are reused
when their ``quant_config.json``, calibration settings, source model files and quantizing code all match, so
a second run only evaluates (and the eval cache makes that instant too). Sample counts are cut down so the
whole job fits in minutes on a 2-core CPU (its timings: docs/results.md, "The main job"); they are printed
with the results.

Run it as ``python -m qinfer.evals.main_job`` or ``qinfer demo``.
"""

import dataclasses
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import click

from qinfer.calib.austen import fetch_austen
from qinfer.store.paths import cache_dir
from qinfer.cli.command import Command
from qinfer.errors import QinferError
from qinfer.format import QuantScheme
from qinfer.model.loader import safetensors_header
from qinfer.pipeline.config import CalibConfig, TuneConfig, quant_scheme, recorded_calibration
from qinfer.pipeline.quantize import code_fingerprint, quantize_model, source_identity
from qinfer.sources.resolve import resolve_model

MODEL = "gemma3-270m"
SCHEMES = {
    # `qinfer quantize`'s defaults for each method; FP8 through GPTQ's error feedback
    "rtn-w4g128": quant_scheme("rtn"),
    "gptq-w4g128": quant_scheme("gptq"),
    "awq-w4g128": quant_scheme("awq"),
    "fp8": quant_scheme("gptq", format="fp8"),
}


@dataclass(frozen=True)
class MainJobConfig:
    out: Path = Path("qinfer-results")
    model: str = MODEL
    samples: int = 32  # calibration windows (the quantize default is 128)
    seq_len: int = 512
    limit: int = 150  # examples per task (the eval default is 250)
    max_tokens: int = 2048  # tokens of Persuasion scored
    repeats: int = 3

    def __post_init__(self):
        if not str(self.out).strip():  # (Path("") would be this folder)
            raise QinferError("--out is empty: name a folder (--out . for this one)")
        object.__setattr__(self, "out", Path(self.out))

    def calibration(self) -> CalibConfig:
        return CalibConfig(samples=self.samples, seq_len=self.seq_len)


def quantized_dir(model: str, name: str) -> Path:
    return cache_dir() / "quantized" / f"{model}-{name}"


def _matches(folder: Path, source: Path, scheme: QuantScheme, calib: CalibConfig) -> bool:
    """True when ``folder`` is a finished quantization of ``source`` as it is now, with this scheme and
    calibration, by this code."""
    try:
        report = json.loads((folder / "quantize_report.json").read_text())
        same = report.get("calibration") == recorded_calibration(scheme, calib, TuneConfig())
        same = same and report.get("code") == code_fingerprint() and report.get("source") == source_identity(source)
        for weights in folder.glob("*.safetensors"):  # a damaged copy (a truncated file) is quantized again
            safetensors_header(weights)
        return QuantScheme.load(folder) == scheme and same
    except (OSError, ValueError, QinferError):
        return False


def quantized(model: str, source: Path, name: str, calib: CalibConfig | None = None) -> Path:
    """The folder of ``model`` (read from ``source``, its resolved folder) quantized by ``SCHEMES[name]`` with
    ``calib`` (the main job's calibration by default): reused where it matches (:func:`_matches`), else made.
    Where the scheme's group size does not divide every linear's in_features (SmolLM2's 576 and 128), the largest
    that does, as ``qinfer quantize`` takes by default, in a folder named after it
    (``smollm2-135m-instruct-gptq-w4g64``)."""
    from qinfer.pipeline.preflight import fitted_scheme

    calib = calib or MainJobConfig().calibration()
    scheme = fitted_scheme(source, SCHEMES[name])
    target = quantized_dir(model, name if scheme == SCHEMES[name] else scheme.tag)
    if _matches(target, source, scheme, calib):
        _say(f"{name}: reusing {target}")
        return target
    t0 = time.perf_counter()
    report = quantize_model(source, target, scheme, calib, force=True)
    _say(f"{name}: {report.sizes()} ({time.perf_counter() - t0:.0f} s)")
    return target


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run_main_job(config: MainJobConfig):
    from qinfer.evals.report import format_table
    from qinfer.evals import runner
    from qinfer.evals.runner import EvalConfig

    start = time.perf_counter()
    calib = config.calibration()
    eval_config = EvalConfig(models=(config.model,), limit=config.limit, max_tokens=config.max_tokens,
                             repeats=config.repeats, out=config.out)
    settings = (
        f"settings: calibration {calib.samples} x {calib.seq_len} tokens of Austen (quantize default 128); "
        f"eval: first {eval_config.max_tokens} tokens of Persuasion (window {eval_config.window}, stride "
        f"{eval_config.stride}), tasks {', '.join(eval_config.tasks)} with {eval_config.limit} examples each, "
        f"speed: {eval_config.prompt_tokens}-token prompt + {eval_config.decode_steps} decode steps, median of "
        f"{eval_config.repeats} runs"
    )
    _say(f"qinfer main job: {config.model} as bf16 reference, {', '.join(SCHEMES)}\n{settings}")
    runner.check_destinations(eval_config)  # before the quantizing, not after it
    # Everything the job downloads, before its first long step: a source that is gone fails in seconds, not after
    # minutes of quantizing. Without the tasks the job still runs, with their columns marked missing.
    folder = resolve_model(config.model)
    fetch_austen()  # calibration and held-out text
    loaded_tasks = runner.load_tasks(eval_config)
    models, skipped = [config.model], []
    for name in SCHEMES:
        try:
            models.append(str(quantized(config.model, folder, name, calib)))
        except QinferError as exc:  # (out of memory, say): the other variants are still worth the table
            _say(f"{name}: skipped: {exc}")
            skipped.append(name)
    eval_config = dataclasses.replace(eval_config, models=tuple(models))
    results = runner.run_eval(eval_config, loaded_tasks)
    print(format_table(results))
    print(settings)
    if loaded_tasks[1]:
        print(f"note: {runner.missing_tasks_line(loaded_tasks[1])}")
    if skipped:
        print(f"not in the table (quantizing failed, see above): {', '.join(skipped)}")
    print(f"outputs in {config.out.resolve()}: results.json, results.md, pareto.png, roofline.png "
          f"({time.perf_counter() - start:.0f} s in all)")
    return results


@click.command(cls=Command)
@click.option("--out", default="qinfer-results", show_default=True, help="Folder for the results and plots.")
def main(out):
    """The main job, as `qinfer demo` runs it (the same one-line errors, Ctrl-C and SIGTERM handling)."""
    run_main_job(MainJobConfig(out=out))


if __name__ == "__main__":
    main(prog_name="python -m qinfer.evals.main_job")
