from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Clock(_message.Message):
    __slots__ = ("times",)
    class TimesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    TIMES_FIELD_NUMBER: _ClassVar[int]
    times: _containers.ScalarMap[str, int]
    def __init__(self, times: _Optional[_Mapping[str, int]] = ...) -> None: ...

class Change(_message.Message):
    __slots__ = ("connected", "disconnected", "filtered", "retired", "failed_over")
    class Connection(_message.Message):
        __slots__ = ("source", "target", "filter")
        SOURCE_FIELD_NUMBER: _ClassVar[int]
        TARGET_FIELD_NUMBER: _ClassVar[int]
        FILTER_FIELD_NUMBER: _ClassVar[int]
        source: str
        target: str
        filter: str
        def __init__(self, source: _Optional[str] = ..., target: _Optional[str] = ..., filter: _Optional[str] = ...) -> None: ...
    class FailOver(_message.Message):
        __slots__ = ("previous", "source", "target", "filter")
        PREVIOUS_FIELD_NUMBER: _ClassVar[int]
        SOURCE_FIELD_NUMBER: _ClassVar[int]
        TARGET_FIELD_NUMBER: _ClassVar[int]
        FILTER_FIELD_NUMBER: _ClassVar[int]
        previous: str
        source: str
        target: str
        filter: str
        def __init__(self, previous: _Optional[str] = ..., source: _Optional[str] = ..., target: _Optional[str] = ..., filter: _Optional[str] = ...) -> None: ...
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    DISCONNECTED_FIELD_NUMBER: _ClassVar[int]
    FILTERED_FIELD_NUMBER: _ClassVar[int]
    RETIRED_FIELD_NUMBER: _ClassVar[int]
    FAILED_OVER_FIELD_NUMBER: _ClassVar[int]
    connected: Change.Connection
    disconnected: Change.Connection
    filtered: Change.Connection
    retired: str
    failed_over: Change.FailOver
    def __init__(self, connected: _Optional[_Union[Change.Connection, _Mapping]] = ..., disconnected: _Optional[_Union[Change.Connection, _Mapping]] = ..., filtered: _Optional[_Union[Change.Connection, _Mapping]] = ..., retired: _Optional[str] = ..., failed_over: _Optional[_Union[Change.FailOver, _Mapping]] = ...) -> None: ...

class ChangeKey(_message.Message):
    __slots__ = ("revision", "sum", "emitter", "time")
    REVISION_FIELD_NUMBER: _ClassVar[int]
    SUM_FIELD_NUMBER: _ClassVar[int]
    EMITTER_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    revision: int
    sum: int
    emitter: str
    time: int
    def __init__(self, revision: _Optional[int] = ..., sum: _Optional[int] = ..., emitter: _Optional[str] = ..., time: _Optional[int] = ...) -> None: ...

class KeyedChange(_message.Message):
    __slots__ = ("key", "change")
    KEY_FIELD_NUMBER: _ClassVar[int]
    CHANGE_FIELD_NUMBER: _ClassVar[int]
    key: ChangeKey
    change: Change
    def __init__(self, key: _Optional[_Union[ChangeKey, _Mapping]] = ..., change: _Optional[_Union[Change, _Mapping]] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ConnectionStatus(_message.Message):
    __slots__ = ("source", "filter", "state", "via", "progress", "source_last_seq", "lag", "read", "written", "error")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    FILTER_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    VIA_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    LAG_FIELD_NUMBER: _ClassVar[int]
    READ_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    source: str
    filter: str
    state: str
    via: str
    progress: int
    source_last_seq: int
    lag: int
    read: int
    written: int
    error: str
    def __init__(self, source: _Optional[str] = ..., filter: _Optional[str] = ..., state: _Optional[str] = ..., via: _Optional[str] = ..., progress: _Optional[int] = ..., source_last_seq: _Optional[int] = ..., lag: _Optional[int] = ..., read: _Optional[int] = ..., written: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("location", "journal", "endpoint", "cvv", "dvv", "last_seq", "deleted_through", "local_time", "progress", "cached_cvv", "connections", "history", "retired", "lost", "prunable_before", "clock_ok", "unheard", "journal_created", "recovering")
    class ProgressEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class CachedCvvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: Clock
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[Clock, _Mapping]] = ...) -> None: ...
    LOCATION_FIELD_NUMBER: _ClassVar[int]
    JOURNAL_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    CVV_FIELD_NUMBER: _ClassVar[int]
    DVV_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    DELETED_THROUGH_FIELD_NUMBER: _ClassVar[int]
    LOCAL_TIME_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    CACHED_CVV_FIELD_NUMBER: _ClassVar[int]
    CONNECTIONS_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    RETIRED_FIELD_NUMBER: _ClassVar[int]
    LOST_FIELD_NUMBER: _ClassVar[int]
    PRUNABLE_BEFORE_FIELD_NUMBER: _ClassVar[int]
    CLOCK_OK_FIELD_NUMBER: _ClassVar[int]
    UNHEARD_FIELD_NUMBER: _ClassVar[int]
    JOURNAL_CREATED_FIELD_NUMBER: _ClassVar[int]
    RECOVERING_FIELD_NUMBER: _ClassVar[int]
    location: str
    journal: str
    endpoint: str
    cvv: Clock
    dvv: Clock
    last_seq: int
    deleted_through: int
    local_time: int
    progress: _containers.ScalarMap[str, int]
    cached_cvv: _containers.MessageMap[str, Clock]
    connections: _containers.RepeatedCompositeFieldContainer[ConnectionStatus]
    history: _containers.RepeatedCompositeFieldContainer[KeyedChange]
    retired: _containers.RepeatedScalarFieldContainer[str]
    lost: str
    prunable_before: int
    clock_ok: bool
    unheard: _containers.RepeatedScalarFieldContainer[str]
    journal_created: int
    recovering: str
    def __init__(self, location: _Optional[str] = ..., journal: _Optional[str] = ..., endpoint: _Optional[str] = ..., cvv: _Optional[_Union[Clock, _Mapping]] = ..., dvv: _Optional[_Union[Clock, _Mapping]] = ..., last_seq: _Optional[int] = ..., deleted_through: _Optional[int] = ..., local_time: _Optional[int] = ..., progress: _Optional[_Mapping[str, int]] = ..., cached_cvv: _Optional[_Mapping[str, Clock]] = ..., connections: _Optional[_Iterable[_Union[ConnectionStatus, _Mapping]]] = ..., history: _Optional[_Iterable[_Union[KeyedChange, _Mapping]]] = ..., retired: _Optional[_Iterable[str]] = ..., lost: _Optional[str] = ..., prunable_before: _Optional[int] = ..., clock_ok: bool = ..., unheard: _Optional[_Iterable[str]] = ..., journal_created: _Optional[int] = ..., recovering: _Optional[str] = ...) -> None: ...

class EmitRequest(_message.Message):
    __slots__ = ("payloads",)
    PAYLOADS_FIELD_NUMBER: _ClassVar[int]
    payloads: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, payloads: _Optional[_Iterable[bytes]] = ...) -> None: ...

class EventId(_message.Message):
    __slots__ = ("emitter", "time", "timestamp")
    EMITTER_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    emitter: str
    time: int
    timestamp: Clock
    def __init__(self, emitter: _Optional[str] = ..., time: _Optional[int] = ..., timestamp: _Optional[_Union[Clock, _Mapping]] = ...) -> None: ...

class EmitResponse(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[EventId]
    def __init__(self, events: _Optional[_Iterable[_Union[EventId, _Mapping]]] = ...) -> None: ...

class ReadRequest(_message.Message):
    __slots__ = ("after", "limit", "cvv", "filter", "or_emitter", "wait")
    AFTER_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    CVV_FIELD_NUMBER: _ClassVar[int]
    FILTER_FIELD_NUMBER: _ClassVar[int]
    OR_EMITTER_FIELD_NUMBER: _ClassVar[int]
    WAIT_FIELD_NUMBER: _ClassVar[int]
    after: int
    limit: int
    cvv: Clock
    filter: str
    or_emitter: str
    wait: float
    def __init__(self, after: _Optional[int] = ..., limit: _Optional[int] = ..., cvv: _Optional[_Union[Clock, _Mapping]] = ..., filter: _Optional[str] = ..., or_emitter: _Optional[str] = ..., wait: _Optional[float] = ...) -> None: ...

class ReadResponse(_message.Message):
    __slots__ = ("through", "cvv", "dvv", "deleted_through", "last_seq", "records")
    THROUGH_FIELD_NUMBER: _ClassVar[int]
    CVV_FIELD_NUMBER: _ClassVar[int]
    DVV_FIELD_NUMBER: _ClassVar[int]
    DELETED_THROUGH_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    through: int
    cvv: Clock
    dvv: Clock
    deleted_through: int
    last_seq: int
    records: bytes
    def __init__(self, through: _Optional[int] = ..., cvv: _Optional[_Union[Clock, _Mapping]] = ..., dvv: _Optional[_Union[Clock, _Mapping]] = ..., deleted_through: _Optional[int] = ..., last_seq: _Optional[int] = ..., records: _Optional[bytes] = ...) -> None: ...

class ChangeRequest(_message.Message):
    __slots__ = ("change", "record", "op")
    CHANGE_FIELD_NUMBER: _ClassVar[int]
    RECORD_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    change: Change
    record: bool
    op: int
    def __init__(self, change: _Optional[_Union[Change, _Mapping]] = ..., record: bool = ..., op: _Optional[int] = ...) -> None: ...

class ChangeResponse(_message.Message):
    __slots__ = ("change", "recorded")
    CHANGE_FIELD_NUMBER: _ClassVar[int]
    RECORDED_FIELD_NUMBER: _ClassVar[int]
    change: Change
    recorded: bool
    def __init__(self, change: _Optional[_Union[Change, _Mapping]] = ..., recorded: bool = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("through",)
    THROUGH_FIELD_NUMBER: _ClassVar[int]
    through: int
    def __init__(self, through: _Optional[int] = ...) -> None: ...

class DeleteResponse(_message.Message):
    __slots__ = ("dvv", "deleted_through")
    DVV_FIELD_NUMBER: _ClassVar[int]
    DELETED_THROUGH_FIELD_NUMBER: _ClassVar[int]
    dvv: Clock
    deleted_through: int
    def __init__(self, dvv: _Optional[_Union[Clock, _Mapping]] = ..., deleted_through: _Optional[int] = ...) -> None: ...

class ResetProgressRequest(_message.Message):
    __slots__ = ("source", "seq")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    source: str
    seq: int
    def __init__(self, source: _Optional[str] = ..., seq: _Optional[int] = ...) -> None: ...

class ResetProgressResponse(_message.Message):
    __slots__ = ("progress",)
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    progress: int
    def __init__(self, progress: _Optional[int] = ...) -> None: ...

class RecoverRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RecoverResponse(_message.Message):
    __slots__ = ("survivors", "local_time", "not_recovered_from")
    SURVIVORS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_TIME_FIELD_NUMBER: _ClassVar[int]
    NOT_RECOVERED_FROM_FIELD_NUMBER: _ClassVar[int]
    survivors: int
    local_time: int
    not_recovered_from: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, survivors: _Optional[int] = ..., local_time: _Optional[int] = ..., not_recovered_from: _Optional[_Iterable[str]] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("sources",)
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    sources: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, sources: _Optional[_Iterable[str]] = ...) -> None: ...

class JoinResponse(_message.Message):
    __slots__ = ("cvv", "dvv")
    CVV_FIELD_NUMBER: _ClassVar[int]
    DVV_FIELD_NUMBER: _ClassVar[int]
    cvv: Clock
    dvv: Clock
    def __init__(self, cvv: _Optional[_Union[Clock, _Mapping]] = ..., dvv: _Optional[_Union[Clock, _Mapping]] = ...) -> None: ...

class TrustClockRequest(_message.Message):
    __slots__ = ("without",)
    WITHOUT_FIELD_NUMBER: _ClassVar[int]
    without: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, without: _Optional[_Iterable[str]] = ...) -> None: ...

class TrustClockResponse(_message.Message):
    __slots__ = ("clock_ok", "unheard")
    CLOCK_OK_FIELD_NUMBER: _ClassVar[int]
    UNHEARD_FIELD_NUMBER: _ClassVar[int]
    clock_ok: bool
    unheard: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, clock_ok: bool = ..., unheard: _Optional[_Iterable[str]] = ...) -> None: ...
