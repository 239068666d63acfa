"""The commit of the converter's output under a process killed at any instant (kill -9, a power cut of the process):
every filesystem step of the commit and of the recovery is a kill point, and after each the next run on DST (even
one that then fails) leaves DST holding either the old output or the new one, byte for byte, with nothing left
beside it, and says in one line which it did.

A kill is simulated in-process: the step raises `Killed`, a BaseException that no cleanup of the converter catches
(the lock's release and the removal of a staging folder that was never marked complete are all that runs, which the
next run would do anyway); one test kills a real process with SIGKILL."""

from __future__ import annotations

import itertools
import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hybrid_linear_models.conversion import FORMATS, ConversionError, convert_checkpoint, safety
from hybrid_linear_models.conversion.safety import atomic_output_dir

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "tests" / "fixtures" / "fast_llm" / "hybrid_attn_gdn_kda" / "fast_llm"
HF = FORMATS["hf"]


class Killed(BaseException):
    """The process died here."""


def write_output(folder: Path, label: str) -> None:
    """A small hf output whose bytes say which run wrote it."""
    (folder / "config.json").write_text(json.dumps({"model_type": "hybrid_linear", "run": label}))
    (folder / "model.safetensors").write_bytes(label.encode() * 1000)
    (folder / "README.md").write_text(label)


def listing(folder: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(folder)): None if p.is_dir() else p.read_bytes() for p in sorted(folder.rglob("*"))}


def output(tmp_path: Path, label: str) -> dict[str, bytes | None]:
    folder = tmp_path / f"expected-{label}"
    folder.mkdir(exist_ok=True)
    write_output(folder, label)
    return listing(folder)


def run(dst: Path, label: str, *, fails: bool = False) -> None:
    """A conversion into `dst` writing output `label` (--force); `fails`: it stops with a ConversionError after the
    lock is taken, as a run on a bad source does."""
    with atomic_output_dir(dst, HF) as staging:
        if fails:
            raise ConversionError("bad source")
        write_output(staging, label)


class KillPoints:
    """Counts the commit's and the recovery's filesystem steps (safety._rename, safety._remove_tree) and kills the
    process at step `at` (None: never). A folder being deleted when the kill comes is left half deleted."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, at: int | None = None):
        self.at, self.steps = at, 0
        rename, remove_tree = safety._rename, safety._remove_tree

        def killed_rename(source: Path, target: Path) -> None:
            self._step()
            rename(source, target)

        def killed_remove_tree(folder: Path) -> None:
            if self.steps == self.at:
                files = sorted(p for p in folder.rglob("*") if p.is_file())
                if files:
                    files[0].unlink()
            self._step()
            remove_tree(folder)

        monkeypatch.setattr(safety, "_rename", killed_rename)
        monkeypatch.setattr(safety, "_remove_tree", killed_remove_tree)

    def _step(self) -> None:
        self.steps += 1
        if self.steps - 1 == self.at:
            raise Killed


def steps_of(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, old: bool) -> int:
    """The number of kill points in a commit (with or without an old output to replace)."""
    dst = tmp_path / "count" / "dst"
    if old:
        run(dst, "old")
    with monkeypatch.context() as patch:
        points = KillPoints(patch)
        run(dst, "new")
    shutil.rmtree(dst.parent)
    return points.steps


def leftovers(dst: Path) -> list[str]:
    """What is beside DST (a failed run removes the parent folders it made for DST)."""
    return sorted(p.name for p in dst.parent.iterdir() if p.name != dst.name) if dst.parent.exists() else []


@pytest.mark.parametrize("old", [True, False])
def test_a_kill_at_every_step_of_the_commit_loses_nothing(tmp_path, monkeypatch, caplog, old):
    steps = steps_of(tmp_path, monkeypatch, old)
    assert steps == (5 if old else 2)  # ready, DST -> old, ready -> DST, old -> partial, delete; or the first and third
    expected = {"old": output(tmp_path, "old"), "new": output(tmp_path, "new")}
    for at in range(steps):
        dst = tmp_path / f"kill-{at}" / "dst"
        if old:
            run(dst, "old")
        with monkeypatch.context() as patch, pytest.raises(Killed):
            KillPoints(patch, at)
            run(dst, "new")
        caplog.clear()
        with caplog.at_level(logging.WARNING), pytest.raises(ConversionError, match="bad source"):
            run(dst, "other", fails=True)  # the next run recovers first, whatever happens to it after
        assert leftovers(dst) == [], at
        got = listing(dst) if dst.exists() else None
        lines = [record.getMessage() for record in caplog.records]
        assert len(lines) <= 1 and all("\n" not in line for line in lines)
        if got == expected["new"]:
            assert at >= 1 and (at >= 3 or "DST holds its new output" in lines[0]), (at, lines)
        elif not old:  # killed before the new output was marked complete: there is nothing to keep
            assert got is None and at == 0, (at, got)
        else:
            assert got == expected["old"], (at, got)
            assert at == 0 or "kept DST's output" in lines[0], (at, lines)


def test_a_kill_during_the_recovery_loses_nothing_either(tmp_path, monkeypatch):
    """The recovery is made of the same steps: killed in it, the run after still finds a state it can finish."""
    expected = {"old": output(tmp_path, "old"), "new": output(tmp_path, "new")}
    for first, second in itertools.product(range(5), range(4)):
        dst = tmp_path / f"kill-{first}-{second}" / "dst"
        run(dst, "old")
        with monkeypatch.context() as patch, pytest.raises(Killed):
            KillPoints(patch, first)
            run(dst, "new")
        with monkeypatch.context() as patch:
            KillPoints(patch, second)
            with pytest.raises((Killed, ConversionError)):
                run(dst, "other", fails=True)
        with pytest.raises(ConversionError, match="bad source"):
            run(dst, "other", fails=True)
        assert leftovers(dst) == [], (first, second)
        assert listing(dst) in (expected["old"], expected["new"]), (first, second)


def test_an_old_output_moved_aside_is_put_back_when_dst_is_absent(tmp_path, caplog):
    """The state a commit killed between its two renames leaves without a record of completion: DST absent, the old
    output in .DST.old-*, a staging folder in .DST.partial-*. The next run, though it fails on a bad source, puts
    the old output back and removes the unfinished one."""
    parent = tmp_path / "out"
    dst = parent / "dst"
    convert_checkpoint(SRC, dst, from_format="fast_llm", to_format="hf")
    old = listing(dst)
    os.rename(dst, parent / ".dst.old-0a1b2c3d")
    shutil.copytree(parent / ".dst.old-0a1b2c3d", parent / ".dst.partial-4e5f6a7b")
    (tmp_path / "bad").mkdir()
    with caplog.at_level(logging.WARNING), pytest.raises(ConversionError, match="not a Fast-LLM checkpoint"):
        convert_checkpoint(tmp_path / "bad", dst, from_format="fast_llm", to_format="hf", force=True)
    assert listing(dst) == old and leftovers(dst) == []
    (line,) = [record.getMessage() for record in caplog.records]
    assert "restored DST's previous output" in line and "removed the unfinished output" in line


def test_a_run_on_a_missing_source_still_recovers_first(tmp_path):
    parent = tmp_path / "out"
    parent.mkdir()
    (parent / ".dst.old-0a1b2c3d").mkdir()
    write_output(parent / ".dst.old-0a1b2c3d", "old")
    with pytest.raises(ConversionError, match="does not exist"):
        convert_checkpoint(tmp_path / "missing", parent / "dst", from_format="fast_llm", to_format="hf", force=True)
    assert listing(parent / "dst") == output(tmp_path, "old") and leftovers(parent / "dst") == []


def test_a_complete_new_output_is_put_in_place_when_dst_is_absent(tmp_path, caplog):
    parent = tmp_path / "out"
    parent.mkdir()
    (parent / ".dst.ready-0a1b2c3d").mkdir()
    write_output(parent / ".dst.ready-0a1b2c3d", "new")
    (parent / ".dst.old-0a1b2c3d").mkdir()
    write_output(parent / ".dst.old-0a1b2c3d", "old")
    # without --force: refused, but only after the recovery
    with caplog.at_level(logging.WARNING), pytest.raises(ConversionError, match="already exists"), \
            atomic_output_dir(parent / "dst"):
        pass
    assert listing(parent / "dst") == output(tmp_path, "new") and leftovers(parent / "dst") == []
    assert "DST holds its new output" in caplog.records[0].getMessage()


def test_a_dst_made_by_hand_beside_an_interrupted_commit_is_not_touched(tmp_path):
    parent = tmp_path / "out"
    for name in (".dst.ready-0a1b2c3d", ".dst.old-0a1b2c3d", "dst"):
        (parent / name).mkdir(parents=True)
        write_output(parent / name, name)
    before = listing(parent)
    with pytest.raises(ConversionError) as caught:
        run(parent / "dst", "new")
    assert "move what you want to keep" in str(caught.value) and "\n" not in str(caught.value)
    assert listing(parent) == before


def test_folders_of_other_destinations_and_links_are_left_alone(tmp_path):
    parent = tmp_path / "out"
    parent.mkdir()
    (tmp_path / "target").mkdir()
    others = [".dst.x.ready-0a1b2c3d", ".other.old-0a1b2c3d", "dst.old-0a1b2c3d"]
    for name in others:
        (parent / name).mkdir()
    (parent / ".dst.old-0a1b2c3d").symlink_to(tmp_path / "target")  # not a folder of ours: never followed
    run(parent / "dst", "new")
    assert sorted(p.name for p in parent.iterdir()) == sorted(["dst", ".dst.old-0a1b2c3d", *others])
    assert (tmp_path / "target").is_dir()


_KILLED_RUN = textwrap.dedent("""
    import os, signal, sys
    from hybrid_linear_models.conversion import safety
    from hybrid_linear_cli.convert import main

    rename, calls = safety._rename, []

    def rename_then_die(source, target):  # the process dies right after the commit moved the old output aside
        rename(source, target)
        calls.append(target)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGKILL)

    safety._rename = rename_then_die
    sys.exit(main(sys.argv[1:]))
""")


@pytest.mark.slow
def test_sigkill_between_the_renames_of_a_force_commit(tmp_path, caplog):
    """A real kill -9 between the two renames: the next run (here one that fails on a bad source) puts the new,
    complete output in place and says so on one line."""
    dst = tmp_path / "out" / "dst"
    convert_checkpoint(SRC, dst, from_format="fast_llm", to_format="hf", dtype="float32")
    script = tmp_path / "killed_run.py"
    script.write_text(_KILLED_RUN)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    killed = subprocess.run([sys.executable, str(script), "--from", "fast_llm", "--to", "hf", "--quiet", "--force",
                             "--dtype", "bfloat16", str(SRC), str(dst)],
                            env=env, capture_output=True, text=True, timeout=600, check=False)
    assert killed.returncode == -9, killed.stderr
    assert not dst.exists() and len(leftovers(dst)) == 3  # .dst.ready-*, .dst.old-*, the lock file
    (tmp_path / "bad").mkdir()
    with caplog.at_level(logging.WARNING), pytest.raises(ConversionError, match="not a Fast-LLM checkpoint"):
        convert_checkpoint(tmp_path / "bad", dst, from_format="fast_llm", to_format="hf", force=True)
    (line,) = [record.getMessage() for record in caplog.records]
    assert "DST holds its new output" in line and "\n" not in line
    assert '"dtype": "bfloat16"' in (dst / "config.json").read_text() and leftovers(dst) == []


def test_the_command_line_says_what_it_did_on_one_line(tmp_path, capsys):
    """The recovery's line reaches stderr from the command line, before the run's own refusal."""
    from hybrid_linear_cli.convert import main

    parent = tmp_path / "out"
    parent.mkdir()
    (parent / ".dst.old-0a1b2c3d").mkdir()
    write_output(parent / ".dst.old-0a1b2c3d", "old")
    (tmp_path / "bad").mkdir()
    assert main(["--from", "fast_llm", "--to", "hf", "--quiet", "--force", str(tmp_path / "bad"),
                 str(parent / "dst")]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2 and "restored DST's previous output" in lines[0] and "error:" in lines[1], lines
    assert listing(parent / "dst") == output(tmp_path, "old") and leftovers(parent / "dst") == []
