from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WireDType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WIRE_DTYPE_UNSPECIFIED: _ClassVar[WireDType]
    WIRE_DTYPE_FLOAT32: _ClassVar[WireDType]
    WIRE_DTYPE_BFLOAT16: _ClassVar[WireDType]
    WIRE_DTYPE_INT8_BLOCK256: _ClassVar[WireDType]
    WIRE_DTYPE_INT4_BLOCK256: _ClassVar[WireDType]
    WIRE_DTYPE_SPARSE_TOPK4096: _ClassVar[WireDType]
    WIRE_DTYPE_SIDE_MOD3: _ClassVar[WireDType]
WIRE_DTYPE_UNSPECIFIED: WireDType
WIRE_DTYPE_FLOAT32: WireDType
WIRE_DTYPE_BFLOAT16: WireDType
WIRE_DTYPE_INT8_BLOCK256: WireDType
WIRE_DTYPE_INT4_BLOCK256: WireDType
WIRE_DTYPE_SPARSE_TOPK4096: WireDType
WIRE_DTYPE_SIDE_MOD3: WireDType

class TensorSpec(_message.Message):
    __slots__ = ("name", "shape", "dtype", "num_bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: WireDType
    num_bytes: int
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[_Union[WireDType, str]] = ..., num_bytes: _Optional[int] = ...) -> None: ...

class Manifest(_message.Message):
    __slots__ = ("run_fingerprint", "peer_id", "outer_step", "tensors", "metadata_json", "phase_tokens")
    RUN_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    OUTER_STEP_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    METADATA_JSON_FIELD_NUMBER: _ClassVar[int]
    PHASE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    run_fingerprint: str
    peer_id: str
    outer_step: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    metadata_json: str
    phase_tokens: int
    def __init__(self, run_fingerprint: _Optional[str] = ..., peer_id: _Optional[str] = ..., outer_step: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., metadata_json: _Optional[str] = ..., phase_tokens: _Optional[int] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("tensor_index", "offset", "data", "checksum")
    TENSOR_INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    tensor_index: int
    offset: int
    data: bytes
    checksum: int
    def __init__(self, tensor_index: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., checksum: _Optional[int] = ...) -> None: ...

class End(_message.Message):
    __slots__ = ("total_bytes", "signature", "signer_key")
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    SIGNER_KEY_FIELD_NUMBER: _ClassVar[int]
    total_bytes: int
    signature: bytes
    signer_key: bytes
    def __init__(self, total_bytes: _Optional[int] = ..., signature: _Optional[bytes] = ..., signer_key: _Optional[bytes] = ...) -> None: ...

class Verdict(_message.Message):
    __slots__ = ("commit", "reason", "receipt_signature", "receipt_time")
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    RECEIPT_SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    RECEIPT_TIME_FIELD_NUMBER: _ClassVar[int]
    commit: bool
    reason: str
    receipt_signature: bytes
    receipt_time: int
    def __init__(self, commit: _Optional[bool] = ..., reason: _Optional[str] = ..., receipt_signature: _Optional[bytes] = ..., receipt_time: _Optional[int] = ...) -> None: ...

class Frame(_message.Message):
    __slots__ = ("manifest", "chunk", "end", "verdict")
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    manifest: Manifest
    chunk: Chunk
    end: End
    verdict: Verdict
    def __init__(self, manifest: _Optional[_Union[Manifest, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ..., end: _Optional[_Union[End, _Mapping]] = ..., verdict: _Optional[_Union[Verdict, _Mapping]] = ...) -> None: ...

class StateRequest(_message.Message):
    __slots__ = ("run_fingerprint", "peer_id", "from_tensor", "outer_step", "from_offset")
    RUN_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    FROM_TENSOR_FIELD_NUMBER: _ClassVar[int]
    OUTER_STEP_FIELD_NUMBER: _ClassVar[int]
    FROM_OFFSET_FIELD_NUMBER: _ClassVar[int]
    run_fingerprint: str
    peer_id: str
    from_tensor: int
    outer_step: int
    from_offset: int
    def __init__(self, run_fingerprint: _Optional[str] = ..., peer_id: _Optional[str] = ..., from_tensor: _Optional[int] = ..., outer_step: _Optional[int] = ..., from_offset: _Optional[int] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ("dial_back",)
    DIAL_BACK_FIELD_NUMBER: _ClassVar[int]
    dial_back: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, dial_back: _Optional[_Iterable[int]] = ...) -> None: ...

class DialBack(_message.Message):
    __slots__ = ("port", "connected", "error")
    PORT_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    port: int
    connected: bool
    error: str
    def __init__(self, port: _Optional[int] = ..., connected: _Optional[bool] = ..., error: _Optional[str] = ...) -> None: ...

class LossPoint(_message.Message):
    __slots__ = ("inner_step", "train_loss", "val_loss", "time")
    INNER_STEP_FIELD_NUMBER: _ClassVar[int]
    TRAIN_LOSS_FIELD_NUMBER: _ClassVar[int]
    VAL_LOSS_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    inner_step: int
    train_loss: float
    val_loss: float
    time: float
    def __init__(self, inner_step: _Optional[int] = ..., train_loss: _Optional[float] = ..., val_loss: _Optional[float] = ..., time: _Optional[float] = ...) -> None: ...

class InfoReply(_message.Message):
    __slots__ = ("peer_id", "run_fingerprint", "outer_step", "inner_step", "ready_to_pair", "health", "version", "train_loss", "val_loss", "history", "dial_back")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    OUTER_STEP_FIELD_NUMBER: _ClassVar[int]
    INNER_STEP_FIELD_NUMBER: _ClassVar[int]
    READY_TO_PAIR_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TRAIN_LOSS_FIELD_NUMBER: _ClassVar[int]
    VAL_LOSS_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    DIAL_BACK_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    run_fingerprint: str
    outer_step: int
    inner_step: int
    ready_to_pair: bool
    health: str
    version: str
    train_loss: float
    val_loss: float
    history: _containers.RepeatedCompositeFieldContainer[LossPoint]
    dial_back: _containers.RepeatedCompositeFieldContainer[DialBack]
    def __init__(self, peer_id: _Optional[str] = ..., run_fingerprint: _Optional[str] = ..., outer_step: _Optional[int] = ..., inner_step: _Optional[int] = ..., ready_to_pair: _Optional[bool] = ..., health: _Optional[str] = ..., version: _Optional[str] = ..., train_loss: _Optional[float] = ..., val_loss: _Optional[float] = ..., history: _Optional[_Iterable[_Union[LossPoint, _Mapping]]] = ..., dial_back: _Optional[_Iterable[_Union[DialBack, _Mapping]]] = ...) -> None: ...

class RolloutRequest(_message.Message):
    __slots__ = ("run_fingerprint", "round")
    RUN_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    run_fingerprint: str
    round: int
    def __init__(self, run_fingerprint: _Optional[str] = ..., round: _Optional[int] = ...) -> None: ...

class RolloutGroup(_message.Message):
    __slots__ = ("family", "seed", "index", "completions")
    FAMILY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    COMPLETIONS_FIELD_NUMBER: _ClassVar[int]
    family: str
    seed: int
    index: int
    completions: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, family: _Optional[str] = ..., seed: _Optional[int] = ..., index: _Optional[int] = ..., completions: _Optional[_Iterable[str]] = ...) -> None: ...

class RolloutBatch(_message.Message):
    __slots__ = ("run_fingerprint", "peer_id", "round", "groups")
    RUN_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    run_fingerprint: str
    peer_id: str
    round: int
    groups: _containers.RepeatedCompositeFieldContainer[RolloutGroup]
    def __init__(self, run_fingerprint: _Optional[str] = ..., peer_id: _Optional[str] = ..., round: _Optional[int] = ..., groups: _Optional[_Iterable[_Union[RolloutGroup, _Mapping]]] = ...) -> None: ...

class ReceiptsRequest(_message.Message):
    __slots__ = ("run_fingerprint", "after", "limit")
    RUN_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    AFTER_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    run_fingerprint: str
    after: int
    limit: int
    def __init__(self, run_fingerprint: _Optional[str] = ..., after: _Optional[int] = ..., limit: _Optional[int] = ...) -> None: ...

class ReceiptsPage(_message.Message):
    __slots__ = ("receipts",)
    RECEIPTS_FIELD_NUMBER: _ClassVar[int]
    receipts: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, receipts: _Optional[_Iterable[str]] = ...) -> None: ...
