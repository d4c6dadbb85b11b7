"""The file:// fragment store: objects are files under the broker's `--broker.file-root`.

`file:///a/b/` stores the fragment `journal/postfix/name` at `<file_root>/a/b/journal/postfix/name`.
Puts write a temporary `.partial-*` file in the target directory, then hard-link it into place, which
fails rather than replaces when the fragment exists. Paths escaping the file root are refused.
"""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import BinaryIO, cast
from urllib.parse import quote

from broker.fragment.stores.base import (
    PARTIAL_PREFIX,
    FragmentStore,
    StoreError,
    StoreObject,
    StoreURL,
    os_error_summary,
    resolve_under,
)

__all__ = ["FileStore"]

# Characters left unescaped in signed file:// URLs (besides letters and digits).
_URL_SAFE = "/-_.~+=,:@!$&'()*;"
_COPY_CHUNK = 1 << 20


class FileStore(FragmentStore):
    """A fragment store on a local or shared (NFS) file system, rooted at `file_root`."""

    scheme = "file"

    def __init__(self, store_url: StoreURL, file_root: Path) -> None:
        super().__init__(store_url)
        self._root = Path(os.path.abspath(file_root))

    @property
    def file_root(self) -> Path:
        return self._root

    def describe(self, key: str) -> str:
        return f"file:///{key}"

    def _path(self, key: str) -> Path:
        return resolve_under(self._root, key, what=f"{self.url}")

    def _put(self, key: str, body: BinaryIO, length: int, content_encoding: str) -> bool:
        # As upstream, the store's own directory must exist: a missing one is a misconfiguration
        # (an unmounted volume), not something to paper over by creating it.
        base = resolve_under(self._root, self._store_url.prefix, what=self.url)
        missing = StoreError(
            f"put {self.describe(key)}: store directory {base} does not exist "
            "(create it, or check --broker.file-root)",
            is_auth_error=True,
        )
        if not base.is_dir():
            raise missing
        target = self._path(key)
        # The directories below the store's, one at a time: should the store's own go away
        # after the check (a volume unmounted), making the first fails, rather than making the
        # store's directory again on the mount point.
        made = base
        for part in target.parent.relative_to(base).parts:
            made = made / part
            try:
                made.mkdir(mode=0o750)
            except FileExistsError:
                pass
            except FileNotFoundError:
                raise missing from None
        fd, partial = tempfile.mkstemp(prefix=PARTIAL_PREFIX + target.name, dir=target.parent)
        try:
            with os.fdopen(fd, "wb") as out:
                copied = 0
                while copied < length:
                    chunk = body.read(min(_COPY_CHUNK, length - copied))
                    if not chunk:
                        raise StoreError(
                            f"put {self.describe(key)}: the source ended after {copied} "
                            f"of {length} bytes"
                        )
                    out.write(chunk)
                    copied += len(chunk)
                out.flush()
                os.fsync(out.fileno())
            return self._link_into_place(partial, target)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(partial)

    @staticmethod
    def _link_into_place(partial: str, target: Path) -> bool:
        try:
            os.link(partial, target)
        except FileExistsError:
            return False
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
                raise
            # No hard links on this file system: check, then rename (a concurrent writer of the
            # same content-addressed name could slip in between, which rename tolerates).
            if target.exists():
                return False
            os.rename(partial, target)
        _fsync_dir(target.parent)
        return True

    def _exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def _open(self, key: str, offset: int) -> BinaryIO:
        # The file itself, unbuffered: each read is one copy, straight into the caller's buffer
        # (reads of whole fragments are large). A failing read raises OSError.
        f = self._path(key).open("rb", buffering=0)
        try:
            f.seek(offset)
        except BaseException:
            f.close()
            raise
        return cast(BinaryIO, f)

    def _get(self, key: str, offset: int, length: int | None) -> bytes:
        with self._path(key).open("rb") as f:
            f.seek(offset)
            return f.read() if length is None else f.read(length)

    def _list(self, key_prefix: str) -> Iterator[StoreObject]:
        # Like an object store, match keys by string prefix; walk from the deepest directory the
        # prefix names.
        directory, _, name_prefix = key_prefix.rpartition("/")
        top = self._path(directory) if directory else self._root
        if not top.is_dir():
            return
        for dirpath, dirnames, filenames in os.walk(top):
            dirnames.sort()
            rel_dir = os.path.relpath(dirpath, top)
            rel_dir = "" if rel_dir == "." else rel_dir.replace(os.sep, "/") + "/"
            for filename in sorted(filenames):
                if filename.startswith(PARTIAL_PREFIX):
                    continue
                rel = rel_dir + filename
                if not rel.startswith(name_prefix):
                    continue
                try:
                    st = os.stat(os.path.join(dirpath, filename))
                except FileNotFoundError:
                    continue  # Removed while listing.
                yield StoreObject(
                    path=rel[len(name_prefix) :],
                    size=st.st_size,
                    mod_time=datetime.fromtimestamp(st.st_mtime, UTC),
                )

    def _sign_get(self, key: str, ttl: timedelta) -> str:
        # As upstream: the object's path relative to the file root; readers resolve it under
        # their own root. Escaped so that names with '%' or spaces survive the round trip.
        self._path(key)
        return "file:///" + quote(key.lstrip("/"), safe=_URL_SAFE)

    def _remove(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._path(key).unlink()

    def _classify(self, op: str, exc: Exception) -> tuple[str, bool, bool]:
        if isinstance(exc, OSError):
            is_auth = isinstance(exc, PermissionError)
            not_found = isinstance(exc, FileNotFoundError) and op in ("open", "get")
            return os_error_summary(exc), is_auth, not_found
        return f"{type(exc).__name__}: {exc}", False, False


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # Some file systems refuse fsync of directories; the link is still in place.
    finally:
        os.close(fd)
