"""Output folders: appear only when complete, and `--force` never deletes what encoderstack did not write.

Every test works under tmp_path (HOME and the current folder are moved there where they matter), so that no test
can touch a real user folder even when the code under test is wrong.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap

import pytest
from safetensors.torch import load_file
from test_convert_bert import bert_folder, rewrite_weights

import encoderstack
from encoderstack import ConversionError, OutputFolderError
from encoderstack.cli import main
from encoderstack.output_folder import OutputFolder

OURS = {"conversion.json": {"encoderstack_version": "0", "mapped": {}}}


@pytest.fixture
def source(tmp_path):
    return bert_folder(tmp_path / "bert", "ForMaskedLM")


def folder_with(path, files):
    path.mkdir(parents=True)
    for name, content in files.items():
        (path / name).write_text(content if isinstance(content, str) else json.dumps(content))
    return path


def hidden_leftovers(parent):
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


def refused_in_one_line(argv, capsys, match):
    capsys.readouterr()  # what the test's own setup printed
    assert main(argv) == 2
    error = capsys.readouterr().err
    assert error.startswith("encoderstack: error: ") and error.count("\n") == 1, error
    assert match in error, error


# --- what --force replaces ---------------------------------------------------------------------------------------


def test_an_existing_output_folder_is_never_touched_without_force(source, tmp_path):
    output = folder_with(tmp_path / "out", {"precious.txt": "keep me"})
    with pytest.raises(OutputFolderError, match="already exists; pass --force"):
        encoderstack.convert(source, output)
    assert [p.name for p in output.iterdir()] == ["precious.txt"]


def test_force_replaces_a_folder_that_an_earlier_conversion_wrote(source, tmp_path):
    output = encoderstack.convert(source, tmp_path / "out", verify=False)
    (output / "stale.txt").write_text("from the earlier run")
    encoderstack.convert(source, output, force=True, verify=False)
    assert not (output / "stale.txt").exists() and (output / "model.safetensors").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bert", "out"]


def test_force_replaces_what_export_bert_wrote(source, tmp_path):
    converted = encoderstack.convert(source, tmp_path / "es", verify=False)
    back = encoderstack.export_bert(converted, tmp_path / "back")
    assert json.loads((back / "export.json").read_text())["exported_from"] == str(converted)
    (back / "stale.txt").write_text("from the earlier run")
    encoderstack.export_bert(converted, back, force=True)
    assert not (back / "stale.txt").exists()


def test_force_replaces_an_empty_folder(tmp_path):
    (tmp_path / "out").mkdir()
    with OutputFolder(tmp_path / "out", force=True) as partial:
        (partial / "new.txt").write_text("new")
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["new.txt"]


def test_force_refuses_a_folder_that_is_not_ours(source, tmp_path, capsys):
    output = folder_with(tmp_path / "out", {"precious.txt": "keep me", "config.json": "{}"})
    refused_in_one_line(
        ["convert", str(source), str(output), "--force"],
        capsys,
        "not replaced: encoderstack did not write it (it holds none of conversion.json",
    )
    assert sorted(p.name for p in output.iterdir()) == ["config.json", "precious.txt"]
    assert hidden_leftovers(tmp_path) == []


def test_force_refuses_a_record_file_that_is_not_our_record(tmp_path):
    output = folder_with(tmp_path / "out", {"conversion.json": {"mine": True}, "precious.txt": "keep me"})
    with pytest.raises(OutputFolderError, match="encoderstack did not write it"):
        OutputFolder(output, force=True)


def test_force_refuses_the_current_folder_and_every_folder_above_it(tmp_path, monkeypatch):
    work = folder_with(tmp_path / "work", OURS)  # looks like ours: only being the current folder protects it
    monkeypatch.chdir(work)
    for path in (".", work, tmp_path, "/"):
        with pytest.raises(OutputFolderError, match="not replaced: it is or holds the current folder"):
            OutputFolder(path, force=True)
    assert (work / "conversion.json").exists()


def test_force_refuses_the_home_folder_and_every_folder_above_it(tmp_path, monkeypatch):
    home = folder_with(tmp_path / "users" / "me", OURS)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(folder_with(tmp_path / "elsewhere", {}))
    for path in (home, home.parent):
        with pytest.raises(OutputFolderError, match="not replaced: it is or holds your home folder"):
            OutputFolder(path, force=True)
    assert (home / "conversion.json").exists()


def test_force_refuses_a_file_at_the_output_path(source, tmp_path, capsys):
    (tmp_path / "out").write_text("a file")
    refused_in_one_line(
        ["convert", str(source), str(tmp_path / "out"), "--force"], capsys, "not replaced: it is a file, not a folder"
    )
    assert (tmp_path / "out").read_text() == "a file"


def test_force_refuses_a_link_at_the_output_path(tmp_path):
    ours = folder_with(tmp_path / "ours", OURS)
    (tmp_path / "link").symlink_to(ours)
    with pytest.raises(OutputFolderError, match="not replaced: it is a symbolic link"):
        OutputFolder(tmp_path / "link", force=True)
    assert (tmp_path / "link").is_symlink() and (ours / "conversion.json").exists()


# --- the inputs are never inside the output, nor the output inside them -----------------------------------------


def test_a_source_inside_the_output_folder_is_refused_and_kept(tmp_path, monkeypatch, capsys):
    work = tmp_path / "work"
    bert_folder(work / "mybert", "ForMaskedLM")
    (work / "notes.txt").write_text("mine")
    monkeypatch.chdir(work)
    refused_in_one_line(["convert", "mybert", ".", "--force"], capsys, "lies inside the output folder")
    assert sorted(p.name for p in work.iterdir()) == ["mybert", "notes.txt"]
    assert (work / "mybert" / "model.safetensors").exists()


def test_a_source_inside_an_output_folder_of_ours_is_refused(tmp_path):
    holder = folder_with(tmp_path / "holder", OURS)
    source = bert_folder(holder / "bert", "ForMaskedLM")
    (tmp_path / "link").symlink_to(holder)
    with pytest.raises(OutputFolderError, match="lies inside the output folder"):
        encoderstack.convert(source, holder, force=True)
    with pytest.raises(OutputFolderError, match="lies inside the output folder"):
        encoderstack.convert(tmp_path / "link" / "bert", holder, force=True)
    assert (source / "model.safetensors").exists()


def test_a_link_to_the_source_as_output_is_refused(source, tmp_path):
    (tmp_path / "link").symlink_to(source)
    (source / "conversion.json").write_text(json.dumps(OURS["conversion.json"]))  # only the identity protects it
    with pytest.raises(OutputFolderError, match="the output folder is the source"):
        encoderstack.convert(tmp_path / "link", source, force=True)
    with pytest.raises(OutputFolderError, match="the output folder is the source"):
        encoderstack.convert(source, tmp_path / "link", force=True)
    assert (source / "model.safetensors").exists()


def test_an_output_inside_the_source_through_a_link_is_refused(source, tmp_path):
    (tmp_path / "link").symlink_to(source)
    with pytest.raises(OutputFolderError, match="must lie outside the source folder"):
        encoderstack.convert(source, tmp_path / "link" / "converted")
    assert not (source / "converted").exists()


def test_the_output_folder_must_not_lie_inside_the_source(source):
    with pytest.raises(OutputFolderError, match="must lie outside the source folder"):
        encoderstack.convert(source, source / "converted")
    assert not (source / "converted").exists()


def test_an_input_file_inside_the_output_folder_is_refused(tmp_path):
    output = folder_with(tmp_path / "out", {**OURS, "train.csv": "text,label\n"})
    with pytest.raises(OutputFolderError, match="train.csv lies inside the output folder"):
        OutputFolder(output, force=True, inputs=["not-a-local-path", output / "train.csv"])


# --- an output path that cannot be written: one line, exit 2, nothing left behind --------------------------------


def command_writing_to(name, output, source, tiny_model):
    return {
        "convert": ["convert", str(source), str(output)],
        "diagnose": ["diagnose", "--layers", "1", "--steps", "1", "--hidden-size", "16", "--out", str(output)],
        "finetune": ["finetune", "--model", str(tiny_model), "--output", str(output), "--epochs", "1"],
    }[name]


@pytest.mark.parametrize("command", ["convert", "diagnose", "finetune"])
def test_an_output_whose_parent_is_a_file_is_refused_in_one_line(command, source, tiny, tmp_path, capsys):
    (tmp_path / "file").write_text("not a folder")
    output = tmp_path / "file" / "sub" / "out"
    refused_in_one_line(
        command_writing_to(command, output, source, tiny),
        capsys,
        f"{output}: cannot be created: {tmp_path / 'file'} is a file, not a folder",
    )
    assert (tmp_path / "file").read_text() == "not a folder" and hidden_leftovers(tmp_path) == []


@pytest.fixture
def immutable(tmp_path):
    """A folder that not even root can write into (chattr +i), removed again afterwards."""
    folder = tmp_path / "immutable"
    folder.mkdir()
    # Root ignores permission bits, so only the immutable flag makes a folder unwritable here; tmpfs and some
    # overlay file systems do not support it, and then there is no unwritable folder to test against.
    if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(folder)]).returncode != 0:
        pytest.skip("chattr +i is not available on this file system")
    yield folder
    subprocess.run(["chattr", "-i", str(folder)], check=True)


@pytest.mark.parametrize("command", ["convert", "diagnose", "finetune"])
def test_an_output_in_an_immutable_folder_is_refused_in_one_line(command, source, tiny, immutable, capsys):
    output = immutable / "sub" / "out"
    refused_in_one_line(
        command_writing_to(command, output, source, tiny),
        capsys,
        f"{output}: cannot be created in {immutable}: Operation not permitted",
    )
    assert list(immutable.iterdir()) == []


def test_an_output_in_a_folder_that_refuses_new_entries_is_refused(source, tmp_path, monkeypatch, capsys):
    """Read-only or unwritable folders, simulated: the tests run as root, whom permission bits do not stop."""

    def refusing_mkdir(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(os, "mkdir", refusing_mkdir)
    refused_in_one_line(
        ["convert", str(source), str(tmp_path / "out")], capsys, f"cannot be created in {tmp_path}: Permission denied"
    )
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bert"]


def test_a_folder_that_appears_during_the_work_is_not_replaced_without_force(tmp_path):
    with (
        pytest.raises(OutputFolderError, match="already exists; pass --force"),
        OutputFolder(tmp_path / "out", force=False) as partial,
    ):
        (partial / "result.txt").write_text("ours")
        folder_with(tmp_path / "out", {"precious.txt": "made meanwhile"})
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["precious.txt"]


def test_parents_made_for_an_output_that_failed_are_removed(tmp_path):
    with pytest.raises(RuntimeError), OutputFolder(tmp_path / "a" / "b" / "out", force=False):
        raise RuntimeError("the work failed")
    assert list(tmp_path.iterdir()) == []


# --- signals, permissions ----------------------------------------------------------------------------------------


def test_a_sigterm_during_the_write_leaves_no_partial_folder_and_lets_the_callers_cleanup_run(tmp_path):
    here, out = str(tmp_path), str(tmp_path / "out")
    script = textwrap.dedent(f"""
        import tempfile, time
        from encoderstack.output_folder import OutputFolder
        with tempfile.TemporaryDirectory(dir={here!r}), OutputFolder({out!r}, force=False) as partial:
            (partial / "half.bin").write_bytes(b"0" * 1000)
            print("writing", flush=True)
            time.sleep(60)
    """)
    process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline() == "writing\n"
    assert len(hidden_leftovers(tmp_path)) == 1  # the partial folder exists while it writes
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 128 + signal.SIGTERM  # the shell's status for death by that signal
    assert list(tmp_path.iterdir()) == []


def test_a_sigterm_between_making_and_removing_the_probe_folder_leaves_no_probe(source, tmp_path, monkeypatch):
    real = tempfile.mkdtemp

    def mkdtemp(*args, prefix=None, **kwargs):
        folder = real(*args, prefix=prefix, **kwargs)
        if ".probe-" in prefix:
            assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL, "a SIGTERM would end us, now or unblocked"
            signal.raise_signal(signal.SIGTERM)
        return folder

    monkeypatch.setattr(tempfile, "mkdtemp", mkdtemp)
    with pytest.raises(SystemExit) as exit:
        main(["convert", str(source), str(tmp_path / "out")])
    assert exit.value.code == 128 + signal.SIGTERM
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bert"]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_a_sigterm_that_another_thread_receives_during_the_probe_leaves_no_probe(tmp_path):
    """The kernel hands a process's signal to any thread that does not block it (torch and tokenizers start some):
    blocking it in the main thread is not enough, our handler must catch it and hold it until the probe is gone."""
    out = str(tmp_path / "out")
    script = textwrap.dedent(f"""
        import signal, tempfile, threading, time
        from encoderstack.output_folder import OutputFolder
        idle = threading.Thread(target=threading.Event().wait, daemon=True)
        idle.start()
        real = tempfile.mkdtemp
        def mkdtemp(*args, prefix=None, **kwargs):
            folder = real(*args, prefix=prefix, **kwargs)
            if ".probe-" in prefix:
                signal.pthread_kill(idle.ident, signal.SIGTERM)
                time.sleep(1)  # time for the other thread to take it: the default action would end the process now
            return folder
        tempfile.mkdtemp = mkdtemp
        OutputFolder({out!r}, force=False)
    """)
    process = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert process.returncode == 128 + signal.SIGTERM, process.stderr[-3000:]
    assert list(tmp_path.iterdir()) == []


def test_the_default_sigterm_action_is_back_once_the_folder_is_published(tmp_path):
    with OutputFolder(tmp_path / "out", force=False):
        assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, signal.SIG_IGN)
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_a_programs_own_sigterm_handler_stays_in_charge_and_is_restored(tmp_path):
    calls = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: calls.append(signum))
    try:
        with OutputFolder(tmp_path / "out", force=False):
            assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
        handler = signal.getsignal(signal.SIGTERM)
    finally:
        signal.signal(signal.SIGTERM, previous)
    handler(signal.SIGTERM, None)
    assert calls == [signal.SIGTERM]
    assert signal.getsignal(signal.SIGTERM) == previous


@pytest.mark.parametrize("umask, mode", [(0o022, 0o755), (0o002, 0o775), (0o077, 0o700)])
def test_the_published_folder_gets_the_users_umask(umask, mode, tmp_path):
    saved = os.umask(umask)
    try:
        with OutputFolder(tmp_path / "out", force=False) as partial:
            (partial / "sub").mkdir()
    finally:
        os.umask(saved)
    assert (tmp_path / "out").stat().st_mode & 0o777 == mode
    assert (tmp_path / "out" / "sub").stat().st_mode & 0o777 == mode


# --- nothing is read or copied from outside the source folder without saying so ---------------------------------


@pytest.mark.parametrize("where", ["../outside.safetensors", "absolute"])
def test_a_shard_index_naming_a_file_outside_the_folder_is_refused(where, source, tmp_path):
    rewrite_weights(source, shards=2)
    outside = tmp_path / "outside.safetensors"
    shutil.move(source / "model-00002-of-00002.safetensors", outside)  # a valid shard: reading it would work
    name = str(outside) if where == "absolute" else where
    index = json.loads((source / "model.safetensors.index.json").read_text())
    index["weight_map"] = {
        key: name if file.startswith("model-00002") else file for key, file in index["weight_map"].items()
    }
    (source / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ConversionError, match=f"shard {name!r} lies outside the folder"):
        encoderstack.convert(source, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("where", ["secret.txt", "1_Pooling/secret.txt"])
def test_a_link_out_of_the_source_folder_is_not_copied(where, source, tmp_path):
    (tmp_path / "secret.txt").write_text("not part of the checkpoint")
    (source / where).parent.mkdir(exist_ok=True)
    (source / where).symlink_to(tmp_path / "secret.txt")
    with pytest.raises(ConversionError, match=f"{where}: a link to {tmp_path / 'secret.txt'}, outside the source"):
        encoderstack.convert(source, tmp_path / "out", verify=False)
    assert not (tmp_path / "out").exists() and hidden_leftovers(tmp_path) == []


def test_links_inside_the_source_and_into_the_hub_cache_are_copied(tmp_path, monkeypatch):
    import huggingface_hub.constants as hub

    snapshot = tmp_path / "hub" / "models--someone--tiny-bert" / "snapshots" / ("0" * 40)
    bert_folder(snapshot, "ForMaskedLM")
    blob = snapshot.parents[1] / "blobs" / "vocab"
    blob.parent.mkdir()
    blob.write_text("[PAD]\n[UNK]\n")
    (snapshot / "vocab.txt").symlink_to(blob)  # how the Hub cache lays out every snapshot
    (snapshot / "tokenizer.txt").symlink_to(snapshot / "vocab.txt")
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "hub"))
    folder = encoderstack.convert(snapshot, tmp_path / "out", verify=False)
    assert (folder / "vocab.txt").read_text() == (folder / "tokenizer.txt").read_text() == "[PAD]\n[UNK]\n"
    assert not (folder / "vocab.txt").is_symlink()


def test_a_single_weight_file_may_be_a_link_to_the_users_own_checkpoint(source, tmp_path):
    weights = tmp_path / "elsewhere" / "model.safetensors"
    weights.parent.mkdir()
    shutil.move(source / "model.safetensors", weights)
    (source / "model.safetensors").symlink_to(weights)
    folder = encoderstack.convert(source, tmp_path / "out")
    assert load_file(folder / "model.safetensors").keys()
