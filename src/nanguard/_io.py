"""Atomic writes: a reader sees the old file (or directory) or the new one, never half of one."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

__all__ = ["atomic_dir", "atomic_write_text", "clean_stale_temps", "file_mode", "fsync_file"]

_TEMP_NAME = re.compile(r"\.(.+)\.[0-9a-f]{12}\.(?:tmp|old)")  # what atomic_dir names its temporaries


def file_mode() -> int:
    """The mode a new file gets from ``open``: 0666 less the umask. Writers that make 0600 files
    (``mkstemp``, safetensors) chmod to it, so all files of a run are alike."""
    # The only portable way to read the umask is to set it; put it straight back.
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def atomic_write_text(path: str | Path, text: str) -> Path:
    """Write ``text`` to a temporary file beside ``path``, fsync it, then rename it into place.

    Example:
        >>> atomic_write_text("runs/exp1/report.html", "<html>...</html>")
        PosixPath('runs/exp1/report.html')
    """
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    try:
        # mkstemp creates 0600; the file gets the mode any other file would (0666 less the umask).
        os.chmod(tmp, file_mode())
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out


@contextlib.contextmanager
def atomic_dir(final: Path) -> Iterator[Path]:
    """Yield an empty temporary directory beside ``final``; on success it replaces ``final``.

    Files written into it should be fsynced by the writer (``fsync_file``). On an error the
    temporary directory is removed and an existing ``final`` is left as it was.

    Example:
        >>> with atomic_dir(Path("runs/a/bundles/step-00000812-rank-0")) as tmp:
        ...     (tmp / "meta.json").write_text("{}")
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.{uuid.uuid4().hex[:12]}.tmp")
    tmp.mkdir()
    try:
        yield tmp
        _fsync_dir(tmp)
        _replace_dir(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_dir(final.parent)


def clean_stale_temps(folder: Path, final_names: re.Pattern[str]) -> list[Path]:
    """Remove what ``atomic_dir`` leaves in ``folder`` when its process is killed mid-write: the
    ``.NAME.<hex>.tmp`` and ``.NAME.<hex>.old`` entries whose NAME matches ``final_names``.

    Call it when a writer starts, before it writes: a live writer of the same names would lose its
    temporary. Errors are ignored (a leftover that cannot be removed only costs disk space).

    Example:
        >>> clean_stale_temps(Path("runs/a/bundles"), re.compile(r"step-\\d+-rank-0"))
        [PosixPath('runs/a/bundles/.step-00000812-rank-0.3f2a9c1d0b7e.tmp')]
    """
    removed: list[Path] = []
    try:
        entries = list(folder.iterdir())
    except OSError:
        return removed
    for entry in entries:
        match = _TEMP_NAME.fullmatch(entry.name)
        if match is None or not final_names.fullmatch(match.group(1)):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                entry.unlink()
        if not entry.exists():
            removed.append(entry)
    return removed


def fsync_file(path: Path) -> None:
    with open(path, "rb+") as handle:
        os.fsync(handle.fileno())


def _fsync_dir(path: Path) -> None:
    # Directory fsync makes the rename durable on POSIX; Windows cannot open directories.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _replace_dir(tmp: Path, final: Path) -> None:
    """Move ``tmp`` to ``final``; an existing ``final`` is removed only once ``tmp`` is in."""
    try:
        os.rename(tmp, final)
        return
    except OSError:
        if not final.exists():
            raise
    old = final.with_name(f".{final.name}.{uuid.uuid4().hex[:12]}.old")
    os.rename(final, old)
    try:
        os.rename(tmp, final)
    except BaseException:
        os.rename(old, final)
        raise
    if old.is_dir():
        shutil.rmtree(old, ignore_errors=True)
    else:
        old.unlink(missing_ok=True)
