"""The dependency versions qinfer is tested with, checked before a command runs.

``pyproject.toml`` bounds every dependency to the range the whole test suite has passed on, and
``constraints.txt`` pins the exact set CI last passed with. pip enforces the range when qinfer is installed, but an
environment changes afterwards (another project upgrades transformers, say); a command then stops with one line
that names the packages and the fix, instead of failing somewhere inside with a traceback.
"""

import os
from importlib.metadata import PackageNotFoundError, requires, version

from packaging.requirements import Requirement

DISTRIBUTION = "qinfer-llm"
SKIP = "QINFER_SKIP_VERSION_CHECK"  # set to 1 to run outside the tested range at one's own risk


def outside_range() -> list[str]:
    """``"<package> <installed> (needs <range>)"`` for each runtime dependency outside the installed qinfer's
    declared range; empty when qinfer is not installed (a source tree on ``sys.path``: no declared range)."""
    try:
        declared = requires(DISTRIBUTION) or []
    except PackageNotFoundError:
        return []
    out = []
    for text in declared:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue  # an optional extra's (dev): not needed to run
        try:
            have = version(req.name)
        except PackageNotFoundError:
            out.append(f"{req.name} not installed (needs {req.specifier})")
            continue
        if not req.specifier.contains(have, prereleases=True):
            out.append(f"{req.name} {have} (needs {req.specifier})")
    return out


def version_problem() -> str | None:
    """The one-line error for dependencies outside their tested range, or None (also when ``SKIP`` is set)."""
    if os.environ.get(SKIP, "") not in ("", "0"):
        return None
    bad = outside_range()
    if not bad:
        return None
    return (f"installed packages outside the versions qinfer is tested with: {', '.join(bad)}; reinstall qinfer in "
            f"this environment (`pip install -e .`, or `pip install -c constraints.txt -e .` for the exact tested set) "
            f"or use a fresh virtual environment; {SKIP}=1 runs anyway")
