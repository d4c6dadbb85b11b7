"""Tenants of the tenancy tests: the signing key, tokens of an admin and of a team, their call
metadata, and a journal spec."""

from __future__ import annotations

import base64

from broker.protocol import protocol_pb2 as pb
from plumbing import auth

KEY = b"a key shared by this test's brokers and consumers, 32+ bytes"


KEYS = base64.b64encode(KEY).decode()


SIGNER = auth.KeyedAuth([KEY])


def team(name: str) -> pb.LabelSelector:
    sel = pb.LabelSelector()
    sel.include.labels.add(name="team", value=name)
    return sel


def md(capability: int = auth.ALL, selector: pb.LabelSelector | None = None, ttl: float = 600) -> tuple[tuple[str, str], ...]:  # fmt: skip
    return (("authorization", f"Bearer {SIGNER.sign(capability, selector, ttl)}"),)


def admin() -> tuple[tuple[str, str], ...]:
    """Every capability, no selector: signed when used (a module-level token would expire
    before a long suite reaches these tests)."""
    return md()


def spec(name: str, owner: str, store: str = "") -> pb.JournalSpec:
    out = pb.JournalSpec(
        name=name,
        replication=1,
        fragment=pb.JournalSpec.Fragment(
            length=1 << 20, compression_codec=pb.NONE, refresh_interval={"seconds": 1}
        ),
    )
    out.labels.labels.add(name="team", value=owner)
    if store:
        out.fragment.stores.append(store)
    return out
