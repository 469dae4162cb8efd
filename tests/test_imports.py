"""The top-level folders (kernels/, quantizers/, calib/, evals/) never shadow another distribution's import names.

They are imported only as ``qinfer.*`` (through the links in ``qinfer/``) and hold no ``__init__.py``, so from the
repository root, where Python puts the current folder first on ``sys.path``, they are at most PEP 420 namespace
portions, which lose to any installed package of the same name and carry no distribution metadata. transformers
finds Hugging Face's ``kernels`` package with ``find_spec("kernels")``, so a regular package there broke it.
"""

import subprocess
import sys
import sysconfig
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOP = ("kernels", "quantizers", "calib", "evals")
PROBE = ("import importlib.util as u, transformers.modeling_utils\n"
         "from transformers.utils.import_utils import is_kernels_available\n"
         "s = u.find_spec('kernels')\n"
         "print(s.origin, is_kernels_available())\n")


def _hf_kernels_installed() -> bool:
    # by its metadata: from the repository root `import kernels` finds ./kernels, as a namespace package
    try:
        version("kernels")
    except PackageNotFoundError:
        return False
    return True


def _run(args: list[str], cwd: Path = ROOT) -> str:
    proc = subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip()


def test_top_level_folders_are_not_packages():
    for name in TOP:
        assert not (ROOT / name / "__init__.py").exists(), f"{name}/__init__.py makes ./{name} shadow `{name}`"
        assert (ROOT / "qinfer" / name).resolve() == ROOT / name  # imported as qinfer.<name>


@pytest.mark.skipif(sys.platform == "win32", reason="symlinked site folder")
def test_transformers_imports_from_the_repository_root_with_hf_kernels_installed():
    if not _hf_kernels_installed():  # (a dependency of transformers 5.25)
        pytest.skip("Hugging Face's kernels package is not installed here")
    origin, available = _run(["-c", PROBE]).split()
    assert not origin.startswith(str(ROOT)), origin  # the installed package answers, not ./kernels
    assert available == "True"


def test_transformers_imports_from_the_repository_root_without_hf_kernels(tmp_path):
    # This environment's site-packages less Hugging Face's kernels package, as a folder of links; `-S` keeps the
    # real one off sys.path, and addsitedir runs the .pth files (the editable install's finder among them).
    site = Path(sysconfig.get_paths()["purelib"])
    for entry in site.iterdir():
        if entry.name != "kernels" and not (entry.name.startswith("kernels-") and entry.name.endswith(".dist-info")):
            (tmp_path / entry.name).symlink_to(entry)
    origin, available = _run(["-S", "-c", f"import site; site.addsitedir({str(tmp_path)!r})\n{PROBE}"]).split()
    assert available == "False"  # ./kernels is at most a namespace portion without metadata: not taken for it
    assert origin == "None"


def test_qinfer_parts_import_away_from_the_repository(tmp_path):
    probe = ("import qinfer.kernels.linear, qinfer.quantizers.gptq, qinfer.calib.capture, qinfer.evals.runner\n"
             "import importlib.util as u\n"
             "for name in %r:\n"
             "    s = u.find_spec(name)\n"
             "    print(name, s and s.origin)\n" % (TOP,))
    found = dict(line.split(" ", 1) for line in _run(["-c", probe], cwd=tmp_path).splitlines())
    assert found.pop("kernels") in ("None", str(Path(sysconfig.get_paths()["purelib"]) / "kernels" / "__init__.py"))
    assert found == {"quantizers": "None", "calib": "None", "evals": "None"}  # qinfer's parts: only as qinfer.*
