"""Shared gRPC channels to peers, keyed by their advertised endpoint (`http://host:port`).

Brokers dial each other for replication and proxying; one channel per peer is enough, since
gRPC multiplexes every stream of a channel over one HTTP/2 connection.
"""

from __future__ import annotations

from typing import Any

import grpc

from broker.client.journals import grpc_target
from broker.protocol import protocol_pb2 as pb
from broker.protocol import protocol_pb2_grpc as pb_grpc

REPLICATE_METHOD = "/protocol.Journal/Replicate"

# Append and Read chunks stay well below this; replication carries the same chunks.
MAX_MESSAGE = 64 * 1024 * 1024


class Dialer:
    def __init__(self) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}

    def channel(self, endpoint: str) -> grpc.aio.Channel:
        channel = self._channels.get(endpoint)
        if channel is None:
            channel = grpc.aio.insecure_channel(
                grpc_target(endpoint),
                options=[
                    ("grpc.max_receive_message_length", MAX_MESSAGE),
                    ("grpc.max_send_message_length", MAX_MESSAGE),
                    # A restarted peer should be redialed within a second, not minutes.
                    ("grpc.initial_reconnect_backoff_ms", 100),
                    ("grpc.max_reconnect_backoff_ms", 1000),
                ],
            )
            self._channels[endpoint] = channel
        return channel

    def journal_stub(self, endpoint: str) -> pb_grpc.JournalStub:
        return pb_grpc.JournalStub(self.channel(endpoint))  # type: ignore[no-untyped-call]

    def replicate_stream(self, endpoint: str) -> Any:
        """A Replicate stream whose requests are written already serialized (bytes), so that
        a primary encodes each content chunk once for all of its peers."""
        call = self.channel(endpoint).stream_stream(
            REPLICATE_METHOD,
            request_serializer=None,  # Identity: the pipeline writes wire bytes.
            response_deserializer=pb.ReplicateResponse.FromString,
        )
        return call()  # type: ignore[call-arg]  # (grpc-stubs: the iterator is optional)

    async def close(self) -> None:
        channels, self._channels = self._channels, {}
        for channel in channels.values():
            await channel.close(None)
