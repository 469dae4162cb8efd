"""The ``qinfer`` command line. Each command builds a dataclass and calls a library function."""

import sys

import click

from qinfer.errors import QinferError

DTYPES = ("bf16", "fp32")


class _Group(click.Group):
    """Every ``QinferError`` becomes one ``Error: ...`` line and exit status 1, never a traceback."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except QinferError as e:
            raise click.ClickException(str(e)) from None
        except OSError as e:
            if getattr(e, "errno", None) == 28:  # ENOSPC
                raise click.ClickException(f"disk full while writing {e.filename or 'output'}: free space and retry") from None
            raise


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="qinfer-llm")
def cli():
    """qinfer: quantize a model, run it, and measure what the quantization cost."""


def _open(model: str, dtype: str):
    import torch

    from qinfer.loader import load_model
    from qinfer.sources import resolve_model
    from qinfer.tokenizer import Tokenizer

    folder = resolve_model(model)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    return load_model(folder, dtype=torch_dtype, device=device), Tokenizer.from_folder(folder)


def _sampling_options(f):
    f = click.option("--seed", type=int, default=None, help="Random seed for sampling.")(f)
    f = click.option("--top-k", type=int, default=0, show_default=True, help="Keep the k most likely tokens (0 = all).")(f)
    f = click.option("--top-p", type=float, default=1.0, show_default=True, help="Nucleus sampling mass.")(f)
    f = click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy.")(f)
    f = click.option("--max-tokens", type=int, default=128, show_default=True, help="Tokens to generate at most.")(f)
    f = click.option("--dtype", type=click.Choice(DTYPES), default="bf16", show_default=True)(f)
    return f


@cli.command()
@click.argument("name")
@click.option("--force", is_flag=True, help="Download and convert again even if cached.")
def pull(name, force):
    """Fetch a built-in model into the cache and convert it to a safetensors folder."""
    from qinfer.registry import pull as pull_model

    click.echo(pull_model(name, force=force))


@cli.command(name="list")
def list_models():
    """Show the built-in models and which are cached."""
    from qinfer.cache import cache_dir
    from qinfer.registry import BUILTINS, is_pulled, model_dir

    for spec in BUILTINS.values():
        state = f"cached at {model_dir(spec.name)}" if is_pulled(spec.name) else "not pulled"
        click.echo(f"{spec.name:24s} {state}\n{'':24s} {spec.description}")
    converted = sorted((cache_dir() / "converted").glob("*/config.json"))
    for c in converted:
        click.echo(f"{'(converted gguf)':24s} {c.parent}")


@cli.command()
@click.argument("model")
@click.argument("prompt")
@_sampling_options
def generate(model, prompt, dtype, max_tokens, temperature, top_p, top_k, seed):
    """Continue PROMPT with MODEL, streaming tokens to stdout; a timing line goes to stderr."""
    from qinfer.generate import GenerationStats, SamplingParams
    from qinfer.generate import generate as run
    from qinfer.tokenizer import StreamDecoder

    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    lm, tok = _open(model, dtype)
    stats = GenerationStats()
    stream = StreamDecoder(tok)
    sys.stdout.write(prompt)
    for token in run(lm, tok.encode(prompt), params, stop_ids=tok.eos_ids, stats=stats):
        sys.stdout.write(stream.feed(token))
        sys.stdout.flush()
    sys.stdout.write(stream.flush() + "\n")
    click.echo(stats.summary(), err=True)


@cli.command()
@click.argument("model")
@click.option("--system", default=None, help="System prompt.")
@_sampling_options
def chat(model, system, dtype, max_tokens, temperature, top_p, top_k, seed):
    """Chat with MODEL in the terminal using its chat template. /reset clears, /exit (or EOF) quits."""
    from qinfer.chat import ChatSession, repl
    from qinfer.generate import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    lm, tok = _open(model, dtype)
    repl(ChatSession(lm, tok, params, system=system))


def main():
    cli(prog_name="qinfer")
