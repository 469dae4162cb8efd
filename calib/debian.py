"""Fetch a Debian binary package with ``apt-get download`` and read files out of it in pure Python.

Debian is our mirror for data that ships inside distribution packages (the Austen novels live in
``r-cran-janeaustenr``): apt verifies the archive signatures, the mirrors are fast and reachable from
machines that can reach no other site, and nothing is installed system-wide — ``apt-get download``
only drops the ``.deb`` in the current folder.

A ``.deb`` is an ``ar`` archive (``!<arch>\\n``, then per member a 60-byte ASCII header — name[16],
mtime[12], uid[6], gid[6], mode[8], size[10], ``"`\\n"`` — and the data padded to an even length)
holding ``debian-binary``, ``control.tar.*`` and ``data.tar.*``; the installed files are in the last.
We read members straight from the tarball into memory rather than extracting, so a hostile archive
cannot write outside a folder.
"""

import shutil
import subprocess
import tarfile
from io import BytesIO
from pathlib import Path

from qinfer.errors import QinferError

_AR_MAGIC = b"!<arch>\n"
_AR_HEADER = 60
# apt-get update can be slow on a cold mirror; a hung network should still end in a clear error.
_APT_TIMEOUT_S = 600
# What apt prints when the package lists are absent (fresh container) rather than when the network is.
_LISTS_MISSING = ("Unable to locate package", "has no installation candidate", "Can't select candidate")


def download_deb(package: str, dest: Path, fix: str) -> Path:
    """Run ``apt-get download <package>`` in ``dest`` and return the ``.deb`` it wrote.

    If apt does not know the package because the lists were never fetched, run ``apt-get update`` once
    and retry. Any other failure (no apt-get, offline, not root for the update) raises a one-line
    ``QinferError`` that ends with ``fix``, the caller's advice on getting the file another way.
    """
    apt = shutil.which("apt-get")
    if apt is None:
        raise QinferError(f"could not download the Debian package {package}: apt-get is not installed; {fix}")
    result = _run_apt([apt, "download", package], dest, package, fix)
    if result.returncode != 0 and any(marker in result.stderr for marker in _LISTS_MISSING):
        update = _run_apt([apt, "update"], dest, package, fix)
        if update.returncode != 0:
            raise QinferError(
                f"could not download the Debian package {package} (apt-get update failed: "
                f"{_apt_error(update)}); {fix}"
            )
        result = _run_apt([apt, "download", package], dest, package, fix)
    if result.returncode != 0:
        raise QinferError(f"could not download the Debian package {package} ({_apt_error(result)}); {fix}")
    debs = sorted(dest.glob(f"{package}_*.deb"))
    if not debs:
        raise QinferError(f"apt-get download {package} succeeded but wrote no .deb in {dest}; {fix}")
    return debs[-1]


def _run_apt(cmd: list[str], cwd: Path, package: str, fix: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=_APT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise QinferError(
            f"could not download the Debian package {package} (`apt-get {' '.join(cmd[1:])}` timed out after "
            f"{_APT_TIMEOUT_S} s, offline?); {fix}"
        ) from None


def _apt_error(result: subprocess.CompletedProcess) -> str:
    """The line of apt's output that explains a failure: its last ``E:`` line, else its last line.

    apt also prints warnings (``W: Download is performed unsandboxed ...``) on success, so the ``E:``
    line is the one worth showing.
    """
    lines = [line.strip() for line in (result.stderr + "\n" + result.stdout).splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("E:")]
    if errors:
        return errors[-1]
    return lines[-1] if lines else f"exit code {result.returncode}"


def read_deb_files(deb: Path, paths: list[str]) -> dict[str, bytes]:
    """Return the contents of ``paths`` (e.g. ``usr/lib/R/...``) from the data tarball of ``deb``.

    Raises ``QinferError`` naming the file if it is not a Debian package or lacks one of the paths.
    """
    deb = Path(deb)
    members = _ar_members(deb.read_bytes(), deb)
    data_names = [name for name in members if name.startswith("data.tar")]
    if not data_names:
        raise QinferError(f"{deb} is not a Debian binary package (no data.tar.* member); delete it and retry")
    data_name = data_names[0]
    if data_name.endswith(".zst"):
        # Ubuntu compresses with zstd, which tarfile reads only from Python 3.14 on.
        raise QinferError(f"{deb} stores {data_name}, which Python's tarfile cannot read; use a Debian (xz) .deb")
    wanted = {p.strip("/") for p in paths}
    found: dict[str, bytes] = {}
    try:
        with tarfile.open(fileobj=BytesIO(members[data_name]), mode="r:*") as tar:
            for info in tar:
                # dpkg-deb writes names as ./usr/...; other builders omit the ./
                name = info.name.removeprefix("./").strip("/")
                if name in wanted and info.isfile():
                    found[name] = tar.extractfile(info).read()
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise QinferError(f"{deb}: cannot read {data_name} ({exc}); delete it and retry") from None
    missing = sorted(wanted - found.keys())
    if missing:
        raise QinferError(f"{deb} does not contain {', '.join(missing)}; is it the right package?")
    return found


def _ar_members(blob: bytes, origin: Path) -> dict[str, bytes]:
    if not blob.startswith(_AR_MAGIC):
        raise QinferError(f"{origin} is not a Debian package (no ar header); delete it and retry")
    members: dict[str, bytes] = {}
    pos = len(_AR_MAGIC)
    while pos + _AR_HEADER <= len(blob):
        header = blob[pos : pos + _AR_HEADER]
        if header[58:60] != b"`\n":
            raise QinferError(f"{origin}: corrupt ar header at byte {pos}; delete it and retry")
        # GNU ar ends names with "/", dpkg-deb pads them with spaces only.
        name = header[:16].decode("ascii", "replace").rstrip(" ").rstrip("/")
        try:
            size = int(header[48:58].decode("ascii").strip())
        except ValueError:
            raise QinferError(f"{origin}: corrupt ar header at byte {pos}; delete it and retry") from None
        start = pos + _AR_HEADER
        if start + size > len(blob):
            raise QinferError(f"{origin} is truncated (member {name} runs past the end); delete it and retry")
        members[name] = blob[start : start + size]
        pos = start + size + (size % 2)
    return members
