"""A persistent on-disk cache of what the meta model says, so a warm merge plans without
importing transformers.

The architecture check (:mod:`core.judge`) and the rename tracing (:mod:`core.hf_names`) build
the config's model class on the meta device. What they learn depends only on the config, the
class, the tensors asked about and the installed transformers and torch; it costs seconds of
imports (``import transformers`` and the model's module) against milliseconds of merge on a
small model. Each answer is stored as one JSON file, named by a SHA-256 of everything it
depends on:

- :data:`SCHEMA` (shardscope's own: bump it when what is stored or how it is derived
  changes) and a digest of the source of the modules that derive it (:data:`CODE`);
- the installed ``transformers`` and ``torch`` versions, read from their ``METADATA`` as
  :func:`importlib.metadata.version` does (no import);
- the config: the canonical JSON of ``config.json`` (keys sorted) or of the derived fields
  (Megatron), and ``trust_remote_code``. A config with ``auto_map`` (remote code) is never
  cached: its classes are code outside the key;
- what the entry is about (a class name; the names, shapes and dtypes asked about).

Location: ``$SHARDSCOPE_CACHE``, else ``$XDG_CACHE_HOME/shardscope``, else
``~/.cache/shardscope``; ``SHARDSCOPE_CACHE=off`` turns it off. Entries are written
atomically (a temporary file renamed into place); an entry that cannot be read or parsed, or
that holds another key, is a miss (rebuilt and rewritten); a folder that cannot be written is
not an error (the answer is simply not kept). No torch or transformers import here.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import tempfile
import threading
from typing import Any, Iterator

#: bump when an entry's content or its derivation changes (old entries then miss)
SCHEMA = 1
#: values of $SHARDSCOPE_CACHE that turn the cache off
OFF = ("off", "0", "no", "false", "none")

_versions: tuple[str, str] | None = None
_local = threading.local()


class ColdCache(Exception):
    """Raised inside :func:`cache_only` where an answer is not cached and would need the import
    of transformers (``what`` says which step). Not a :class:`core.errors.ShardscopeError`:
    it never reaches a user (core/overlap.py catches it and plans by another way)."""


@contextlib.contextmanager
def cache_only() -> Iterator[None]:
    """Inside the block, on this thread, :func:`require_warm` raises :class:`ColdCache`:
    planning with what is already known (the on-disk cache and this process's own) or not at
    all. Used to learn in milliseconds whether a merge can plan without importing
    transformers."""
    old = getattr(_local, "only", False)
    _local.only = True
    try:
        yield
    finally:
        _local.only = old


def require_warm(what: str) -> None:
    """Called before each step that imports torch or transformers: raises
    :class:`ColdCache` inside :func:`cache_only`, else does nothing."""
    if getattr(_local, "only", False):
        raise ColdCache(what)


def cache_dir() -> str | None:
    """The cache folder (``.../arch`` under the root described in the module docstring), or
    None when ``SHARDSCOPE_CACHE`` turns it off."""
    root = os.environ.get("SHARDSCOPE_CACHE")
    if root is not None and root.strip().lower() in OFF:
        return None
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"),
                                                                ".cache")
        root = os.path.join(xdg, "shardscope")
    return os.path.join(root, "arch")


def versions() -> tuple[str, str]:
    """(transformers version, torch version) as installed (``?`` when not installed), read
    from the packages' metadata without importing them."""
    global _versions
    if _versions is None:
        _versions = (_version("transformers"), _version("torch"))
    return _versions


def _version(dist: str) -> str:
    """The ``Version:`` of ``dist``'s ``*.dist-info/METADATA`` in the first ``sys.path`` entry
    holding one (as :func:`importlib.metadata.version` finds it, without importing
    ``importlib.metadata``: its ``email`` parser costs more CPU than a warm plan's check);
    anything else (an ``.egg-info``, a custom finder) is left to ``importlib.metadata``."""
    prefix = dist.lower() + "-"
    for entry in sys.path:
        try:
            names = os.listdir(entry or ".")
        except OSError:
            continue
        for name in names:
            if name.lower().startswith(prefix) and name.endswith(".dist-info") and \
                    "-" not in name[len(prefix):-len(".dist-info")]:
                try:
                    with open(os.path.join(entry or ".", name, "METADATA"),
                              encoding="utf-8") as f:
                        for line in f:
                            if line.startswith("Version:"):
                                return line[len("Version:"):].strip()
                            if not line.strip():
                                break
                except OSError:
                    pass
                break
        else:
            continue
        break
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "?"


def digest(*parts: Any) -> str:
    """SHA-256 (hex) of the canonical JSON of ``parts`` (keys sorted; non-JSON values by
    ``str``)."""
    text = json.dumps(parts, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def config_key(config_dir: str | None, config_fields: dict | None,
               trust: bool) -> str | None:
    """The part of every key that names a config: a digest of :data:`SCHEMA`, the installed
    versions, the canonical config JSON and ``trust``. None when the config must not be
    cached (remote code: ``auto_map``) or cannot be read (the cold path then says why)."""
    if config_dir is not None:
        try:
            with open(os.path.join(config_dir, "config.json"), encoding="utf-8") as f:
                raw = json.load(f)
        except (OSError, ValueError):
            return None
    else:
        raw = config_fields
    if not isinstance(raw, dict) or raw.get("auto_map"):
        return None
    return digest(SCHEMA, _code(), versions(), "dir" if config_dir is not None else "fields",
                  raw, bool(trust))


_code_digest: str | None = None
#: shardscope's own modules whose code decides what an entry holds
CODE = ("archcache.py", "judge.py", "hf_names.py", "dtypes.py")


def _code() -> str:
    """A digest of :data:`CODE`'s source: an edited checkout (a fix in how the renames are
    traced) misses the entries an older one wrote, even without a :data:`SCHEMA` bump (``?``
    when a source cannot be read, e.g. a zip import: then :data:`SCHEMA` alone)."""
    global _code_digest
    if _code_digest is None:
        h = hashlib.sha256()
        try:
            for name in CODE:
                with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), name),
                          "rb") as f:
                    h.update(f.read())
            _code_digest = h.hexdigest()
        except OSError:
            _code_digest = "?"
    return _code_digest


def _path(key: str) -> str | None:
    d = cache_dir()
    return None if d is None else os.path.join(d, key[:2], key + ".json")


def load(key: str) -> Any | None:
    """The value stored under ``key`` (a :func:`digest`), or None: no entry, cache off, or an
    entry that cannot be read, is not valid JSON or holds another key."""
    p = _path(key)
    if p is None:
        return None
    try:
        with open(p, encoding="utf-8") as f:
            entry = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(entry, dict) or entry.get("key") != key or "value" not in entry:
        return None
    return entry["value"]


def store(key: str, value: Any) -> None:
    """Keep ``value`` (JSON-able) under ``key``: written to a temporary file in the entry's
    folder and renamed into place, so a reader sees the whole entry or none. Any OSError (a
    read-only or full disk) is ignored: the cache is an optimisation."""
    p = _path(key)
    if p is None:
        return
    tmp = None
    try:
        os.makedirs(os.path.dirname(p), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(p), prefix=".tmp-", suffix=".json")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({"key": key, "value": value}, f, separators=(",", ":"))
        os.replace(tmp, p)
        tmp = None
    except (OSError, TypeError, ValueError):
        pass
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
