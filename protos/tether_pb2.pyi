from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    FLOAT32: _ClassVar[DType]
    FLOAT16: _ClassVar[DType]
    BFLOAT16: _ClassVar[DType]
    INT64: _ClassVar[DType]
DTYPE_UNSPECIFIED: DType
FLOAT32: DType
FLOAT16: DType
BFLOAT16: DType
INT64: DType

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data", "payload_offset", "payload_bytes")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_OFFSET_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    payload_offset: int
    payload_bytes: int
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., payload_offset: _Optional[int] = ..., payload_bytes: _Optional[int] = ...) -> None: ...

class OptimizerSpec(_message.Message):
    __slots__ = ("name", "lr", "beta1", "beta2", "eps", "weight_decay", "initial_accumulator", "beta", "l1", "l2", "lr_power", "schedule")
    NAME_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    BETA1_FIELD_NUMBER: _ClassVar[int]
    BETA2_FIELD_NUMBER: _ClassVar[int]
    EPS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    INITIAL_ACCUMULATOR_FIELD_NUMBER: _ClassVar[int]
    BETA_FIELD_NUMBER: _ClassVar[int]
    L1_FIELD_NUMBER: _ClassVar[int]
    L2_FIELD_NUMBER: _ClassVar[int]
    LR_POWER_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    name: str
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    initial_accumulator: float
    beta: float
    l1: float
    l2: float
    lr_power: float
    schedule: LRSchedule
    def __init__(self, name: _Optional[str] = ..., lr: _Optional[float] = ..., beta1: _Optional[float] = ..., beta2: _Optional[float] = ..., eps: _Optional[float] = ..., weight_decay: _Optional[float] = ..., initial_accumulator: _Optional[float] = ..., beta: _Optional[float] = ..., l1: _Optional[float] = ..., l2: _Optional[float] = ..., lr_power: _Optional[float] = ..., schedule: _Optional[_Union[LRSchedule, _Mapping]] = ...) -> None: ...

class LRSchedule(_message.Message):
    __slots__ = ("warmup_steps", "warmup_factor", "decay", "decay_steps", "gamma", "min_lr")
    WARMUP_STEPS_FIELD_NUMBER: _ClassVar[int]
    WARMUP_FACTOR_FIELD_NUMBER: _ClassVar[int]
    DECAY_FIELD_NUMBER: _ClassVar[int]
    DECAY_STEPS_FIELD_NUMBER: _ClassVar[int]
    GAMMA_FIELD_NUMBER: _ClassVar[int]
    MIN_LR_FIELD_NUMBER: _ClassVar[int]
    warmup_steps: int
    warmup_factor: float
    decay: str
    decay_steps: int
    gamma: float
    min_lr: float
    def __init__(self, warmup_steps: _Optional[int] = ..., warmup_factor: _Optional[float] = ..., decay: _Optional[str] = ..., decay_steps: _Optional[int] = ..., gamma: _Optional[float] = ..., min_lr: _Optional[float] = ...) -> None: ...

class TableSpec(_message.Message):
    __slots__ = ("name", "dim", "optimizer", "init_scale", "seed", "capacity", "min_count")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    INIT_SCALE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    MIN_COUNT_FIELD_NUMBER: _ClassVar[int]
    name: str
    dim: int
    optimizer: OptimizerSpec
    init_scale: float
    seed: int
    capacity: int
    min_count: int
    def __init__(self, name: _Optional[str] = ..., dim: _Optional[int] = ..., optimizer: _Optional[_Union[OptimizerSpec, _Mapping]] = ..., init_scale: _Optional[float] = ..., seed: _Optional[int] = ..., capacity: _Optional[int] = ..., min_count: _Optional[int] = ...) -> None: ...

class DenseSpec(_message.Message):
    __slots__ = ("name", "index", "optimizer", "init")
    NAME_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    INIT_FIELD_NUMBER: _ClassVar[int]
    name: str
    index: int
    optimizer: OptimizerSpec
    init: Tensor
    def __init__(self, name: _Optional[str] = ..., index: _Optional[int] = ..., optimizer: _Optional[_Union[OptimizerSpec, _Mapping]] = ..., init: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class DeclareRequest(_message.Message):
    __slots__ = ("tables", "dense")
    TABLES_FIELD_NUMBER: _ClassVar[int]
    DENSE_FIELD_NUMBER: _ClassVar[int]
    tables: _containers.RepeatedCompositeFieldContainer[TableSpec]
    dense: _containers.RepeatedCompositeFieldContainer[DenseSpec]
    def __init__(self, tables: _Optional[_Iterable[_Union[TableSpec, _Mapping]]] = ..., dense: _Optional[_Iterable[_Union[DenseSpec, _Mapping]]] = ...) -> None: ...

class DeclareResponse(_message.Message):
    __slots__ = ("shard_index", "num_shards", "data_port", "data_socket")
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    DATA_SOCKET_FIELD_NUMBER: _ClassVar[int]
    shard_index: int
    num_shards: int
    data_port: int
    data_socket: str
    def __init__(self, shard_index: _Optional[int] = ..., num_shards: _Optional[int] = ..., data_port: _Optional[int] = ..., data_socket: _Optional[str] = ...) -> None: ...

class SparseBlock(_message.Message):
    __slots__ = ("table", "ids", "values", "read_version", "read_values", "combined")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    READ_VERSION_FIELD_NUMBER: _ClassVar[int]
    READ_VALUES_FIELD_NUMBER: _ClassVar[int]
    COMBINED_FIELD_NUMBER: _ClassVar[int]
    table: str
    ids: bytes
    values: Tensor
    read_version: int
    read_values: Tensor
    combined: Tensor
    def __init__(self, table: _Optional[str] = ..., ids: _Optional[bytes] = ..., values: _Optional[_Union[Tensor, _Mapping]] = ..., read_version: _Optional[int] = ..., read_values: _Optional[_Union[Tensor, _Mapping]] = ..., combined: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class DenseBlock(_message.Message):
    __slots__ = ("name", "index", "value", "read_version", "read_value")
    NAME_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    READ_VERSION_FIELD_NUMBER: _ClassVar[int]
    READ_VALUE_FIELD_NUMBER: _ClassVar[int]
    name: str
    index: int
    value: Tensor
    read_version: int
    read_value: Tensor
    def __init__(self, name: _Optional[str] = ..., index: _Optional[int] = ..., value: _Optional[_Union[Tensor, _Mapping]] = ..., read_version: _Optional[int] = ..., read_value: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("worker_id", "sparse", "dense", "wire_dtype")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SPARSE_FIELD_NUMBER: _ClassVar[int]
    DENSE_FIELD_NUMBER: _ClassVar[int]
    WIRE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    sparse: _containers.RepeatedCompositeFieldContainer[SparseBlock]
    dense: _containers.RepeatedCompositeFieldContainer[DenseBlock]
    wire_dtype: DType
    def __init__(self, worker_id: _Optional[str] = ..., sparse: _Optional[_Iterable[_Union[SparseBlock, _Mapping]]] = ..., dense: _Optional[_Iterable[_Union[DenseBlock, _Mapping]]] = ..., wire_dtype: _Optional[_Union[DType, str]] = ...) -> None: ...

class PullResponse(_message.Message):
    __slots__ = ("sparse", "dense")
    SPARSE_FIELD_NUMBER: _ClassVar[int]
    DENSE_FIELD_NUMBER: _ClassVar[int]
    sparse: _containers.RepeatedCompositeFieldContainer[SparseBlock]
    dense: _containers.RepeatedCompositeFieldContainer[DenseBlock]
    def __init__(self, sparse: _Optional[_Iterable[_Union[SparseBlock, _Mapping]]] = ..., dense: _Optional[_Iterable[_Union[DenseBlock, _Mapping]]] = ...) -> None: ...

class PushRequest(_message.Message):
    __slots__ = ("worker_id", "seq", "clock", "sparse", "dense", "staleness_aware", "incarnation", "delay_compensation", "dc_adaptive", "gap_aware", "remedy_decay")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    SPARSE_FIELD_NUMBER: _ClassVar[int]
    DENSE_FIELD_NUMBER: _ClassVar[int]
    STALENESS_AWARE_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    DELAY_COMPENSATION_FIELD_NUMBER: _ClassVar[int]
    DC_ADAPTIVE_FIELD_NUMBER: _ClassVar[int]
    GAP_AWARE_FIELD_NUMBER: _ClassVar[int]
    REMEDY_DECAY_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    seq: int
    clock: int
    sparse: _containers.RepeatedCompositeFieldContainer[SparseBlock]
    dense: _containers.RepeatedCompositeFieldContainer[DenseBlock]
    staleness_aware: bool
    incarnation: int
    delay_compensation: float
    dc_adaptive: bool
    gap_aware: bool
    remedy_decay: float
    def __init__(self, worker_id: _Optional[str] = ..., seq: _Optional[int] = ..., clock: _Optional[int] = ..., sparse: _Optional[_Iterable[_Union[SparseBlock, _Mapping]]] = ..., dense: _Optional[_Iterable[_Union[DenseBlock, _Mapping]]] = ..., staleness_aware: _Optional[bool] = ..., incarnation: _Optional[int] = ..., delay_compensation: _Optional[float] = ..., dc_adaptive: _Optional[bool] = ..., gap_aware: _Optional[bool] = ..., remedy_decay: _Optional[float] = ...) -> None: ...

class PushResponse(_message.Message):
    __slots__ = ("applied", "staleness", "clock_staleness")
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    CLOCK_STALENESS_FIELD_NUMBER: _ClassVar[int]
    applied: bool
    staleness: int
    clock_staleness: int
    def __init__(self, applied: _Optional[bool] = ..., staleness: _Optional[int] = ..., clock_staleness: _Optional[int] = ...) -> None: ...

class ClockRequest(_message.Message):
    __slots__ = ("worker_id", "clock", "leave", "wait_bound", "wait_timeout_ms")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    LEAVE_FIELD_NUMBER: _ClassVar[int]
    WAIT_BOUND_FIELD_NUMBER: _ClassVar[int]
    WAIT_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    clock: int
    leave: bool
    wait_bound: int
    wait_timeout_ms: int
    def __init__(self, worker_id: _Optional[str] = ..., clock: _Optional[int] = ..., leave: _Optional[bool] = ..., wait_bound: _Optional[int] = ..., wait_timeout_ms: _Optional[int] = ...) -> None: ...

class ClockResponse(_message.Message):
    __slots__ = ("min_clock", "max_clock", "live_workers", "ready", "min_other_clock", "finished_workers")
    MIN_CLOCK_FIELD_NUMBER: _ClassVar[int]
    MAX_CLOCK_FIELD_NUMBER: _ClassVar[int]
    LIVE_WORKERS_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    MIN_OTHER_CLOCK_FIELD_NUMBER: _ClassVar[int]
    FINISHED_WORKERS_FIELD_NUMBER: _ClassVar[int]
    min_clock: int
    max_clock: int
    live_workers: int
    ready: bool
    min_other_clock: int
    finished_workers: int
    def __init__(self, min_clock: _Optional[int] = ..., max_clock: _Optional[int] = ..., live_workers: _Optional[int] = ..., ready: _Optional[bool] = ..., min_other_clock: _Optional[int] = ..., finished_workers: _Optional[int] = ...) -> None: ...

class PushPullRequest(_message.Message):
    __slots__ = ("push", "pull")
    PUSH_FIELD_NUMBER: _ClassVar[int]
    PULL_FIELD_NUMBER: _ClassVar[int]
    push: PushRequest
    pull: PullRequest
    def __init__(self, push: _Optional[_Union[PushRequest, _Mapping]] = ..., pull: _Optional[_Union[PullRequest, _Mapping]] = ...) -> None: ...

class PushPullResponse(_message.Message):
    __slots__ = ("push", "pull")
    PUSH_FIELD_NUMBER: _ClassVar[int]
    PULL_FIELD_NUMBER: _ClassVar[int]
    push: PushResponse
    pull: PullResponse
    def __init__(self, push: _Optional[_Union[PushResponse, _Mapping]] = ..., pull: _Optional[_Union[PullResponse, _Mapping]] = ...) -> None: ...

class TableInfo(_message.Message):
    __slots__ = ("name", "dim", "rows", "version", "optimizer", "memory_bytes", "evicted_rows", "dropped_rows")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    EVICTED_ROWS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_ROWS_FIELD_NUMBER: _ClassVar[int]
    name: str
    dim: int
    rows: int
    version: int
    optimizer: str
    memory_bytes: int
    evicted_rows: int
    dropped_rows: int
    def __init__(self, name: _Optional[str] = ..., dim: _Optional[int] = ..., rows: _Optional[int] = ..., version: _Optional[int] = ..., optimizer: _Optional[str] = ..., memory_bytes: _Optional[int] = ..., evicted_rows: _Optional[int] = ..., dropped_rows: _Optional[int] = ...) -> None: ...

class DenseInfo(_message.Message):
    __slots__ = ("name", "index", "numel", "version", "optimizer")
    NAME_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    name: str
    index: int
    numel: int
    version: int
    optimizer: str
    def __init__(self, name: _Optional[str] = ..., index: _Optional[int] = ..., numel: _Optional[int] = ..., version: _Optional[int] = ..., optimizer: _Optional[str] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("shard_index", "num_shards", "tables", "dense", "applied_pushes", "duplicate_pushes", "rejected_pushes", "restored_checkpoint", "last_checkpoint", "data_port", "data_socket")
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    DENSE_FIELD_NUMBER: _ClassVar[int]
    APPLIED_PUSHES_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_PUSHES_FIELD_NUMBER: _ClassVar[int]
    REJECTED_PUSHES_FIELD_NUMBER: _ClassVar[int]
    RESTORED_CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    LAST_CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    DATA_SOCKET_FIELD_NUMBER: _ClassVar[int]
    shard_index: int
    num_shards: int
    tables: _containers.RepeatedCompositeFieldContainer[TableInfo]
    dense: _containers.RepeatedCompositeFieldContainer[DenseInfo]
    applied_pushes: int
    duplicate_pushes: int
    rejected_pushes: int
    restored_checkpoint: str
    last_checkpoint: str
    data_port: int
    data_socket: str
    def __init__(self, shard_index: _Optional[int] = ..., num_shards: _Optional[int] = ..., tables: _Optional[_Iterable[_Union[TableInfo, _Mapping]]] = ..., dense: _Optional[_Iterable[_Union[DenseInfo, _Mapping]]] = ..., applied_pushes: _Optional[int] = ..., duplicate_pushes: _Optional[int] = ..., rejected_pushes: _Optional[int] = ..., restored_checkpoint: _Optional[str] = ..., last_checkpoint: _Optional[str] = ..., data_port: _Optional[int] = ..., data_socket: _Optional[str] = ...) -> None: ...

class CheckpointRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class CheckpointResponse(_message.Message):
    __slots__ = ("id", "path", "bytes", "seconds")
    ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    id: str
    path: str
    bytes: int
    seconds: float
    def __init__(self, id: _Optional[str] = ..., path: _Optional[str] = ..., bytes: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...
