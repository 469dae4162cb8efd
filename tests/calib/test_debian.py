import subprocess

import pytest

from qinfer.calib import debian
from qinfer.calib.debian import download_deb, read_deb_files
from qinfer.errors import QinferError

FIX = "put the .deb in /cache/data"
PATH = "usr/lib/R/site-library/pkg/data/Rdata.rdx"


@pytest.mark.parametrize("compression", ["xz", "gz", ""])
@pytest.mark.parametrize("gnu_names", [False, True])
def test_reads_files_from_the_data_tarball(tmp_path, calib_builders, compression, gnu_names):
    files = {PATH: b"odd length payload", "usr/share/doc/pkg/copyright": b"even"}
    deb = tmp_path / "pkg_1.0_all.deb"
    deb.write_bytes(calib_builders.build_deb(files, data_compression=compression, gnu_names=gnu_names))
    assert read_deb_files(deb, [PATH, "/usr/share/doc/pkg/copyright"]) == {
        PATH: b"odd length payload",
        "usr/share/doc/pkg/copyright": b"even",
    }


def test_missing_member_is_named(tmp_path, calib_builders):
    deb = tmp_path / "pkg.deb"
    deb.write_bytes(calib_builders.build_deb({PATH: b"x"}))
    with pytest.raises(QinferError, match="does not contain usr/lib/other; is it the right package"):
        read_deb_files(deb, [PATH, "usr/lib/other"])


@pytest.mark.parametrize(
    ("blob", "message"),
    [
        (b"PK\x03\x04 a zip file", "no ar header"),
        (b"!<arch>\n", "no data.tar"),
        (b"!<arch>\ndata.tar.xz     0           0     0     100644  999       `\nshort", "truncated"),
        (b"!<arch>\ndata.tar.xz     0           0     0     100644  999       XX", "corrupt ar header"),
    ],
)
def test_broken_packages_raise(tmp_path, blob, message):
    deb = tmp_path / "broken.deb"
    deb.write_bytes(blob)
    with pytest.raises(QinferError, match=message):
        read_deb_files(deb, [PATH])


def test_corrupt_data_tarball(tmp_path, calib_builders):
    deb = tmp_path / "pkg.deb"
    deb.write_bytes(calib_builders.build_ar({"debian-binary": b"2.0\n", "data.tar.xz": b"\xfd7zXZ garbage"}))
    with pytest.raises(QinferError, match="cannot read data.tar.xz"):
        read_deb_files(deb, [PATH])


def test_zstd_data_tarball_gets_a_clear_error(tmp_path, calib_builders):
    deb = tmp_path / "pkg.deb"
    deb.write_bytes(calib_builders.build_ar({"debian-binary": b"2.0\n", "data.tar.zst": b"\x28\xb5\x2f\xfd"}))
    with pytest.raises(QinferError, match="data.tar.zst"):
        read_deb_files(deb, [PATH])


class FakeApt:
    """Stands in for subprocess.run: answers each apt-get call from a script of (returncode, stderr)."""

    def __init__(self, script, package="pkg"):
        self.script = list(script)
        self.package = package
        self.calls = []

    def __call__(self, cmd, cwd, **kwargs):
        self.calls.append(cmd[1:])
        returncode, stderr = self.script.pop(0)
        if returncode == 0 and cmd[1] == "download":
            (cwd / f"{self.package}_1.0-1_all.deb").write_bytes(b"!<arch>\n")
        return subprocess.CompletedProcess(cmd, returncode, stdout="", stderr=stderr)


@pytest.fixture
def apt(monkeypatch):
    monkeypatch.setattr(debian.shutil, "which", lambda name: "/usr/bin/apt-get")

    def install(script):
        fake = FakeApt(script)
        monkeypatch.setattr(debian.subprocess, "run", fake)
        return fake

    return install


UNSANDBOXED = "W: Download is performed unsandboxed as root as file 'x.deb' couldn't be accessed by user '_apt'."


def test_download_succeeds_despite_warnings(tmp_path, apt):
    fake = apt([(0, UNSANDBOXED)])
    assert download_deb("pkg", tmp_path, FIX) == tmp_path / "pkg_1.0-1_all.deb"
    assert fake.calls == [["download", "pkg"]]


def test_missing_lists_trigger_one_update(tmp_path, apt):
    fake = apt([(100, "E: Unable to locate package pkg"), (0, ""), (0, "")])
    assert download_deb("pkg", tmp_path, FIX).name == "pkg_1.0-1_all.deb"
    assert fake.calls == [["download", "pkg"], ["update"], ["download", "pkg"]]


def test_offline_error_is_one_line_with_the_fix(tmp_path, apt):
    offline = (
        f"{UNSANDBOXED}\n"
        "E: Failed to fetch http://deb.debian.org/pkg.deb  Temporary failure resolving 'deb.debian.org'\n"
    )
    fake = apt([(100, offline)])
    with pytest.raises(QinferError) as err:
        download_deb("pkg", tmp_path, FIX)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("could not download the Debian package pkg (E: Failed to fetch")
    assert "Temporary failure resolving" in message and message.endswith(FIX)
    assert fake.calls == [["download", "pkg"]]  # the lists exist: an update would not help


def test_failed_update_is_reported(tmp_path, apt):
    apt([(100, "E: Unable to locate package pkg"), (100, "E: Could not open lock file - open (13: Permission denied)")])
    with pytest.raises(QinferError, match=r"apt-get update failed: E: Could not open lock file.*put the \.deb"):
        download_deb("pkg", tmp_path, FIX)


def test_still_unknown_after_update(tmp_path, apt):
    apt([(100, "E: Unable to locate package pkg"), (0, ""), (100, "E: Unable to locate package pkg")])
    with pytest.raises(QinferError, match=r"\(E: Unable to locate package pkg\); put the"):
        download_deb("pkg", tmp_path, FIX)


def test_no_apt_get(tmp_path, monkeypatch):
    monkeypatch.setattr(debian.shutil, "which", lambda name: None)
    with pytest.raises(QinferError, match="apt-get is not installed; put the .deb"):
        download_deb("pkg", tmp_path, FIX)


def test_timeout_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(debian.shutil, "which", lambda name: "/usr/bin/apt-get")

    def hang(cmd, **kwargs):
        raise subprocess.TimeoutExpired(cmd, kwargs["timeout"])

    monkeypatch.setattr(debian.subprocess, "run", hang)
    with pytest.raises(QinferError, match="`apt-get download pkg` timed out"):
        download_deb("pkg", tmp_path, FIX)
