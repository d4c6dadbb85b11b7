"""Fails when the generated protobuf/gRPC modules are stale relative to the .proto files.

The .proto files are compiled here with whatever grpcio-tools the test environment has, and the
resulting FileDescriptorProtos are compared with those embedded in the committed *_pb2 modules, so
the check does not depend on the generator's version. Run `nox -s proto` to regenerate.
"""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2

ROOT = Path(__file__).resolve().parents[1]
# Each generated module's dotted name, by its .proto file.
PROTOS = {
    "broker/protocol/protocol.proto": "broker.protocol.protocol",
    "broker/protocol/recorded_op.proto": "broker.protocol.recorded_op",
    "broker/protocol/consumer.proto": "broker.protocol.consumer",
    "consumer/examples/word_count.proto": "consumer.examples.word_count",
    "replication/location.proto": "replication.location",
}


def compiled_descriptors(tmp_path: Path) -> dict[str, descriptor_pb2.FileDescriptorProto]:
    out = tmp_path / "set.pb"
    files = list(PROTOS)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-I",
            ".",
            f"--descriptor_set_out={out}",
            *files,
        ],
        cwd=ROOT,
        check=True,
    )
    fds = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    for f in fds.file:
        strip_json_names(f.message_type)
    return {f.name: f for f in fds.file}


def strip_json_names(messages: Iterable[descriptor_pb2.DescriptorProto]) -> None:
    """protoc adds json_name to descriptor sets but the Python generator leaves it out."""
    for message in messages:
        for field in message.field:
            field.ClearField("json_name")
        strip_json_names(message.nested_type)


@pytest.mark.parametrize("proto", PROTOS)
def test_generated_pb2_matches_proto(proto: str, tmp_path: Path) -> None:
    expected = compiled_descriptors(tmp_path)[proto]
    module = importlib.import_module(f"{PROTOS[proto]}_pb2")
    embedded = descriptor_pb2.FileDescriptorProto.FromString(module.DESCRIPTOR.serialized_pb)
    assert embedded == expected, f"{module.__file__} is stale: run `nox -s proto`"


@pytest.mark.parametrize(
    "proto",
    [
        "broker/protocol/protocol.proto",
        "broker/protocol/consumer.proto",
        "consumer/examples/word_count.proto",
        "replication/location.proto",
    ],
)
def test_generated_grpc_matches_services(proto: str, tmp_path: Path) -> None:
    fd = compiled_descriptors(tmp_path)[proto]
    name = PROTOS[proto]
    source = (ROOT / f"{name.replace('.', '/')}_pb2_grpc.py").read_text()
    kinds = {
        (False, False): "unary_unary",
        (False, True): "unary_stream",
        (True, False): "stream_unary",
        (True, True): "stream_stream",
    }
    for service in fd.service:
        for method in service.method:
            path = f"/{fd.package}.{service.name}/{method.name}"
            kind = kinds[(method.client_streaming, method.server_streaming)]
            pattern = rf"self\.{method.name} = channel\.{kind}\(\s*'{re.escape(path)}'"
            assert re.search(pattern, source), (
                f"{name}_pb2_grpc.py lacks {kind} {path}: run `nox -s proto`"
            )


def test_upstream_service_paths() -> None:
    """The gRPC paths upstream clients call must exist on our generated servicers."""
    from broker.protocol import consumer_pb2_grpc, protocol_pb2_grpc

    for method in [
        "List",
        "Apply",
        "Read",
        "Append",
        "Replicate",
        "ListFragments",
        "FragmentStoreHealth",
    ]:
        assert hasattr(protocol_pb2_grpc.JournalServicer, method)
    for method in ["Stat", "List", "Apply", "GetHints", "Unassign"]:
        assert hasattr(consumer_pb2_grpc.ShardServicer, method)
