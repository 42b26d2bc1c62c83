"""Where payload bytes live: the :class:`Backend` protocol, its implementations, a registry.

:func:`open_backend` turns what a user wrote into a backend:

=============================  ==============================================
``/data/kv`` (no ``://``)      :class:`MmapBackend`: local disk, mapped reads
``local:///data/kv``           :class:`LocalBackend`: local disk, copied reads
``mmap:///data/kv``            :class:`MmapBackend`
``fsspec::<url>``              :class:`FsspecBackend` for ``<url>``, always
``<name>://...``               the backend registered as ``<name>``
any other ``<scheme>://...``   :class:`FsspecBackend` if fsspec knows ``scheme``
=============================  ==============================================

Registration is lazy, like fsspec's own registry: :func:`register_backend` takes a
``"module:Class"`` string that is imported the first time the scheme is used, so
registering costs nothing and an optional dependency is only needed by the stores
that use it.  A factory is called with the URL exactly as given.
"""

from __future__ import annotations

import importlib
import os
import re
from collections.abc import Callable

from sparkcache.backends.base import (
    Backend,
    Blob,
    BufferLike,
    DiskUsage,
    ObjectStat,
    ObjectStore,
    deadline,
    time_left,
)
from sparkcache.backends.fsspec_backend import FSSPEC_PREFIX, FsspecBackend
from sparkcache.backends.keys import is_temp_key, temp_key, validate_key
from sparkcache.backends.local import LocalBackend, MmapBackend
from sparkcache.errors import BackendError, InvalidArgument

__all__ = [
    "Backend",
    "Blob",
    "BufferLike",
    "DiskUsage",
    "FsspecBackend",
    "LocalBackend",
    "MmapBackend",
    "ObjectStat",
    "ObjectStore",
    "canonical_url",
    "deadline",
    "is_temp_key",
    "known_schemes",
    "open_backend",
    "register_backend",
    "temp_key",
    "time_left",
    "validate_key",
]

BackendFactory = Callable[[str], Backend]
"""Something that builds a backend from the URL it was opened with (a class works)."""

BUILTIN_BACKENDS: dict[str, str] = {
    "local": "sparkcache.backends.local:LocalBackend",
    "mmap": "sparkcache.backends.local:MmapBackend",
    "fsspec": "sparkcache.backends.fsspec_backend:FsspecBackend",
}
"""Schemes known without registration, as lazy ``module:Class`` targets."""

_registry: dict[str, str | BackendFactory] = dict(BUILTIN_BACKENDS)
_loaded: dict[str, BackendFactory] = {}  # string targets after their first import

_SCHEME_RE = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*")
_URL_RE = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)(?P<sep>://|::)")
_TARGET_RE = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")


def register_backend(name: str, target: str | BackendFactory, *, clobber: bool = False) -> None:
    """Make ``name://...`` URLs open with ``target``.

    ``target`` is a callable taking the URL (a backend class works) or a
    ``"package.module:Class"`` string imported on first use.  Re-registering a name
    with a different target needs ``clobber=True``, so two plugins cannot silently
    fight over a scheme.
    """
    if not isinstance(name, str) or not _SCHEME_RE.fullmatch(name):
        raise InvalidArgument(
            f"backend name {name!r} is not a URL scheme; use letters, digits, '+', '-' "
            "and '.', starting with a letter (e.g. 'myblob')"
        )
    if isinstance(target, str):
        if not _TARGET_RE.fullmatch(target):
            raise InvalidArgument(
                f"backend target {target!r} must look like 'package.module:Class'"
            )
    elif not callable(target):
        raise InvalidArgument(
            f"backend target for {name!r} must be callable or a 'module:Class' string"
        )
    key = name.lower()
    current = _registry.get(key)
    if current is not None and current != target and not clobber:
        raise InvalidArgument(
            f"backend {key!r} is already registered as {_describe(current)}; pass "
            "clobber=True to replace it"
        )
    _registry[key] = target
    _loaded.pop(key, None)


def known_schemes() -> list[str]:
    """Names registered with :func:`register_backend` (built-ins included), sorted."""
    return sorted(_registry)


def canonical_url(url_or_path: str | os.PathLike[str]) -> str:
    """How a store records where its payloads live: a plain path made absolute,
    a URL as given but without credentials (``user:password@`` is dropped).

    Two spellings of one local folder compare equal; nothing secret is kept."""
    text = os.fspath(url_or_path)
    if _URL_RE.match(text) is None or "://" not in text:
        return os.path.abspath(os.path.expanduser(text))
    scheme, _, rest = text.partition("://")
    netloc, slash, path = rest.partition("/")
    return f"{scheme}://{netloc.rsplit('@', 1)[-1]}{slash}{path}"


def open_backend(url_or_path: str | os.PathLike[str]) -> Backend:
    """Return the backend for a path or URL (see the module doc for the rules).

    Raises :class:`~sparkcache.errors.BackendError` for a scheme neither registered
    nor known to fsspec; the message lists the known schemes and how to add one.
    """
    if not isinstance(url_or_path, str):
        return MmapBackend(os.fspath(url_or_path))
    text = url_or_path
    if text.startswith(FSSPEC_PREFIX):
        return _build("fsspec", text)
    match = _URL_RE.match(text)
    if match is None:
        return MmapBackend(text)
    scheme = match.group("scheme").lower()
    if match.group("sep") == "::":
        if "://" not in text:
            return MmapBackend(text)  # a file name that happens to contain '::'
        return _build("fsspec", text)  # fsspec URL chain such as simplecache::s3://b
    if scheme in _registry:
        return _build(scheme, text)
    if _fsspec_knows(scheme):
        return _build("fsspec", text)
    raise BackendError(
        f"no storage backend for {scheme!r} URLs ({text!r}); known schemes: "
        f"{', '.join(known_schemes())}, plus every fsspec protocol "
        "(fsspec.available_protocols()); use a plain path for local disk, or register "
        f"one with sparkcache.backends.register_backend({scheme!r}, 'package.module:Class')"
    )


def _fsspec_knows(scheme: str) -> bool:
    """True if fsspec can open ``scheme``; BackendError if it could with a package."""
    try:
        import fsspec
    except ImportError:  # pragma: no cover - fsspec is a dependency
        return False
    try:
        fsspec.get_filesystem_class(scheme)
    except ValueError:
        return False
    except ImportError as exc:
        raise BackendError(
            f"fsspec can open {scheme!r} URLs but needs an extra package: {exc}; install it"
        ) from exc
    return True


def _build(name: str, url: str) -> Backend:
    """Resolve the registered target for ``name`` (importing it once) and call it."""
    target = _loaded.get(name) or _registry[name]
    if isinstance(target, str):
        target = _loaded[name] = _import_target(name, target)
    backend = target(url)
    if not isinstance(backend, Backend):
        raise BackendError(
            f"backend {name!r} ({_describe(target)}) returned {type(backend).__name__}, "
            "which does not implement sparkcache.backends.Backend"
        )
    return backend


def _import_target(name: str, target: str) -> BackendFactory:
    module_name, _, attr = target.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise BackendError(
            f"cannot load backend {name!r} from {target!r}: {exc}; install the package "
            "that provides it or fix the registration"
        ) from exc
    if not callable(factory):
        raise BackendError(f"backend {name!r} target {target!r} is not callable")
    return factory  # type: ignore[no-any-return]


def _describe(target: str | BackendFactory) -> str:
    if isinstance(target, str):
        return repr(target)
    return str(getattr(target, "__qualname__", repr(target)))
