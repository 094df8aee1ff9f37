"""Where a run's files live: a local directory or an object store URL (``gs://bucket/prefix``).

Everything a run reads and writes by name goes through `path()`, an etils ``epath.Path``: the
local filesystem for paths, fsspec (gcsfs) for ``gs://``. Orbax and tensorstore take the same
locations and write arrays with their own drivers. An object store differs from a disk in
three ways that matter here, each handled in one place:

- there are no directories: `makedirs` creates nothing remote (gcsfs would create a missing
  bucket instead of failing), and `move_tree` copies then deletes (set-aside checkpoints);
- one object write is atomic, so `runner.checkpoint.files.atomic_write` writes in place;
- objects cannot be appended to, so `runner.observability.metrics.JsonLines` rewrites metrics.jsonl whole.

Pointing runner at an emulator or another endpoint is one variable, ``STORAGE_EMULATOR_HOST``
(``http://localhost:4443``): gcsfs and google-cloud-storage read it themselves, and
`configure_endpoint` (run when runner is imported) derives tensorstore's
``TENSORSTORE_GCS_HTTP_URL`` and a test token from it, and turns off gcsfs's gRPC bucket-type
probe, which an emulator does not answer (gcsfs would wait 60 s for it on every bucket).
"""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path, PurePosixPath
from typing import Any, Callable, MutableMapping

from runner.errors import UserError, first_line
from runner.exits import PREEMPTED_EXIT_CODE

EMULATOR = "STORAGE_EMULATOR_HOST"


class StorageUnavailable(UserError):
    """A run directory's storage (a bucket) failed past its clients' retries, or did not answer
    within checkpoint.storage_timeout_minutes: a transient failure, so the run stops as a preempted
    one does (exit 75) and the same command resumes it later."""

    exit_code = PREEMPTED_EXIT_CODE


def bounded(work: Callable[[], Any], seconds: float) -> Any:
    """`work()`, or StorageUnavailable if it has not returned within `seconds` (it is left running
    in a daemon thread: a storage call that never returns must not hold the process)."""
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["value"] = work()
        except BaseException as err:  # handed to the caller's thread
            outcome["error"] = err

    thread = threading.Thread(target=target, name="runner-storage", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise StorageUnavailable(f"no answer within checkpoint.storage_timeout_minutes={seconds / 60:g}")
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")
MIRROR = "remote"  # local stand-ins for tools that only write local files live under cache_root()/MIRROR


def cache_root() -> Path:
    """Where runner keeps what it can rebuild: ``$RUNNER_CACHE``, else ``$XDG_CACHE_HOME/runner``,
    else ``~/.cache/runner``."""
    if os.environ.get("RUNNER_CACHE"):
        return Path(os.environ["RUNNER_CACHE"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "runner"
    return Path.home() / ".cache" / "runner"


def configure_endpoint(environ: MutableMapping[str, str] = os.environ) -> None:
    """With STORAGE_EMULATOR_HOST set, point every Google Cloud Storage client at it (values the
    user set win). Must run before gcsfs is imported."""
    host = environ.get(EMULATOR)
    if not host:
        return
    environ.setdefault("TENSORSTORE_GCS_HTTP_URL", host.rstrip("/"))
    environ.setdefault("GOOGLE_AUTH_TOKEN_FOR_TESTING", "emulator")
    environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")


def is_remote(location: str | os.PathLike[str]) -> bool:
    return "://" in os.fspath(location)


def _uncached_listings() -> None:
    """gcsfs instances (epath's and orbax's included) never cache listings: several processes,
    and orbax's own threads, change the same prefixes, and a cached listing can miss a checkpoint
    another one committed."""
    import fsspec.config

    fsspec.config.conf.setdefault("gcs", {}).setdefault("use_listings_cache", False)


def path(location: str | os.PathLike[str]) -> Any:
    """An epath.Path for a local path (``~`` expanded) or a URL (trailing slashes dropped)."""
    from etils import epath

    loc = os.fspath(location)
    if is_remote(loc):
        _uncached_listings()
        return epath.Path(loc.rstrip("/"))
    return epath.Path(os.path.expanduser(loc))


def absolute(location: str | os.PathLike[str]) -> Any:
    """`path()`, made absolute when local (a URL is absolute already)."""
    loc = os.fspath(location)
    return path(loc if is_remote(loc) else os.path.abspath(os.path.expanduser(loc)))


def name(location: str | os.PathLike[str]) -> str:
    """The last component of a path or URL."""
    return PurePosixPath(os.fspath(location).rstrip("/")).name


def filesystem(location: str | os.PathLike[str]) -> Any:
    """The fsspec filesystem (the instance epath uses) for a URL."""
    import fsspec

    _uncached_listings()
    loc = os.fspath(location)
    if loc.startswith("gs://"):
        return fsspec.filesystem("gcs", finalize_on_close=True)
    return fsspec.filesystem(loc.split("://", 1)[0])


def _strip(location: str | os.PathLike[str]) -> str:
    return os.fspath(location).split("://", 1)[1].rstrip("/")


def makedirs(location: str | os.PathLike[str]) -> None:
    """Create a local directory (and its parents); nothing on an object store."""
    if not is_remote(location):
        path(location).mkdir(parents=True, exist_ok=True)


def remove_if_only(location: str | os.PathLike[str], names: set[str]) -> bool:
    """Delete the directory `location` when the only files in it (at any depth) are `names`: what a
    launch refused before training wrote there. Anything else in it keeps it. True if deleted."""
    if is_remote(location):
        fs, root = filesystem(location), _strip(location)
        files = [f[len(root):].lstrip("/") for f in fs.find(root)]
        if not files or any(f not in names for f in files):
            return False
        fs.rm(root, recursive=True)
        return True
    import shutil

    where = Path(os.fspath(location))
    if not where.is_dir() or any(p.relative_to(where).as_posix() not in names for p in where.rglob("*")
                                 if not p.is_dir()):
        return False
    shutil.rmtree(where)
    return True


def move_tree(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
    """Move a directory: one rename locally; a copy, then a delete, of every object remotely."""
    if not is_remote(src):
        path(dst).parent.mkdir(parents=True, exist_ok=True)
        path(src).rename(dst)
        return
    fs = filesystem(src)
    fs.copy(_strip(src), _strip(dst), recursive=True)
    fs.rm(_strip(src), recursive=True)


def upload_tree(local: str | os.PathLike[str], url: str) -> None:
    """Copy a local directory's files to a URL prefix (what local-only tools wrote)."""
    filesystem(url).put(os.fspath(local).rstrip("/") + "/", _strip(url) + "/", recursive=True)


def local_mirror(location: str | os.PathLike[str]) -> Path:
    """A local directory standing in for a remote one, for tools that write only local files
    (wandb's offline files, the profiler, Hydra's sweep bookkeeping): under runner's cache, at
    the URL's own path, so `remote_of` can name the URL again. A local location is itself."""
    loc = os.fspath(location)
    if not is_remote(loc):
        return Path(loc)
    scheme, rest = loc.split("://", 1)
    return cache_root() / MIRROR / scheme / rest.strip("/")


def remote_of(directory: str | os.PathLike[str]) -> str:
    """The URL a `local_mirror` directory stands in for; any other path unchanged."""
    here = Path(os.path.abspath(os.fspath(directory)))
    root = Path(os.path.abspath(cache_root() / MIRROR))
    if here.is_relative_to(root) and len(here.relative_to(root).parts) >= 2:
        scheme, *rest = here.relative_to(root).parts
        return f"{scheme}://{'/'.join(rest)}"
    return os.fspath(directory)


# ----------------------------------------------------------------------------- checks


def check_reachable(location: str, key: str, write: bool) -> None:
    """Fail early, with one paragraph naming `key`, its value and the fix, when there are no
    credentials for a remote location, its bucket is missing, or this account may not write
    there (with `write`) or list it: before any device work, and before anything else is
    written. The check uses object permissions only (a probe object written and deleted, or a
    listing), never bucket metadata, which roles such as storage.objectAdmin do not grant. (A
    local run directory is checked when spec.yaml is written into it.)"""
    if not is_remote(location):
        return
    if not location.startswith("gs://"):
        raise UserError(f"{key}={location!r}: runner writes run directories locally or to Google Cloud Storage "
                        "(gs://bucket/prefix) only. Fix: use a local path or a gs:// URL.")
    bucket = _strip(location).split("/", 1)[0]
    if not os.environ.get(EMULATOR):
        _check_credentials(key, location)
    fs = filesystem(location)
    try:
        if write:
            probe = f"{_strip(location)}/.runner-write-check-{socket.gethostname()}-{os.getpid()}"
            fs.pipe_file(probe, b"")
            fs.rm_file(probe)
        else:
            fs.ls(_strip(location))
    except FileNotFoundError:
        if write:  # an upload into a bucket that exists always succeeds or is denied
            raise UserError(f"{key}={location!r}: the bucket gs://{bucket} does not exist. Fix: create it "
                            f"(`gcloud storage buckets create gs://{bucket}`) or correct the bucket name.") from None
    except PermissionError as err:
        raise _denied(key, location, err, "write" if write else "list") from None
    except OSError as err:
        raise UserError(f"{key}={location!r}: cannot reach gs://{bucket} ({first_line(err, 200)}). Fix: check the "
                        f"network and the endpoint ({EMULATOR} for an emulator), then rerun.") from None


def check_local_writable(location: str, key: str) -> None:
    """A local directory the run will write into must be one it can ever write: refused at start,
    with one paragraph, when it is a file, lies under a file, or sits on a read-only or
    permission-denied parent. Nothing is created: a probe file is made and removed in the directory,
    or in its nearest existing parent. (A disk that fills later is the writer's to report.)"""
    if not location or is_remote(location):
        return
    target = os.path.abspath(os.path.expanduser(location))
    existing = target
    while not os.path.exists(existing):
        parent = os.path.dirname(existing)
        if parent == existing:
            break
        existing = parent
    if not os.path.isdir(existing):
        what = "is a file" if existing == target else f"lies under {existing}, which is a file"
        raise UserError(f"{key}={location!r}: runner writes a directory there, but the path {what}. Fix: choose a "
                        f"directory path for {key} (or move the file away).")
    probe = os.path.join(existing, f".runner-write-check-{socket.gethostname()}-{os.getpid()}")
    try:
        with open(probe, "wb"):
            pass
        os.unlink(probe)
    except OSError as err:
        reason = err.strerror or type(err).__name__
        raise UserError(f"{key}={location!r}: runner cannot write in {existing} ({reason}). Fix: choose a location "
                        f"this account can write for {key}, or make {existing} writable.") from None


def _check_credentials(key: str, location: str) -> None:
    try:
        import google.auth
        from google.auth.exceptions import DefaultCredentialsError
    except ImportError:  # gcsfs brings google-auth; without it gcsfs itself reports the problem
        return
    try:
        google.auth.default()
    except DefaultCredentialsError as err:
        raise UserError(f"{key}={location!r}: no Google Cloud credentials were found ({first_line(err, 200)}). "
                        "Fix: log in with `gcloud auth application-default login` or set "
                        "GOOGLE_APPLICATION_CREDENTIALS to a service account key (on a Cloud TPU VM, its service "
                        f"account is used); for an emulator set {EMULATOR}=http://HOST:PORT.") from None


def _denied(key: str, location: str, err: BaseException, action: str) -> UserError:
    role = "roles/storage.objectAdmin" if action == "write" else "roles/storage.objectViewer"
    return UserError(f"{key}={location!r}: permission denied to {action} objects there ({first_line(err, 200)}). "
                     f"Fix: grant the account runner uses {role} on the bucket, use another bucket, or log in as an "
                     "account that has it (`gcloud auth application-default login`, or "
                     "GOOGLE_APPLICATION_CREDENTIALS=KEY.json).")
