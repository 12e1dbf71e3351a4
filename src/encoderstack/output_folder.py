"""Output folders that appear only when complete, and that `force` replaces only when encoderstack wrote them.

A folder is built in a hidden sibling and renamed into place at the end; an error, Ctrl-C or a terminating signal
removes the hidden folder instead. `force` replaces an empty folder or one that holds the record one of our commands
writes (see RECORDS), never the current or home folder, a file, a link, or a folder that holds the inputs. The
hidden folders a command keeps beside its output (checkpoints, caches) come from here too, under the same rules.
"""

import json
import os
import shutil
import signal
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path

# The record each command writes into its output folder, with keys it always has: how we know a folder is ours.
RECORDS = (
    ("conversion.json", ("encoderstack_version", "mapped")),  # convert
    ("export.json", ("encoderstack_version", "exported_from")),  # export-bert
    ("export.json", ("encoderstack_version", "opset")),  # export-onnx before it wrote through transformers.exporters
    ("encoderstack_export.json", ("encoderstack_version", "format")),  # export-onnx, export-openvino
    ("finetune.json", ("base_model", "settings", "after")),  # finetune
    ("pretrain.json", ("base_model", "data", "settings", "after")),  # pretrain
    ("results.json", ("settings", "results")),  # diagnose
)
TERMINATING = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))


class OutputFolderError(ValueError):
    """An output folder that cannot be written, or that must not be replaced; the message says why."""


class Terminated(SystemExit):
    """A terminating signal inside an OutputFolder: unwinds through every cleanup (ours and the caller's), then exits
    quietly with the shell's status for that signal, 128 + its number."""


_held = []  # terminating signals that arrived while the main thread was in _signals_deferred
_deferring = 0  # how deep the main thread is in _signals_deferred


def _terminate(signum, frame):
    if _deferring:
        _held.append(signum)
        return
    raise Terminated(128 + signum)


def _terminating_signals_raise() -> dict:
    """Make terminating signals raise Terminated; returns the handlers to put back. Only where the signal would kill
    us without cleanup (the default action, main thread): a program's own handler stays in charge."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {
        signum: signal.signal(signum, _terminate)
        for signum in TERMINATING
        if signal.getsignal(signum) == signal.SIG_DFL
    }


def _restore(handlers: dict) -> None:
    for signum, handler in handlers.items():
        signal.signal(signum, handler)


@contextmanager
def terminating_signals_raise():
    """Inside, SIGTERM and SIGHUP raise `Terminated` as Ctrl-C raises KeyboardInterrupt, so that the caller's
    `finally` (removing its scratch files) runs before the process ends."""
    handlers = _terminating_signals_raise()
    try:
        yield
    finally:
        _restore(handlers)


@contextmanager
def _signals_deferred():
    """Terminating signals that arrive meanwhile wait until the end, so that a cleanup or publish is never cut. The
    calling thread blocks them; in the main thread our handler also holds one that another thread received (torch
    and tokenizers start threads, and the kernel hands a signal to any thread that does not block it)."""
    global _deferring
    main = threading.current_thread() is threading.main_thread()
    _deferring += main
    handlers, mask = {}, None
    try:
        handlers = _terminating_signals_raise()
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, TERMINATING) if hasattr(signal, "pthread_sigmask") else None
        yield
    finally:
        if mask is not None:  # runs the handler of a signal the mask kept back, before it returns: ours holds it
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        _deferring -= main
        _restore(handlers)
        if main and not _deferring and _held:
            signum = _held[0]
            _held.clear()
            raise Terminated(128 + signum)


def _identity(path) -> tuple | None:
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return stat.st_dev, stat.st_ino


def _above(path: Path) -> set:
    """(device, inode) of every folder above the real path: a link, `..` or a bind mount cannot hide one."""
    return {_identity(parent) for parent in Path(os.path.realpath(path)).parents} - {None}


def _record_is_ours(path: Path, keys: tuple) -> bool:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and all(key in record for key in keys)


def _remove_empty(folders: list) -> None:
    """Remove the folders a run made for its output, nearest first, up to the first one that holds something."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            break


def written_by_us(folder: Path) -> bool:
    return any(_record_is_ours(folder / name, keys) for name, keys in RECORDS)


class OutputFolder:
    """A folder that appears only when complete: built in a hidden sibling, renamed into place on success.

    Everything is checked here, before any work: the inputs (`inputs`: the files and folders the result is made
    from; anything that is not a local path, such as None, a Hub id or a model instance, is skipped) may not lie
    inside the output, nor the output inside them, nor may they lie inside a hidden sibling the command deletes
    (`siblings`: the names given to `sibling`); an existing output is replaced only with `force` and only when it
    is ours or empty (checked again before publishing: the work may take hours); the nearest existing folder above
    must take a new folder."""

    def __init__(self, path, force: bool, inputs=(), siblings=()):
        self.path = Path(path).absolute()
        self.force = force
        sources = [Path(item).absolute() for item in inputs if isinstance(item, (str, os.PathLike))]
        for source in (source for source in sources if os.path.lexists(source)):
            self._refuse_overlap(source)
            for name in siblings:
                self._refuse_inside_sibling(source, self.sibling(name))
        self._refuse_existing()
        self._probe_writable()

    def sibling(self, name: str) -> Path:
        """The hidden folder `.OUTPUT.name` beside the output, where a command keeps what outlives a run (checkpoints
        to resume from) until the output is complete."""
        return self.path.parent / f".{self.path.name}.{name}"

    @contextmanager
    def scratch(self, name: str):
        """A new hidden folder `.OUTPUT.name-XXXX` beside the output for the work's own files (a data cache),
        removed at the end, on an error, Ctrl-C, or a terminating signal."""
        created = [parent for parent in self.path.parents if not parent.exists()]
        folder = None
        with terminating_signals_raise():
            try:
                with _signals_deferred():
                    self.path.parent.mkdir(parents=True, exist_ok=True)
                    folder = Path(tempfile.mkdtemp(prefix=f".{self.path.name}.{name}-", dir=self.path.parent))
                yield folder
            finally:
                with _signals_deferred():
                    if folder is not None:
                        shutil.rmtree(folder, ignore_errors=True)
                    _remove_empty(created)

    def _refuse_overlap(self, source: Path):
        output = _identity(self.path)
        if output is not None and output == _identity(source):
            kind = "folder" if source.is_dir() else "file"
            link = "" if os.path.normpath(self.path) == os.path.normpath(source) else " (through a link)"
            raise OutputFolderError(f"{self.path}: the output folder is the source {kind} {source}{link}")
        if _identity(source) in _above(self.path):
            raise OutputFolderError(f"{self.path}: the output folder must lie outside the source folder {source}")
        if output is not None and output in _above(source):
            raise OutputFolderError(
                f"{self.path}: the source {source} lies inside the output folder; replacing the folder would delete it"
            )

    def _refuse_inside_sibling(self, source: Path, sibling: Path):
        if _identity(sibling) is not None and _identity(sibling) in {_identity(source)} | _above(source):
            raise OutputFolderError(
                f"{self.path}: the source {source} lies inside {sibling}, the hidden folder this command keeps beside "
                "its output and deletes; move it out first"
            )

    def _refuse_existing(self):
        if not os.path.lexists(self.path):
            return
        if not self.force:
            raise OutputFolderError(f"{self.path} already exists; pass --force (force=True) to replace it")
        reason = None
        if self.path.is_symlink():
            reason = "it is a symbolic link (name the folder it points to)"
        elif not self.path.is_dir():
            reason = "it is a file, not a folder"
        else:
            for name, folder in (("the current folder", Path.cwd()), ("your home folder", Path.home())):
                if _identity(self.path) in {_identity(folder)} | _above(folder):
                    reason = f"it is or holds {name}"
                    break
            else:
                if any(self.path.iterdir()) and not written_by_us(self.path):
                    reason = (
                        f"encoderstack did not write it (it holds none of {', '.join(dict(RECORDS))}) and it is "
                        "not empty; remove it yourself or choose another output folder"
                    )
        if reason:
            raise OutputFolderError(f"{self.path}: not replaced: {reason}")

    def _probe_writable(self):
        """Create and remove a folder where ours will go: the only test that also holds for root and read-only or
        immutable file systems."""
        above = next(parent for parent in self.path.parents if os.path.lexists(parent))
        if not above.is_dir():
            raise OutputFolderError(f"{self.path}: cannot be created: {above} is a file, not a folder")
        try:
            with _signals_deferred():  # a signal between the two must not leave the probe behind
                os.rmdir(tempfile.mkdtemp(prefix=f".{self.path.name}.probe-", dir=above))
        except OSError as error:
            raise OutputFolderError(f"{self.path}: cannot be created in {above}: {error.strerror}") from None

    def __enter__(self) -> Path:
        self.created = [parent for parent in self.path.parents if not parent.exists()]
        self.partial = None
        self.handlers = _terminating_signals_raise()
        try:
            with _signals_deferred():
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self.partial = Path(tempfile.mkdtemp(prefix=f".{self.path.name}.partial-", dir=self.path.parent))
        except BaseException as error:
            self.__exit__(type(error), error, None)
            if isinstance(error, OSError):
                raise OutputFolderError(f"{self.path}: cannot be created: {error}") from None
            raise
        return self.partial

    def __exit__(self, error_type, error, traceback):
        with _signals_deferred():
            published = False
            try:
                if error_type is None:
                    self._publish()
                    published = True
            finally:
                if not published:
                    if self.partial is not None:
                        shutil.rmtree(self.partial, ignore_errors=True)
                    _remove_empty(self.created)
                _restore(self.handlers)
        return False

    def _publish(self):
        self._refuse_existing()
        umask = os.umask(0)
        os.umask(umask)
        try:
            os.chmod(self.partial, 0o777 & ~umask)  # mkdtemp's 0700 was for the partial folder only
            if os.path.lexists(self.path):
                retired = Path(tempfile.mkdtemp(prefix=f".{self.path.name}.old-", dir=self.path.parent))
                os.replace(self.path, retired / "old")
                shutil.rmtree(retired, ignore_errors=True)
            os.replace(self.partial, self.path)
        except OSError as error:
            raise OutputFolderError(f"{self.path}: could not be put in place: {error}") from None
