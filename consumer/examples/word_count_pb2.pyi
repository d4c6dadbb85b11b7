from broker.protocol import protocol_pb2 as _protocol_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class NGramCount(_message.Message):
    __slots__ = ("n_gram", "count")
    N_GRAM_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    n_gram: str
    count: int
    def __init__(self, n_gram: _Optional[str] = ..., count: _Optional[int] = ...) -> None: ...

class PublishRequest(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...

class PublishResponse(_message.Message):
    __slots__ = ("n_grams",)
    N_GRAMS_FIELD_NUMBER: _ClassVar[int]
    n_grams: int
    def __init__(self, n_grams: _Optional[int] = ...) -> None: ...

class QueryRequest(_message.Message):
    __slots__ = ("header", "prefix", "shard")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    header: _protocol_pb2.Header
    prefix: str
    shard: str
    def __init__(self, header: _Optional[_Union[_protocol_pb2.Header, _Mapping]] = ..., prefix: _Optional[str] = ..., shard: _Optional[str] = ...) -> None: ...

class QueryResponse(_message.Message):
    __slots__ = ("header", "grams", "shard")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    GRAMS_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    header: _protocol_pb2.Header
    grams: _containers.RepeatedCompositeFieldContainer[NGramCount]
    shard: str
    def __init__(self, header: _Optional[_Union[_protocol_pb2.Header, _Mapping]] = ..., grams: _Optional[_Iterable[_Union[NGramCount, _Mapping]]] = ..., shard: _Optional[str] = ...) -> None: ...
