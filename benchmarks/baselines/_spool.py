"""What every baseline server does with content it receives, standing in for a replica's spool:
SHA-1 it and write it to a temporary file, rolled (closed, which frees it) like a fragment.
"""

from __future__ import annotations

import hashlib
import tempfile
from typing import IO

# Rolling keeps a long run from filling the disk. Files are anonymous (gone once closed or once the
# process dies) and outlive any `with` block, hence the noqa below.
ROLL_BYTES = 256 << 20


class Spool:
    def __init__(self) -> None:
        self._file: IO[bytes] = tempfile.TemporaryFile(prefix="gazette-bench-")  # noqa: SIM115
        self._sum = hashlib.sha1()
        self._length = 0

    def write(self, chunk: bytes) -> None:
        self._sum.update(chunk)
        self._file.write(chunk)
        self._length += len(chunk)
        if self._length >= ROLL_BYTES:
            self._file.close()
            self._file = tempfile.TemporaryFile(prefix="gazette-bench-")  # noqa: SIM115
            self._sum = hashlib.sha1()
            self._length = 0

    def digest(self) -> bytes:
        return self._sum.digest()
