"""The output directory: which `--out` may be written or replaced, and the temporary directory beside it
that becomes OUT only when complete.

- Atomicity: everything is written into a temporary directory beside OUT
  (`.OUT.converting-<pid>-<random>`, mode 0777 minus the umask like any new directory) and renamed
  onto OUT at the end; on any failure, Ctrl-C or SIGTERM the temporary directory is removed, OUT is
  untouched and the exit status is non-zero (130 / 143 for the signals). A temporary directory holds
  an owner marker (`OWNER_MARKER`: pid, host, process start time) written right after it is made; a
  run that was killed outright (kill -9, power loss) leaves its directory behind, and the next
  conversion to the same OUT removes it once the marker's process is gone. Nothing without such a
  marker, nor one whose owner is alive or on another host, is ever removed.
- What is never destroyed: `--out` may not be empty, nor inside / a parent of `--hf-dir`. Without
  `--overwrite` an existing OUT is refused; with it, OUT is replaced only when it is a previous
  conversion (`ced_manifest.json` of this format inside) or an empty directory, and never when it
  is `/`, the home directory, the working directory or one of their parents. All of this is
  checked before any tensor is read, and again just before the old OUT is moved aside.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import secrets
import shutil
import socket
import time
from pathlib import Path

from ced_jax.checkpoint.converted import FORMAT, MANIFEST_NAME
from conversion.options import ConversionError

# Inside every temporary directory a conversion makes: who made it (see `_owner_is_gone`).
OWNER_MARKER = ".ced_convert_owner.json"


def check_paths(hf_dir: str | Path, out_dir: str | Path, overwrite: bool) -> tuple[Path, Path]:
    """Resolve `--hf-dir` / `--out` and refuse every output that a conversion could destroy without
    having written it (see the module docstring). Touches nothing."""
    for flag, value in (("--hf-dir", hf_dir), ("--out", out_dir)):
        if not str(value).strip():  # Path("") is the working directory
            raise ConversionError(f"{flag}: empty path; name a directory")
    hf = Path(hf_dir).resolve()  # Orbax wants absolute paths
    out = Path(out_dir).resolve()
    if not hf.is_dir():
        raise ConversionError(f"--hf-dir {hf}: not a directory")
    if out == hf or hf in out.parents:
        raise ConversionError(f"--out {out}: inside the source --hf-dir {hf}; write elsewhere")
    if out in hf.parents:
        raise ConversionError(f"--out {out}: contains the source --hf-dir {hf}; write elsewhere")
    for parent in out.parents:  # the nearest existing ancestor must be a directory to create OUT in
        if parent.exists():
            if not parent.is_dir():
                raise ConversionError(f"--out {out}: {parent} is a file, not a directory")
            break
    if not (out.exists() or out.is_symlink()):
        return hf, out
    if not overwrite:
        raise ConversionError(f"--out {out}: already exists; pass --overwrite to replace it")
    protected = _protected_directories()
    if out in protected:
        raise ConversionError(f"--out {out}: refusing to replace {protected[out]} with a checkpoint")
    _check_replaceable(out)
    return hf, out


def _protected_directories() -> dict[Path, str]:
    """Directories --overwrite never replaces, even when they look like a conversion: the root, the
    home and working directories, and every parent of those."""
    out: dict[Path, str] = {Path("/"): "the root directory"}
    places = [(Path.cwd(), "the working directory")]
    with contextlib.suppress(RuntimeError, KeyError):  # no home directory known: nothing to protect
        places.append((Path.home().resolve(), "the home directory"))
    for path, what in places:
        out.setdefault(path, what)
        for parent in path.parents:
            out.setdefault(parent, f"a parent of {what} {path}")
    return out


def _is_previous_conversion(directory: Path) -> bool:
    """A directory convert_weights wrote: its manifest names this converter's format (any version,
    so that a conversion by an older or newer build can be replaced too)."""
    try:
        manifest = json.loads((directory / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and manifest.get("format") == FORMAT


def _check_replaceable(out: Path) -> None:
    """--overwrite replaces a previous conversion or an empty directory, nothing else."""
    if out.is_symlink() or not out.is_dir():
        raise ConversionError(
            f"--out {out}: exists and is not a directory; --overwrite replaces only a previous conversion"
        )
    if _is_previous_conversion(out):
        return
    if any(out.iterdir()):
        raise ConversionError(
            f"--out {out}: not a previous conversion (no {MANIFEST_NAME} of format {FORMAT!r}) and not "
            "empty; --overwrite replaces only a directory convert_weights wrote"
        )


def _process_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat field 22), which tells a
    reused pid from the original; None where /proc is not available or the process is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # fields after "pid (comm)" start at field 3


def make_own_directory(parent: Path, prefix: str) -> Path:
    """A new directory `parent/<prefix><pid>-<random>` holding an owner marker. os.mkdir with mode
    0777 lets the umask decide the permissions, as for any directory the user makes (tempfile's
    0700 would leave a shared checkpoint unreadable to the group)."""
    while True:
        path = parent / f"{prefix}{os.getpid()}-{secrets.token_hex(4)}"
        try:
            os.mkdir(path, 0o777)
            break
        except FileExistsError:
            continue
    owner = {"pid": os.getpid(), "host": socket.gethostname(), "start": _process_start(os.getpid())}
    (path / OWNER_MARKER).write_text(json.dumps(owner) + "\n")
    return path


def remove_own_directory(path: Path, settle_s: float = 5.0) -> None:
    """Remove a directory made by `make_own_directory`, its owner marker last: if the removal is cut
    short, what remains is still recognisably ours and the next run finishes the job. A failed save's
    writer threads may still be creating files in it (a full disk: 2 of 6 runs left it behind, measured),
    so the removal is tried again for up to `settle_s` seconds while it does not go."""
    deadline = time.monotonic() + settle_s
    while _remove_own_directory_once(path) and time.monotonic() < deadline:
        time.sleep(0.1)


def _remove_own_directory_once(path: Path) -> bool:
    """One pass of `remove_own_directory`; True if the directory is still there."""
    for child in list(path.iterdir()) if path.is_dir() else []:
        if child.name == OWNER_MARKER:
            continue
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                child.unlink()
    marker = path / OWNER_MARKER
    owner = marker.read_bytes() if marker.is_file() else None
    with contextlib.suppress(FileNotFoundError):
        marker.unlink()
    try:
        path.rmdir()
    except FileNotFoundError:
        pass
    except OSError:  # something wrote into it meanwhile (an interrupted save's thread): leave it marked
        if owner is not None:
            marker.write_bytes(owner)
        return True
    return False


def _owner_is_gone(directory: Path) -> bool:
    """True when `directory` carries our owner marker and the process it names is certainly gone: same
    host, and no process with that pid, or one started at another time (the pid was reused). An
    unreadable marker, another host (a shared filesystem) or a live owner: False, keep it."""
    try:
        owner = json.loads((directory / OWNER_MARKER).read_text())
        pid, host, start = int(owner["pid"]), owner["host"], owner["start"]
    except (OSError, ValueError, TypeError, KeyError):
        return False
    if host != socket.gethostname() or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        pass
    return start is not None and _process_start(pid) not in (None, start)


def remove_stale_temporaries(out: Path) -> list[str]:
    """Remove what killed conversions to `out` left beside it (see `_owner_is_gone`). A `.replaced-`
    directory of a run killed between moving the old OUT aside and moving the new one in still holds
    the previous conversion: it goes back to OUT when OUT is missing. Returns the names removed."""
    removed: list[str] = []
    if not out.parent.is_dir():
        return removed
    for kind in ("converting", "replaced"):
        for path in sorted(out.parent.glob(f".{glob.escape(out.name)}.{kind}-*")):
            if not path.is_dir() or path.is_symlink() or not _owner_is_gone(path):
                continue
            previous = path / "old"
            if kind == "replaced" and previous.is_dir() and not (out.exists() or out.is_symlink()):
                os.rename(previous, out)
            remove_own_directory(path)
            removed.append(path.name)
    return removed


def move_into_place(tmp: Path, out: Path) -> None:
    """Rename the finished temporary directory onto `out`; a replaced `out` (checked again: hours
    may have passed since the start) is removed only after the new one is in place. The owner
    marker goes first: the checkpoint is no temporary directory."""
    (tmp / OWNER_MARKER).unlink()
    if not (out.exists() or out.is_symlink()):
        os.rename(tmp, out)
        return
    _check_replaceable(out)
    old = make_own_directory(out.parent, f".{out.name}.replaced-")
    os.rename(out, old / "old")
    try:
        os.rename(tmp, out)
    except BaseException:
        os.rename(old / "old", out)
        raise
    finally:
        if out.exists():
            remove_own_directory(old)
