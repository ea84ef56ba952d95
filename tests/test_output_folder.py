"""The output folder of `tightpack pack`: lock, checks before work, sweep of killed runs, publish."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tightpack.core.store_cache import claim
from tightpack.errors import TightpackError
from tightpack.offline import output_folder
from tightpack.offline import output_lock as lock_module
from tightpack.offline.output_folder import check_publishable, os_error_message, publish, sweep_work
from tightpack.offline.output_lock import output_lock

from .conftest import write_jsonl

SHARD = "packs-00000.idx.parquet"


def tightpack_output(folder: Path, marker: str = "old", shards: tuple[str, ...] = (SHARD,)) -> Path:
    """A folder as `tightpack pack` leaves it: shards, metadata.json, and the manifest listing them."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in shards:
        (folder / name).write_text(marker)
    (folder / "metadata.json").write_text("[]\n")
    manifest = {
        "format": "tightpack.packed/1",
        "metadata_file": "metadata.json",
        "files": [{"name": name, "rows": 1} for name in shards],
        "marker": marker,
    }
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def staged(output: Path, marker: str = "new") -> Path:
    """A finished work folder next to ``output``, made as the pipeline makes it (`claim`)."""
    staging = output.parent / f".{output.name}.partial-test{marker}"
    claim(staging)
    tightpack_output(staging, marker)
    return staging


def marker(folder: Path) -> str:
    return json.loads((folder / "manifest.json").read_text())["marker"]


def dead_pid() -> int:
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True).stdout)  # fmt: skip


def start_python(code: str) -> tuple[subprocess.Popen, list[str]]:
    """A Python process running ``code``, once it printed "ready ..."; and the words after "ready"."""
    process = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)  # fmt: skip
    words = process.stdout.readline().split()
    assert words[:1] == ["ready"], process.stderr.read()
    return process, words[1:]


def kill(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGKILL)
    process.wait()
    process.stdout.close()
    process.stderr.close()


# --- check_publishable ---------------------------------------------------------------------------


def test_an_output_that_holds_an_input_is_refused(tmp_path):
    previous = tightpack_output(tmp_path / "prev")
    source = write_jsonl(previous / "train.jsonl", [{"input": "a", "output": "b"}])
    with pytest.raises(TightpackError, match=r"output '.*prev' is or holds the input '.*prev/train\.jsonl'"):
        check_publishable(previous, True, [source])
    # An input named like a file tightpack wrote (re-packing a shard) is refused just the same.
    with pytest.raises(TightpackError, match=r"is or holds the input '.*packs-00000\.idx\.parquet'"):
        check_publishable(previous, True, [previous / SHARD])
    with pytest.raises(TightpackError, match=r"output '.*train\.jsonl' is or holds the input"):
        check_publishable(source, True, [source])
    (tmp_path / "link").symlink_to(previous)  # the input reached through a link to the output
    with pytest.raises(TightpackError, match=r"is or holds the input '.*link/train\.jsonl'"):
        check_publishable(previous, True, [tmp_path / "link" / "train.jsonl"])
    assert check_publishable(tmp_path / "elsewhere", False, [source]) == (tmp_path / "elsewhere").resolve()


def test_an_output_that_holds_the_cache_is_refused(tmp_path):
    cache = tmp_path / "work" / "cache"
    with pytest.raises(TightpackError, match=r"output '.*work' is or holds tightpack's cache '.*work/cache'"):
        check_publishable(tmp_path / "work", False, [], cache=cache)
    with pytest.raises(TightpackError, match=r"is or holds tightpack's cache"):
        check_publishable(cache, False, [], cache=cache)
    check_publishable(tmp_path / "work" / "out", False, [], cache=tmp_path / "work" / "cache")


@pytest.mark.parametrize("spelling", [".", "..", "{cwd}"])
def test_the_current_directory_and_its_parents_are_refused(tmp_path, monkeypatch, spelling):
    tightpack_output(tmp_path / "here")  # even a tightpack output: it cannot be renamed from inside
    monkeypatch.chdir(tmp_path / "here")
    output = spelling.format(cwd=tmp_path / "here")
    for overwrite in (False, True):
        with pytest.raises(
            TightpackError, match=r"is the current directory or holds it; .* such as '.*packed'"
        ):
            check_publishable(output, overwrite, [])
    assert check_publishable("packed", False, []) == tmp_path / "here" / "packed"


def test_the_root_folder_is_refused():
    with pytest.raises(TightpackError, match=r"output '/' is the root folder; choose a folder below it"):
        check_publishable("/", True, [])
    with pytest.raises(TightpackError, match=r"output '/' is the root folder"), output_lock("/"):
        pass


def test_an_existing_output_needs_overwrite_and_must_be_tightpack_s(tmp_path):
    out = tightpack_output(tmp_path / "out")
    with pytest.raises(
        TightpackError, match=r"^output '.*out' already exists; pass overwrite=True to replace it$"
    ):
        check_publishable(out, False, [])
    assert check_publishable(out, True, []) == out
    (tmp_path / "empty").mkdir()
    assert check_publishable(tmp_path / "empty", True, []) == tmp_path / "empty"
    (tmp_path / "file").write_text("x")
    with pytest.raises(TightpackError, match=r"refusing to overwrite '.*file': it is not a folder"):
        check_publishable(tmp_path / "file", True, [])

    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(TightpackError, match=r"not a tightpack output folder \(no manifest\.json\)"):
        check_publishable(tmp_path / "mine", True, [])
    (tmp_path / "mine" / "manifest.json").write_text("{not json")
    with pytest.raises(TightpackError, match=r"not a tightpack output folder \(unreadable manifest\.json: "):
        check_publishable(tmp_path / "mine", True, [])
    (tmp_path / "mine" / "manifest.json").write_text(json.dumps({"format": "other/1", "files": []}))
    with pytest.raises(TightpackError, match=r"\(manifest\.json is not a tightpack manifest\)"):
        check_publishable(tmp_path / "mine", True, [])
    escaping = {"format": "tightpack.packed/1", "files": [{"name": "../notes.txt"}]}
    (tmp_path / "mine" / "manifest.json").write_text(json.dumps(escaping))
    with pytest.raises(TightpackError, match=r"\(manifest\.json is not a tightpack manifest\)"):
        check_publishable(tmp_path / "mine", True, [])
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_an_output_holding_other_files_is_refused_with_their_names(tmp_path):
    out = tightpack_output(tmp_path / "out")
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(
        TightpackError, match=r"holds files tightpack did not write \(notes\.txt\); move them"
    ):
        check_publishable(out, True, [])
    (out / "notes.txt").unlink()
    (out / "packs-00001.idx.parquet").mkdir()  # a folder under a shard-like name is not a shard
    for number in range(6):
        (out / f"extra-{number}").write_text("")
    with pytest.raises(TightpackError, match=r"\(extra-0, extra-1, extra-2, extra-3, extra-4 and 2 more\)"):
        check_publishable(out, True, [])


def test_a_real_pack_output_is_recognised_and_replaced(tmp_path, prompt_completion_rows):
    from tightpack.offline.pipeline import PackConfig, pack_dataset

    source = write_jsonl(tmp_path / "train.jsonl", prompt_completion_rows)
    out = tmp_path / "out"
    pack_dataset([source], out, PackConfig(packed_sequence_size=256))
    written = sorted(p.name for p in out.iterdir())
    assert check_publishable(out, True, [source]) == out
    publish(staged(out), out, overwrite=True)
    assert marker(out) == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "train.jsonl"], written


# Unwritable places. Tests run as root here, and root ignores permission bits, so a chmod-ed folder is
# only a test for other users; /sys refuses new files even to root, and a file stands where a folder
# should be for everyone.
def _unwritable(kind: str, tmp_path: Path) -> Path:
    if kind == "chmod":
        if os.geteuid() == 0:
            pytest.skip("root writes into a folder of mode 0o555; the /sys case covers root")
        (tmp_path / "ro").mkdir(mode=0o555)
        return tmp_path / "ro" / "out"
    if kind == "sysfs":
        if not Path("/sys/kernel").is_dir():
            pytest.skip("no sysfs")
        return Path("/sys/tightpack-out")
    (tmp_path / "file").write_text("")
    return tmp_path / "file" / "out"


@pytest.mark.parametrize(
    ("kind", "cause"),
    [("chmod", "Permission denied"), ("sysfs", "(Permission denied|Read-only file system)"),
     ("file", "file: not a folder")],
)  # fmt: skip
def test_an_unwritable_place_is_refused_before_any_work(tmp_path, kind, cause):
    output = _unwritable(kind, tmp_path)
    with pytest.raises(
        TightpackError, match=rf"^cannot write the output '{output}': .*{cause}; .* you can write to$"
    ):
        check_publishable(output, False, [])
    with pytest.raises(
        TightpackError,
        match=rf"^cannot lock the output '{output}': .*{cause}; the folder that holds the output must be "
        r"writable$",
    ):
        with output_lock(output):
            pass
    assert not os.path.lexists(output)


# --- output_lock ---------------------------------------------------------------------------------

HOLD_LOCK = """
    import time
    from tightpack.offline.output_lock import output_lock
    with output_lock({output!r}):
        print("ready", flush=True)
        time.sleep(60)
"""


needs_flock = pytest.mark.skipif(lock_module.fcntl is None, reason="no flock here (Windows): no lock")


@needs_flock
def test_a_second_run_on_the_same_output_fails_naming_the_first(tmp_path):
    holder, _ = start_python(HOLD_LOCK.format(output=str(tmp_path / "out")))
    try:
        assert (tmp_path / ".out.lock").read_text() == f"{holder.pid}\n"
        with pytest.raises(
            TightpackError,
            match=rf"^output '.*out' is being written by another tightpack run \(pid {holder.pid}\); wait",
        ):
            with output_lock(tmp_path / "out"):
                pass
        with output_lock(tmp_path / "other") as other:  # another output: free
            assert other == tmp_path / "other"
    finally:
        kill(holder)
    # SIGKILL ends the lock with the process: the next run takes it at once.
    with output_lock(tmp_path / "out") as target:
        assert target == tmp_path / "out"
        assert (tmp_path / ".out.lock").read_text() == f"{os.getpid()}\n"
        with pytest.raises(TightpackError, match=rf"another tightpack run \(pid {os.getpid()}\)"):
            with output_lock(tmp_path / "x" / ".." / "out"):  # same folder, other spelling
                pass
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "the lock file goes with the run"


@needs_flock
def test_a_forked_worker_outliving_a_killed_run_does_not_keep_the_lock(tmp_path):
    holder, [worker] = start_python(f"""
        import os, time
        from tightpack.offline.output_lock import output_lock
        with output_lock({str(tmp_path / "out")!r}):
            if os.fork() == 0:  # the worker says ready: its fork handlers have run by then
                print("ready", os.getpid(), flush=True)
                time.sleep(60)
                os._exit(0)
            time.sleep(60)
    """)
    worker = int(worker)
    kill(holder)
    try:
        os.kill(worker, 0)  # still running
        with output_lock(tmp_path / "out"):
            pass
    finally:
        os.kill(worker, signal.SIGKILL)


# --- sweep_work ----------------------------------------------------------------------------------


def test_sweep_removes_work_folders_and_puts_a_set_aside_output_back(tmp_path):
    out = tmp_path / "out"
    previous = tightpack_output(tmp_path / ".out.old-abc", "previous")  # killed between the two renames
    (tmp_path / ".out.partial-nopid").mkdir()  # killed after removing its pid, before publishing
    (tmp_path / ".out.partial-dead").mkdir()
    (tmp_path / ".out.partial-dead" / ".pid").write_text(str(dead_pid()))
    claiming = f".tightpack-claim-{dead_pid()}-abc"
    (tmp_path / claiming).mkdir()  # killed inside claim
    (tmp_path / ".other.partial-x").mkdir()  # another output's: not this sweep's business
    (tmp_path / "notes.txt").write_text("keep me")
    with output_lock(out):
        removed = sweep_work(out)
    assert sorted(p.name for p in removed) == [".out.partial-dead", ".out.partial-nopid", claiming]
    assert marker(out) == "previous" and not previous.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.partial-x", "notes.txt", "out"]


def test_sweep_removes_a_set_aside_output_once_the_new_one_is_in_place(tmp_path):
    out = tightpack_output(tmp_path / "out", "new")
    tightpack_output(tmp_path / ".out.old-a", "previous")
    kept = tightpack_output(tmp_path / ".out.old-b", "previous")
    (kept / "notes.txt").write_text("appeared while it was replaced")
    assert [p.name for p in sweep_work(out)] == [".out.old-a"]
    assert sorted(p.name for p in kept.iterdir()) == ["notes.txt"], "only tightpack's files are removed"
    assert marker(out) == "new"


# --- publish -------------------------------------------------------------------------------------


@pytest.mark.parametrize("swap", ["exchange", "two renames"])
def test_publish_replaces_only_a_tightpack_output(tmp_path, monkeypatch, swap):
    if swap == "two renames":  # what a file system without RENAME_EXCHANGE gets
        monkeypatch.setattr(output_folder, "_exchange", lambda first, second: False)
    out = tmp_path / "out"
    publish(staged(out, "first"), out)
    assert marker(out) == "first" and not (out / ".pid").exists()
    with pytest.raises(TightpackError, match=r"^output '.*out' already exists; pass overwrite=True"):
        publish(staged(out, "second"), out)
    publish(tmp_path / ".out.partial-testsecond", out, overwrite=True)
    assert marker(out) == "second"
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "metadata.json", SHARD]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"], "nothing left aside"

    (out / "notes.txt").write_text("put there during the run")
    staging = staged(out, "third")
    with pytest.raises(TightpackError, match=r"holds files tightpack did not write \(notes\.txt\)"):
        publish(staging, out, overwrite=True)
    assert marker(out) == "second" and (out / "notes.txt").read_text() == "put there during the run"
    assert (staging / ".pid").exists(), "a refused publish leaves the work folder as it was"


def test_publish_over_a_shard_count_change_leaves_no_old_shard(tmp_path):
    out = tightpack_output(
        tmp_path / "out", "old", shards=("packs-00000.idx.parquet", "packs-00001.idx.parquet")
    )
    publish(staged(out), out, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "metadata.json", SHARD]


# --- os_error_message ----------------------------------------------------------------------------


def test_os_errors_become_one_line_with_the_path_and_the_cause(tmp_path):
    with pytest.raises(FileNotFoundError) as missing:
        (tmp_path / "absent" / "x").write_text("")
    assert os_error_message(missing.value) == f"{tmp_path}/absent/x: No such file or directory"
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "f").write_text("")
    with pytest.raises(OSError) as refused:
        os.rename(tmp_path / "a", tmp_path / "b")
    assert refused.value.errno in (errno.ENOTEMPTY, errno.EEXIST)
    assert os_error_message(refused.value) == f"{tmp_path}/a -> {tmp_path}/b: {refused.value.strerror}"
    if Path("/dev/full").exists():  # a full disk: writes fail without naming the file
        with pytest.raises(OSError) as full, open("/dev/full", "w") as handle:
            handle.write("x")
        assert full.value.errno == errno.ENOSPC
        assert os_error_message(full.value, "out/packs.npy") == "out/packs.npy: No space left on device"
