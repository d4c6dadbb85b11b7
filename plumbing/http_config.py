"""What a process serves over HTTP (its flags), apart from the server itself
(plumbing.debug_http): a process with no HTTP port imports no HTTP stack (aiohttp alone is some
0.2 s of CPU at every start)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class HTTPConfig:
    """What a process serves over HTTP (its flags)."""

    port: int | None = None  # None: no HTTP port. 0: a free one.
    debug_port: int | None = None  # The diagnostics port (stack dumps), on loopback.
    private: bool = False  # --debug.private: no /debug/* on the HTTP port.
    allow_origins: Sequence[str] = field(default_factory=tuple)

    @property
    def enabled(self) -> bool:
        return self.port is not None or self.debug_port is not None
