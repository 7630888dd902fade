"""What makes a checkpoint folder trustworthy: a manifest of its files' digests, and one run at a time.

Manifest: `global_step_N/checksums.json` = {"files": {relative path: {"size": bytes, "sha256": hex}}},
written after every other file of the checkpoint and before the folder is renamed into place. At
resume each file is checked against it, so a flipped byte, a truncated or zeroed shard, or a file
missing from the folder is found before it is loaded (and trained on). The ranks hash the files
between them (`part` of `parts`: file i goes to rank i % parts), in parallel on every node.

Lock: `RunLock` holds an exclusive `flock` on `<folder>/.vlrl.lock` for the whole run. The kernel
releases it when the process ends, however it ends (kill -9 included), so a stale lock cannot stop the
next run. A second run on the folder stops at start-up naming the holder.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import socket
import time
import uuid
from collections.abc import Callable
from typing import Any

MANIFEST = "checksums.json"
LOCK = ".vlrl.lock"
PROBE_PREFIX = ".vlrl_shared_check_"  # `check_shared_filesystem`'s marker files
_CHUNK = 8 << 20  # bytes read per hash update


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def checkpoint_files(folder: str) -> list[str]:
    """Every file under `folder` but the manifest, as sorted relative paths."""
    found = []
    for parent, _, names in os.walk(folder):
        for name in names:
            rel = os.path.relpath(os.path.join(parent, name), folder)
            if rel != MANIFEST:
                found.append(rel)
    return sorted(found)


def digest_files(folder: str, part: int = 0, parts: int = 1) -> dict[str, dict[str, Any]]:
    """{relative path: {"size", "sha256"}} of this `part`'s share of the files under `folder`."""
    return {
        rel: {
            "size": os.path.getsize(os.path.join(folder, rel)),
            "sha256": file_sha256(os.path.join(folder, rel)),
        }
        for rel in checkpoint_files(folder)[part::parts]
    }


def write_manifest(folder: str, files: dict[str, dict[str, Any]]) -> None:
    missing = sorted(set(checkpoint_files(folder)) - set(files))
    if missing:  # a rank's share went unhashed: a manifest that skips files would vouch for them
        raise RuntimeError(f"{folder}: no digest for {', '.join(missing)}")
    with open(os.path.join(folder, MANIFEST), "w") as f:
        json.dump({"files": dict(sorted(files.items()))}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def read_manifest(folder: str) -> dict[str, dict[str, Any]] | None:
    """The manifest's file table; None when the folder has none (written before vlrl kept one).
    A manifest that cannot be read is an error naming it."""
    path = os.path.join(folder, MANIFEST)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            files = json.load(f)["files"]
        if not isinstance(files, dict):
            raise ValueError("'files' is not a table")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CorruptCheckpoint(f"{path} cannot be read ({exc})") from None
    return files


def verify_files(folder: str, files: dict[str, dict[str, Any]], part: int = 0, parts: int = 1) -> list[str]:
    """Problems with this `part`'s share of the manifest's files, one line each (none: they match)."""
    problems = []
    for rel in sorted(files)[part::parts]:
        path, want = os.path.join(folder, rel), files[rel]
        if not os.path.isfile(path):
            problems.append(f"{path} is missing")
        elif os.path.getsize(path) != want["size"]:
            problems.append(f"{path} has {os.path.getsize(path)} bytes, {want['size']} were written")
        elif file_sha256(path) != want["sha256"]:
            problems.append(f"{path} does not match its checksum (its bytes changed after it was written)")
    return problems


class CorruptCheckpoint(RuntimeError):
    """A checkpoint folder whose files do not match what was written (or cannot be read)."""


class RunLock:
    """An exclusive lock on a checkpoint folder while this object lives (see the module doc)."""

    def __init__(self, folder: str) -> None:
        self.path = os.path.join(folder, LOCK)
        # a file object, not a bare descriptor: dropped with this object, it closes and unlocks
        self.file: Any = open(self.path, "a+")  # noqa: SIM115 (held open on purpose)
        try:
            fcntl.flock(self.file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            self.file.close()
            if exc.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            raise RuntimeError(
                f"trainer.save_checkpoint_path={folder} is in use by another run ({_holder(self.path)}); "
                "two runs in one folder would overwrite each other's checkpoints and logs: wait for it to "
                "end, or point trainer.save_checkpoint_path at another folder"
            ) from None
        self.file.truncate(0)
        self.file.write(
            f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}"
        )
        self.file.flush()

    def release(self) -> None:
        self.file.close()  # closing the descriptor releases the flock


def _holder(path: str) -> str:
    with contextlib.suppress(OSError):
        with open(path) as f:
            text = f.read().strip()
        if text:
            return text
    return "its pid is not recorded"


def probe_shared_path(marker: str, token: str, rank: int) -> tuple[bool, str]:
    """Rank side of `check_shared_filesystem`: (saw the driver's marker, this host's name).

    A rank that sees it answers with a file of its own next to it, for the driver to find."""
    try:
        with open(marker) as f:
            seen = f.read() == token
    except OSError:
        seen = False
    if seen:
        with open(f"{marker}.rank{rank}", "w") as f:
            f.write(token)
    return seen, socket.gethostname()


def check_shared_filesystem(root: str, probe_ranks: Callable[[str, str], list[tuple[bool, str]]]) -> None:
    """Every rank writes its checkpoint shards under `root` and the driver completes the checkpoint
    there (trainer state, rename), so `root` must be one folder for all of them: shared storage on a
    multi-node cluster. Checked once at start-up, before any training time is spent.

    `probe_ranks(marker, token)` runs `probe_shared_path` on every rank and returns their answers."""
    os.makedirs(root, exist_ok=True)
    token = uuid.uuid4().hex
    marker = os.path.join(root, f"{PROBE_PREFIX}{token}")
    answers: list[tuple[bool, str]] = []
    try:  # the marker is removed even when writing it fails (a full disk)
        with open(marker, "w") as f:
            f.write(token)
            f.flush()
            os.fsync(f.fileno())
        answers = probe_ranks(marker, token)
        blind = [f"rank {r} on {host}" for r, (seen, host) in enumerate(answers) if not seen]
        unseen = [
            f"rank {r} on {host}"
            for r, (seen, host) in enumerate(answers)
            if seen and not os.path.isfile(f"{marker}.rank{r}")
        ]
    finally:
        for path in [marker] + [f"{marker}.rank{r}" for r in range(len(answers))]:
            with contextlib.suppress(OSError):
                os.remove(path)
    if blind or unseen:
        raise RuntimeError(
            f"trainer.save_checkpoint_path={root} is not one folder shared by the driver "
            f"({socket.gethostname()}) and every rank: "
            + (f"{', '.join(blind)} cannot see a file the driver wrote there" if blind else "")
            + ("; " if blind and unseen else "")
            + (f"the driver cannot see the files of {', '.join(unseen)}" if unseen else "")
            + ". Every rank writes its checkpoint shards there and the driver completes the checkpoint:"
            " point it at shared storage (NFS or a cluster filesystem mounted at the same path on all nodes)"
        )
