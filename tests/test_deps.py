"""Dependencies outside the tested range stop a command with one line, not a traceback somewhere inside."""

from importlib.metadata import PackageNotFoundError

from click.testing import CliRunner

from qinfer import deps
from qinfer.cli.commands import cli


def test_the_installed_environment_is_in_range():
    assert deps.outside_range() == []  # this suite runs in the environment it checks


def test_a_package_outside_its_range_or_missing_is_named(monkeypatch):
    declared = ['transformers<5.26,>=5.24', 'numpy<3,>=1.26', 'gguf<0.20,>=0.16', 'pytest>=8; extra == "dev"']
    installed = {"transformers": "5.30.1", "numpy": "2.4.6", "pytest": "1.0"}

    def version(name):
        if name not in installed:
            raise PackageNotFoundError(name)
        return installed[name]

    monkeypatch.setattr(deps, "requires", lambda dist: declared)
    monkeypatch.setattr(deps, "version", version)
    assert deps.outside_range() == ["transformers 5.30.1 (needs <5.26,>=5.24)",
                                    "gguf not installed (needs <0.20,>=0.16)"]
    result = CliRunner().invoke(cli, ["list"])
    assert result.exit_code == 1 and result.stdout == ""
    assert result.stderr.splitlines() == [
        "Error: installed packages outside the versions qinfer is tested with: transformers 5.30.1 (needs "
        "<5.26,>=5.24), gguf not installed (needs <0.20,>=0.16); reinstall qinfer in this environment (`pip install "
        "-e .`, or `pip install -c constraints.txt -e .` for the exact tested set) or use a fresh virtual "
        "environment; QINFER_SKIP_VERSION_CHECK=1 runs anyway"]
    monkeypatch.setenv(deps.SKIP, "1")
    assert CliRunner().invoke(cli, ["list"]).exit_code == 0


def test_a_local_version_label_is_in_range(monkeypatch):
    monkeypatch.setattr(deps, "requires", lambda dist: ["torch==2.13.0"])
    monkeypatch.setattr(deps, "version", lambda name: "2.13.0+cpu")  # the CPU build's version
    assert deps.outside_range() == []
