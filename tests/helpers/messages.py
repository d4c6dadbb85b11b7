"""Message types the tests build: protobuf message classes made at run time."""

from __future__ import annotations

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import Message as ProtoMessage


def _proto_class(uuid_type: int) -> type[ProtoMessage]:
    fdp = descriptor_pb2.FileDescriptorProto(
        name=f"t{uuid_type}.proto", package="t", syntax="proto3"
    )
    msg = fdp.message_type.add(name="Count")
    msg.field.add(name="uuid", number=1, type=uuid_type)
    msg.field.add(name="ngram", number=2, type=descriptor_pb2.FieldDescriptorProto.TYPE_STRING)
    msg.field.add(name="count", number=3, type=descriptor_pb2.FieldDescriptorProto.TYPE_UINT64)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("t.Count"))
