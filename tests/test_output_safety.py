"""The converter's output folder under hostile input: where DST may be, what --force may replace, the lock on DST,
leftovers of killed runs, and SIGTERM / SIGHUP in the middle of writing (in a subprocess stopped while it writes)."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from distributed_helpers import SUBPROCESS_TIMEOUT

from hybrid_linear_cli.conversion_catalogue import TOKENIZER_FILES
from hybrid_linear_cli.convert import main
from hybrid_linear_models import HybridLinearConfig, HybridLinearForCausalLM
from hybrid_linear_models.conversion import FORMATS, ConversionError, convert_checkpoint
from hybrid_linear_models.conversion.interrupts import Interrupted, signals_deferred, stop_signals_raise

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "tests" / "fixtures" / "fast_llm" / "hybrid_attn_gdn_kda" / "fast_llm"
STARTUP_TIMEOUT = SUBPROCESS_TIMEOUT  # for a subprocess to import torch and reach the writer: ends a hang only


def convert(dst, force: bool = True, to_format: str = "hf", src: Path = SRC, **options):
    return convert_checkpoint(src, dst, from_format="fast_llm", to_format=to_format, force=force, **options)


def listing(folder: Path) -> dict[str, bytes | None]:
    """Every entry under `folder` with its bytes (None for folders), to show that nothing changed."""
    return {str(p.relative_to(folder)): None if p.is_dir() else p.read_bytes() for p in sorted(folder.rglob("*"))}


def refused(dst, *fragments: str, **options) -> str:
    with pytest.raises(ConversionError) as caught:
        convert(dst, **options)
    message = str(caught.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, message
    return message


@pytest.fixture
def workdir(tmp_path, monkeypatch) -> Path:
    """A working directory holding a user's file, as the current directory."""
    folder = tmp_path / "work" / "here"
    folder.mkdir(parents=True)
    (folder / "thesis.tex").write_text("years of work")
    monkeypatch.chdir(folder)
    return folder


# --------------------------------------------------------------------------------------------- where DST may be


@pytest.mark.parametrize("dst, what", [(".", "is the working directory"), ("..", "is an ancestor of the working"),
                                       ("../..", "is an ancestor of the working"), ("/", "is the filesystem root"),
                                       ("sub/..", "is the working directory")])
def test_dst_never_the_working_directory_its_ancestors_or_root(workdir, dst, what):
    before = listing(workdir)
    refused(dst, what, "give the path of a new folder")
    assert listing(workdir) == before


def test_unset_variable_as_dst_is_refused_with_its_own_message(workdir, capsys):
    """`hybrid-linear-convert ... SRC "$UNSET" --force` (an empty DST) is refused; it would replace the current
    directory with the model."""
    before = listing(workdir)
    for empty in ("", "  "):
        assert main(["--from", "fast_llm", "--to", "hf", str(SRC), empty, "--force", "--quiet"]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "DST is an empty string (an unset shell variable?)" in err
    assert listing(workdir) == before


def test_dst_never_the_home_folder(workdir, tmp_path, monkeypatch):
    env_home, pw_home = tmp_path / "env-home", tmp_path / "pw-home"
    for home in (env_home, pw_home):
        home.mkdir()
        (home / ".bashrc").write_text("keep")
    monkeypatch.setenv("HOME", str(env_home))
    monkeypatch.setattr(Path, "home", classmethod(lambda cls: pw_home))  # the password database's home
    refused(env_home, "is your home folder")
    refused(pw_home, "is your home folder")
    assert (env_home / ".bashrc").read_text() == (pw_home / ".bashrc").read_text() == "keep"


def test_dst_never_overlaps_src(tmp_path):
    src = Path(shutil.copytree(SRC, tmp_path / "ckpts" / "src"))
    before = listing(tmp_path)
    refused(src, "overlaps SRC", src=src)
    refused(src / "out", "overlaps SRC", src=src)
    refused(src.parent, "overlaps SRC", src=src)
    assert listing(tmp_path) == before


def test_dst_that_is_a_file_or_a_symlink_is_refused(tmp_path):
    file = tmp_path / "model.bin"
    file.write_text("not a folder")
    refused(file, "exists and is not a folder")
    target = tmp_path / "target"
    convert(target, force=False)
    link = tmp_path / "link"
    link.symlink_to(target)
    refused(link, "is a symbolic link")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    refused(tmp_path / "dangling", "is a symbolic link")
    assert file.read_text() == "not a folder" and link.resolve() == target and not (tmp_path / "nowhere").exists()


# --------------------------------------------------------------------------------------------- what --force replaces


def test_force_refuses_a_folder_with_a_users_file(tmp_path):
    dst = tmp_path / "dst"
    convert(dst)
    (dst / "notes.txt").write_text("mine")
    before = listing(dst)
    refused(dst, "holds 'notes.txt'", "a file that a hf checkpoint does not have", "delete it yourself",
            "choose another DST")
    assert listing(dst) == before


def test_force_refuses_a_folder_with_a_sub_folder(tmp_path):
    dst = tmp_path / "dst"
    convert(dst)
    (dst / "checkpoints").mkdir()
    refused(dst, "holds 'checkpoints', a folder")
    assert (dst / "checkpoints").is_dir()


@pytest.mark.parametrize("config", [None, {"model_type": "llama"}, "{ not json"])
def test_force_refuses_a_folder_without_the_formats_marker(tmp_path, config):
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "model.safetensors").write_bytes(b"someone else's weights")
    if config is not None:
        (dst / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    refused(dst, "is not a hf checkpoint", "config.json with model_type 'hybrid_linear'")
    assert (dst / "model.safetensors").read_bytes() == b"someone else's weights"


def test_force_refuses_another_formats_output(tmp_path):
    dst = tmp_path / "dst"
    convert(dst, to_format="fast_llm")
    refused(dst, "holds 'metadata.yaml'", "hf checkpoint")
    assert (dst / "metadata.yaml").is_file()


def test_force_replaces_an_empty_folder(tmp_path):
    """Allowed: an empty folder holds nothing to lose (a user may create DST first)."""
    dst = tmp_path / "dst"
    dst.mkdir()
    convert(dst)
    assert (dst / "model.safetensors").is_file()


@pytest.mark.parametrize("to_format", ["hf", "fast_llm"])
def test_force_replaces_the_formats_own_output_sharded_with_tokenizer(tmp_path, to_format):
    dst = tmp_path / "dst"
    convert(dst, to_format=to_format, max_shard_size="100kB", dtype="float32")
    written = sorted(p.name for p in dst.iterdir())
    assert len([name for name in written if name.endswith(".safetensors")]) > 1  # sharded
    if to_format == "hf":
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
            (dst / name).write_text("{}")
    convert(dst, to_format=to_format, dtype="bfloat16")
    assert len(list(dst.glob("*.safetensors"))) == 1  # the new, unsharded output replaced the old one
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst"]  # no .old-* folder, lock file or staging left


def test_each_writers_output_matches_its_registration(tmp_path):
    """The files each writer creates (one file or shards) are the ones its registration declares: --force can
    replace every folder the converter writes. Each writer converts the first of these sources its format can
    express: the Fast-LLM fixture (GDN, KDA and attention), a Qwen3-Next-like model (our defaults: GDN and gated
    attention, zero-centred norms), an fla-like one (GDN and plain attention, plain norms), a Kimi-like one (KDA,
    plain norms)."""
    small = dict(vocab_size=64, hidden_size=32, intermediate_size=48, head_dim=8, num_attention_heads=4,
                 gdn_num_key_heads=2, gdn_num_value_heads=4, gdn_key_head_dim=8, gdn_value_head_dim=8)
    fla_like = dict(small, layer_types=["gated_deltanet", "full_attention"], zero_centered_norms=False,
                    attention_output_gate=False, attention_qk_norm=False,
                    rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 1.0})
    kimi_like = dict(small, layer_types=["kimi_delta_attention"] * 2, zero_centered_norms=False, kda_num_heads=2,
                     kda_head_dim=8)
    sources = [SRC]
    for index, settings in enumerate((small, fla_like, kimi_like)):
        sources.append(tmp_path / f"source-{index}")
        HybridLinearForCausalLM(HybridLinearConfig(**settings)).save_pretrained(sources[-1])
    source_format = {SRC: "fast_llm"}
    for name, fmt in FORMATS.items():
        if not fmt.can_write:
            continue
        fitting = [src for src in sources if _expresses(fmt, FORMATS[source_format.get(src, "hf")].read(src).config)]
        assert fitting, f"no test source fits the {name} writer"
        written = set()
        for shard in ("5GB", "10kB"):
            dst = tmp_path / f"{name}-{shard}"
            convert_checkpoint(fitting[0], dst, from_format=source_format.get(fitting[0], "hf"), to_format=name,
                               max_shard_size=shard)
            unexpected = [p.name for p in dst.iterdir() if not fmt.output.writes(p.name) or p.is_dir()]
            assert not unexpected, (name, unexpected)
            assert (dst / fmt.output.marker).is_file()
            written |= {p.name for p in dst.iterdir()}
            if shard == "10kB":
                assert len(list(dst.glob("*.safetensors"))) > 1, name  # the sharded layout was exercised
        # and the layout names nothing these writers never write (the carried tensors' file needs carried tensors)
        assert set(fmt.output.files) - written <= {"extra_tensors.safetensors"}, name


def _expresses(fmt, config) -> bool:
    try:
        fmt.target_rows(config)
    except ConversionError:
        return False
    return True


# --------------------------------------------------------------------------------------------- lock and leftovers


def test_leftovers_of_a_killed_run_are_removed_and_only_those(tmp_path):
    """Unfinished outputs of this DST are removed; an output moved aside is kept (see test_output_commit.py)."""
    parent = tmp_path / "out"
    parent.mkdir()
    own = [".dst.partial-0a1b2c3d", ".dst.partial-x_9yz0ab"]  # the last: tempfile's naming
    others = [".other.partial-0a1b2c3d", ".dst.x.partial-0a1b2c3d", ".dst.partial-0a1b2c3d.partial-0a1b2c3d",
              "dst.partial-0a1b2c3d", ".dst.partial-unfinished-name"]
    for name in own + others:
        (parent / name).mkdir()
        (parent / name / "model_0.safetensors").write_bytes(b"partial")
    (parent / ".dst.lock").write_text("")  # a killed run's lock file: no one holds it
    convert(parent / "dst", force=False)
    assert sorted(p.name for p in parent.iterdir()) == sorted(["dst", *others])


@pytest.mark.slow  # a conversion in a subprocess
def test_two_processes_on_one_dst(tmp_path):
    """A run on a DST that another process is writing fails at once and leaves it alone; the writer then finishes,
    and a later run (the newest success) replaces its output. No .old-*, staging folder or lock file stays."""
    parent = tmp_path / "out"
    dst = parent / "dst"
    writer, go = start_blocked_conversion(tmp_path, "cli", dst)
    assert (parent / ".dst.lock").is_file()
    refused(dst, "another conversion is writing DST", "wait for it to finish or choose another DST")
    assert writer.poll() is None  # refused while the writer, blocked until `go`, still holds the lock: no wait
    go.touch()
    assert writer.wait(timeout=STARTUP_TIMEOUT) == 0, writer.stderr.read()
    assert '"dtype": "float32"' in (dst / "config.json").read_text()
    convert(dst, dtype="bfloat16")
    assert '"dtype": "bfloat16"' in (dst / "config.json").read_text()
    assert sorted(p.name for p in parent.iterdir()) == ["dst"]


def test_a_held_lock_is_respected_and_a_stale_lock_file_is_not(tmp_path):
    dst = tmp_path / "dst"
    lock = tmp_path / ".dst.lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # another open file description: conflicts like another process
        refused(dst, "another conversion is writing DST", ".dst.lock")
        assert not dst.exists() and lock.exists()
    finally:
        os.close(fd)
    convert(dst)  # the same file, no longer held
    assert (dst / "model.safetensors").is_file() and not lock.exists()


# --------------------------------------------------------------------------------------------- signals


_BLOCKING_RUN = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from hybrid_linear_models.conversion import api

    mode, src, dst, ready, go, *flags = sys.argv[1:]
    stream = api._with_progress

    def gated(plan, quiet, label):  # the writer's input: stops after the first tensor until `go` exists
        for index, item in enumerate(stream(plan, quiet, label)):
            if index == 1:
                Path(ready).touch()
                while not Path(go).exists():
                    time.sleep(0.01)
            yield item

    api._with_progress = gated
    if mode == "cli":
        from hybrid_linear_cli.convert import main
        sys.exit(main(["--from", "fast_llm", "--to", "hf", src, dst, "--quiet", "--dtype", "float32", *flags]))
    api.convert_checkpoint(src, dst, from_format="fast_llm", to_format="hf", dtype="float32", force=bool(flags))
""")


def start_blocked_conversion(tmp_path: Path, mode: str, dst: Path, *flags: str) -> tuple[subprocess.Popen, Path]:
    """A subprocess converting SRC into `dst`, stopped while writing (its staging folder exists); returns it and the
    file whose creation lets it go on."""
    control = tmp_path / "control"
    control.mkdir(exist_ok=True)
    script, ready, go = control / "blocking_run.py", control / "ready", control / "go"
    script.write_text(_BLOCKING_RUN)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    process = subprocess.Popen([sys.executable, str(script), mode, str(SRC), str(dst), str(ready), str(go), *flags],
                               cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while not ready.exists():
        if process.poll() is not None:
            pytest.fail(f"the conversion ended before writing: {process.stderr.read()}")
        if time.monotonic() > deadline:
            process.kill()
            pytest.fail("the conversion did not start writing in time")
        time.sleep(0.02)
    assert list(dst.parent.glob(f".{dst.name}.partial-*")), "no staging folder while writing"
    return process, go


@pytest.mark.parametrize("mode, signum, status", [  # each signal once, each way of running once (a subprocess is slow)
    ("cli", signal.SIGTERM, 128 + signal.SIGTERM),
    ("api", signal.SIGHUP, -signal.SIGHUP),  # the API cleans up, then lets the signal end the process as usual
])
@pytest.mark.slow  # a conversion in a subprocess
def test_signal_while_writing_cleans_up(tmp_path, mode, signum, status):
    parent = tmp_path / "out"
    parent.mkdir()
    dst = parent / "dst"
    convert(dst, force=False)  # an old output, to be left as it was
    before = listing(parent)
    process, _ = start_blocked_conversion(tmp_path, mode, dst, "--force")
    process.send_signal(signum)
    assert process.wait(timeout=STARTUP_TIMEOUT) == status  # a bound that catches a hang only
    assert listing(parent) == before  # DST unchanged; no .dst.partial-*, .dst.old-* or .dst.lock
    err = process.stderr.read()
    assert "Traceback" not in err
    if mode == "cli":
        assert err.strip() == f"hybrid-linear-convert: stopped by {signal.Signals(signum).name}; no partial output " \
                              "was left at DST."


def test_a_signal_during_the_final_renames_waits_for_them():
    previous = signal.getsignal(signal.SIGTERM)
    finished = []
    with pytest.raises(Interrupted) as caught, stop_signals_raise(), signals_deferred():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)  # the handler runs here, and defers
        finished.append(True)
    assert finished and caught.value.signum == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) == previous


def test_an_ignored_signal_stays_ignored():
    """Under nohup SIGHUP is ignored: the conversion must not make it fatal again."""
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with stop_signals_raise():
            assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, signal.SIG_IGN)
    finally:
        signal.signal(signal.SIGHUP, previous)


def test_failed_run_removes_the_folders_it_made_for_dst(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConversionError, match="not a Fast-LLM checkpoint"):
        convert_checkpoint(tmp_path / "empty", tmp_path / "a" / "b" / "dst", from_format="fast_llm", to_format="hf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]


def test_messages_show_long_or_odd_paths_briefly(tmp_path):
    dst = tmp_path / ("x" * 200) / "line\nbreak"
    dst.mkdir(parents=True)
    (dst / "notes.txt").write_text("mine")
    message = refused(dst, "line\\nbreak", "...")
    assert len(message) < 400 and "x" * 101 not in message


# --------------------------------------------------------------------------------------------- the output layout


def tokenizer_folder(folder: Path, names=TOKENIZER_FILES) -> Path:
    """A tokenizer folder holding `names` (tokenizer.json a valid one with ids 0 and 1)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        (folder / name).write_text("{}\n")
    if "tokenizer.json" in names:
        (folder / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"a": 0, "b": 1}}, "added_tokens": []}))
    return folder


@pytest.mark.parametrize("name", ["my_notes.py", "utils.py", "modeling_hybrid_linear.py.orig", "notes.txt",
                                  "tokenizer.json.bak", "Model.safetensors", "model-1-of-2.safetensors"])
def test_force_never_removes_a_file_the_converter_does_not_write(tmp_path, name):
    """Only the names the writer writes may be replaced: a user's module beside the shipped sources is not one."""
    dst = tmp_path / "dst"
    convert(dst)
    (dst / name).write_text("mine")
    before = listing(dst)
    refused(dst, f"holds {name!r}", "delete it yourself")
    assert listing(dst) == before


def test_force_replaces_its_own_output_with_every_tokenizer_file(tmp_path):
    """Whatever tokenizer files the converter copied (chat_template.json, vocab.txt included), --force replaces the
    folder; and the layout names exactly what the writer writes, nothing more."""
    dst = tmp_path / "dst"
    tokenizer = tokenizer_folder(tmp_path / "tokenizer")
    result = convert(dst, tokenizer=tokenizer)
    assert set(result.tokenizer_files) == set(TOKENIZER_FILES)
    written = {path.name for path in dst.iterdir()}
    layout = FORMATS["hf"].output
    assert all(layout.writes(name) for name in written)
    never_here = {"model.safetensors.index.json", "extra_tensors.safetensors"}  # unsharded; no carried tensors
    assert set(layout.files) | set(TOKENIZER_FILES) == written | never_here
    assert not any(layout.writes(name) for name in ("my_notes.py", "utils.py", "model_0.safetensors"))
    convert(dst, tokenizer=tokenizer, dtype="bfloat16")
    assert '"dtype": "bfloat16"' in (dst / "config.json").read_text()


@pytest.mark.parametrize("kind", ["folder", "symbolic link", "special file"])
def test_force_refuses_what_is_not_a_regular_file_under_a_layout_name(tmp_path, kind):
    """The converter writes regular files only: a folder, link or FIFO named like one of its files is not its own."""
    dst = tmp_path / "dst"
    convert(dst)
    target = dst / "vocab.txt"
    if kind == "folder":
        target.mkdir()
    elif kind == "symbolic link":
        (tmp_path / "elsewhere.txt").write_text("keep")
        target.symlink_to(tmp_path / "elsewhere.txt")
    else:
        os.mkfifo(target)
    refused(dst, f"holds 'vocab.txt', a {kind}")
    assert os.path.lexists(target) and (kind != "symbolic link" or (tmp_path / "elsewhere.txt").read_text() == "keep")


# --------------------------------------------------------------------------------------------- links and names


@pytest.mark.parametrize("existing", [False, True])
def test_a_lock_file_that_is_a_symlink_is_refused(tmp_path, existing):
    """A link planted at .DST.lock would make the run create (or open) a file elsewhere."""
    victim = tmp_path / "elsewhere" / "victim"
    victim.parent.mkdir()
    if existing:
        victim.write_text("keep")
    (tmp_path / ".dst.lock").symlink_to(victim)
    refused(tmp_path / "dst", ".dst.lock is a symbolic link", "remove it")
    assert victim.exists() == existing and (not existing or victim.read_text() == "keep")
    assert (tmp_path / ".dst.lock").is_symlink() and not (tmp_path / "dst").exists()


def test_a_lock_file_that_is_not_a_regular_file_is_refused(tmp_path):
    os.mkfifo(tmp_path / ".dst.lock")
    refused(tmp_path / "dst", ".dst.lock is not a regular file")


def fast_llm_source(tmp_path: Path) -> Path:
    return Path(shutil.copytree(SRC, tmp_path / "src"))


@pytest.mark.parametrize("name", ["tokenizer.json", "vocab.txt", "chat_template.json"])
def test_a_tokenizer_file_linked_from_outside_src_is_refused(tmp_path, name):
    """Nothing outside SRC is read or copied: a link in SRC to a file elsewhere is refused by name."""
    src = tokenizer_folder(fast_llm_source(tmp_path), ["tokenizer.json", "tokenizer_config.json"])
    secret = tmp_path / "secret"
    tokenizer_folder(secret)
    (src / name).unlink(missing_ok=True)
    (src / name).symlink_to(secret / name)
    refused(tmp_path / "dst", f"{name} is a symbolic link to", "outside", "cp -L", src=src)
    assert not (tmp_path / "dst").exists()


def test_a_tokenizer_folder_linking_outside_itself_is_refused(tmp_path):
    tokenizer = tokenizer_folder(tmp_path / "tokenizer", ["tokenizer.json"])
    (tmp_path / "passwords").write_text("secret")
    (tokenizer / "vocab.txt").symlink_to(tmp_path / "passwords")
    refused(tmp_path / "dst", "vocab.txt is a symbolic link to", tokenizer=tokenizer)


def test_a_tokenizer_link_inside_its_folder_is_followed_and_a_fifo_refused(tmp_path):
    src = fast_llm_source(tmp_path)
    (src / "blobs").mkdir()
    tokenizer_folder(src / "blobs", ["tokenizer.json"])
    (src / "tokenizer.json").symlink_to(src / "blobs" / "tokenizer.json")
    result = convert(tmp_path / "dst", src=src)
    assert result.tokenizer_files == ("tokenizer.json",)
    copied = tmp_path / "dst" / "tokenizer.json"
    assert not copied.is_symlink() and copied.read_bytes() == (src / "blobs" / "tokenizer.json").read_bytes()
    os.mkfifo(src / "vocab.txt")
    refused(tmp_path / "other", "vocab.txt is not a regular file", src=src)  # at once: the FIFO is never opened


@pytest.mark.parametrize("name", ["d" * 237, "d" * 238, "d" * 250, "d" * 255, "é" * 127])
def test_destination_names_up_to_the_filesystems_limit(tmp_path, name):
    """The names beside DST (lock, staging, retired) fit the limit whatever DST's name; each DST has its own."""
    dst = tmp_path / name
    convert(dst, to_format="fast_llm")
    convert(dst, to_format="fast_llm", dtype="bfloat16")  # --force: the old output moved aside, then deleted
    sibling = tmp_path / (name[:-1] + "e")  # same length, another DST: its own side names
    convert(sibling, to_format="fast_llm")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([name, sibling.name])


def test_a_destination_name_longer_than_the_filesystem_allows_is_refused(tmp_path):
    refused(tmp_path / ("d" * 256), "DST's name is 256 bytes long, more than the 255", "choose a shorter name")
    refused(tmp_path / ("é" * 128), "DST's name is 256 bytes long")
    assert list(tmp_path.iterdir()) == []


def test_a_hub_cache_snapshot_links_into_its_own_blobs(tmp_path):
    """A Hugging Face cache snapshot holds links into its repository's blob store: those are followed; a link out of
    the repository is not."""
    repo = tmp_path / "hub" / "models--org--model"
    snapshot = Path(shutil.copytree(SRC, repo / "snapshots" / "0123abcd"))
    tokenizer_folder(repo / "blobs", ["tokenizer.json"])
    (snapshot / "tokenizer.json").symlink_to(Path("../../blobs/tokenizer.json"))
    assert convert(tmp_path / "dst", src=snapshot).tokenizer_files == ("tokenizer.json",)
    tokenizer_folder(tmp_path / "hub" / "models--other", ["vocab.txt"])
    (snapshot / "vocab.txt").symlink_to(tmp_path / "hub" / "models--other" / "vocab.txt")
    refused(tmp_path / "dst2", "vocab.txt is a symbolic link to", "outside", src=snapshot)
