"""KVScope wire protocol, version 2: every message, event and command as a typed struct.

The contract is docs/protocol.md. Server messages are tagged by `type`, events by `kind`,
client commands by `op`. Everything here is plain data (msgspec structs), importable without
torch, so the dashboard and outside tools can use it.
"""
from __future__ import annotations

import base64
import json
from typing import Annotated, Any, Literal, Union

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

PROTOCOL_VERSION = 3  # 2: KV-cache groups (hybrid models); 3: the host tier (offloading). An older
#                       stream is a stream without those: version 1 one group, versions 1-2 no host tier
MAX_FRAME_BYTES = 1 << 20
DEFAULT_MAX_TOKENS = 64  # new tokens of a request that does not say
MAX_TEXT_CHARS = 100_000  # of a prompt, or of one chat message

Status = Literal["waiting", "running", "swapped"]
KVGroupKind = Literal["full_attention", "sliding_window"]
NULL_BLOCK = -1  # a table entry with no block: a sliding window has passed it, or a prefix hit skipped it
PreemptionMode = Literal["swap", "recompute"]
FinishReason = Literal["stop", "length", "abort", "error"]
PreemptReason = Literal["host_pool_full"]
ErrorCode = Literal["bad_json", "unknown_op", "invalid_argument", "too_long", "duplicate_id",
                    "not_found", "busy", "unsupported"]

# Bounds a client may ask for; the engine may refuse more (memory) with its own message.
MAX_BLOCK_SIZE, MAX_DEVICE_BLOCKS, MAX_HOST_BLOCKS, MAX_NUM_SEQS = 256, 1 << 20, 1 << 18, 4096
MAX_KV_GROUPS = 64  # a pool's KV-cache groups (Gemma 3 has 6); a block's group is a uint8
BlockSize = Annotated[int, Meta(ge=1, le=MAX_BLOCK_SIZE)]
BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)  # what the dashboard offers (a reset takes any power of two)
NumDeviceBlocks = Annotated[int, Meta(ge=1, le=MAX_DEVICE_BLOCKS)]
NumHostBlocks = Annotated[int, Meta(ge=0, le=MAX_HOST_BLOCKS)]
MaxNumSeqs = Annotated[int, Meta(ge=1, le=MAX_NUM_SEQS)]


class KVGroup(Struct, kw_only=True):
    """One KV-cache group: layers of one attention kind whose K/V share a block table per
    sequence (vLLM v1's KVCacheGroupSpec). Every group of a pool has as many layers, so every
    block, whichever group holds it, has the same size."""
    kind: KVGroupKind = "full_attention"
    sliding_window: int | None = None  # sliding_window kind: keys a query attends to, itself included
    layers: list[int] = []             # the model's layers whose K/V this group's blocks hold

    @property
    def window(self) -> int | None:
        """Tokens a query attends to (None: every earlier token)."""
        return self.sliding_window if self.kind == "sliding_window" else None


FULL_ATTENTION = KVGroup()  # the one group of a pool whose config names none


class PoolConfig(Struct, kw_only=True):
    """The allocator's configuration, as sent in `hello`, `snapshot` and `reset`."""
    block_size: int = 16
    num_device_blocks: int = 256
    num_host_blocks: int = 128
    enable_prefix_caching: bool = True
    preemption_mode: PreemptionMode = "swap"
    max_num_seqs: int = 16
    bytes_per_block: int = 0
    # Addition: device blocks the allocator never hands out, shown as reserved (vLLM's null block 0).
    reserved_blocks: list[int] = []
    # Addition (protocol 2): the KV-cache groups, a block table per group per sequence; empty
    # means one full-attention group over every layer, as every protocol-1 pool is.
    kv_groups: list[KVGroup] = []
    # Addition (protocol 3): blocks of the host tier (docs/offload.md), where full blocks are stored
    # as they complete and a prefix lookup that misses on the device finds them; 0: no host tier.
    num_offload_blocks: int = 0

    @property
    def groups(self) -> list[KVGroup]:
        """The KV-cache groups, never empty."""
        return self.kv_groups or [FULL_ATTENTION]


class EngineInfo(Struct, kw_only=True):
    model: str
    device: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kernels: str | None = None  # the C++ CPU kernel variant in use (avx512, avx2, generic) or "torch"
    gemv_dtype: str | None = None  # the weights the CPU GEMV streams at 1-4 rows, where not `dtype`


# ----------------------------------------------------------------------------------- events

class Event(Struct, tag_field="kind", kw_only=True, gc=False):
    """Base of every event. `seq`, `t` and `step` are stamped by the engine's event log.
    gc=False: events hold no cycles, and a client keeps a long history of them."""
    seq: int = 0
    t: float = 0.0
    step: int = 0


class RequestAdded(Event, tag="request_added"):
    request_id: str
    seq_id: str
    prompt_tokens: int
    n: int = 1
    max_tokens: int = DEFAULT_MAX_TOKENS
    # Addition: the prompt's token ids, so a recording's requests can be run again (the lab);
    # omitted by producers that do not send them.
    prompt_token_ids: list[int] | None = None
    # Addition: the text of each prompt token, so a client without the tokenizer can say
    # what a block holds (omitted by producers that do not know it).
    prompt_token_texts: list[str] | None = None


class Fork(Event, tag="fork"):
    request_id: str
    parent_seq_id: str
    seq_id: str
    block_ids: list[int]  # the parent's table of group 0
    block_tables: list[list[int]] = []  # addition (protocol 2): every group's table, with more than one


class Alloc(Event, tag="alloc"):
    seq_id: str
    block_id: int
    logical_index: int
    kv_group: int = 0  # addition (protocol 2): the KV-cache group whose table it is


class PrefixHit(Event, tag="prefix_hit"):
    seq_id: str
    block_id: int
    logical_index: int
    hash: str
    kv_group: int = 0  # addition (protocol 2): the KV-cache group whose table it is


class Cached(Event, tag="cached"):
    block_id: int
    hash: str
    parent_hash: str | None = None
    seq_id: str | None = None  # addition: the sequence whose tokens the block holds
    kv_group: int = 0  # addition (protocol 2): the KV-cache group whose prefix cache holds it


class Evict(Event, tag="evict"):
    block_id: int
    hash: str
    kv_group: int = 0  # addition (protocol 2): the KV-cache group whose prefix cache holds it


class Cow(Event, tag="cow"):
    seq_id: str
    logical_index: int
    src_block_id: int
    dst_block_id: int
    kv_group: int = 0  # addition (protocol 2): the KV-cache group whose table it is


class Free(Event, tag="free"):
    seq_id: str
    block_id: int
    ref_count: int
    kv_group: int = 0  # addition (protocol 2): the KV-cache group whose table it is


class WindowFree(Event, tag="window_free"):
    """Addition (protocol 2): a sliding-window group's block that fell wholly out of the window
    leaves the sequence's table (the entry becomes NULL_BLOCK); `ref_count` is the count after."""
    seq_id: str
    kv_group: int
    logical_index: int
    block_id: int
    ref_count: int


class OffloadStore(Event, tag="offload_store"):
    """Addition (protocol 3): cached device block `block_id` is stored to block `offload_block_id`
    of the host tier (a free one: an `offload_evict` made room first), under its hash."""
    block_id: int
    offload_block_id: int
    hash: str
    kv_group: int = 0


class OffloadLoad(Event, tag="offload_load"):
    """Addition (protocol 3): a prefix lookup missed on the device and found the block in the host
    tier: it is loaded into free device block `block_id`, entry `logical_index` of `seq_id`'s
    table (as an `alloc` does; a `cached` of the same hash follows)."""
    seq_id: str
    offload_block_id: int
    block_id: int
    logical_index: int
    hash: str
    kv_group: int = 0


class OffloadEvict(Event, tag="offload_evict"):
    """Addition (protocol 3): the host tier's least recently used block leaves it (room for a store)."""
    offload_block_id: int
    hash: str
    kv_group: int = 0


class Preempt(Event, tag="preempt"):
    seq_id: str
    mode: PreemptionMode
    reason: PreemptReason | None = None  # addition: why a swap-mode engine recomputed instead


class SwapOut(Event, tag="swap_out"):
    seq_id: str
    # [device_block, host_block] copied: with `shared`, every device block of the swapped
    # sequences' tables once, in the order the tables (in `group` order) first name it
    mapping: list[tuple[int, int]]
    seq_ids: list[str] = []  # addition: the sequences swapped together (a fork group), `seq_id` first
    # addition: [device_block, host_block] for a block whose copy an earlier swap of a sequence
    # sharing it left on the host, still held there: nothing is copied, the host block gains holders
    shared: list[tuple[int, int]] = []

    @property
    def group(self) -> list[str]:
        """Every sequence this swap moves (an event without `seq_ids` moves `seq_id` alone)."""
        return self.seq_ids or [self.seq_id]


class SwapIn(Event, tag="swap_in"):
    seq_id: str
    # [host_block, device_block] copied: with `shared`, every host block of the sequences'
    # host tables once, in the order the tables first name it
    mapping: list[tuple[int, int]]
    seq_ids: list[str] = []  # addition: as in `swap_out`
    # addition: [host_block, device_block] for a host block whose device copy is still held
    # (a sequence sharing it stayed, or came back earlier): nothing is copied, the device block gains holders
    shared: list[tuple[int, int]] = []

    @property
    def group(self) -> list[str]:
        return self.seq_ids or [self.seq_id]


class Append(Event, tag="append"):
    seq_id: str
    num_tokens: int
    token_ids: list[int] = []
    text: str = ""


class StatusChange(Event, tag="status"):
    seq_id: str
    status: Status


class Finish(Event, tag="finish"):
    seq_id: str
    reason: FinishReason


class StepDone(Event, tag="step"):
    num_running: int
    num_waiting: int
    num_swapped: int
    prefill_tokens: int
    decode_tokens: int
    duration_ms: float
    free_blocks: int
    cached_blocks: int


class Reset(Event, tag="reset"):
    config: PoolConfig


AnyEvent = Union[RequestAdded, Fork, Alloc, PrefixHit, Cached, Evict, Cow, Free, WindowFree, Preempt,
                 SwapOut, SwapIn, Append, StatusChange, Finish, StepDone, Reset, OffloadStore, OffloadLoad,
                 OffloadEvict]
EVENT_KINDS: tuple[str, ...] = tuple(t.__struct_config__.tag for t in AnyEvent.__args__)


# ------------------------------------------------------------------------- server messages

class DeviceBlock(Struct, omit_defaults=True):
    id: int
    ref_count: int
    hash: str | None
    num_tokens: int
    kv_group: int = 0  # addition (protocol 2): the group whose table holds it or whose cache keeps it


class OffloadBlock(Struct):
    """Addition (protocol 3): a block the host tier holds, and the content it holds."""
    id: int
    hash: str
    kv_group: int = 0


class HostBlock(Struct):
    id: int
    seq_id: str | None  # a holder (the first in `seqs` order); null when free
    num_tokens: int
    ref_count: int = 0  # addition: the sequences holding it (a fork group swapped together shares it)


class SeqInfo(Struct, kw_only=True):
    seq_id: str
    request_id: str
    status: Status
    block_table: list[int]
    host_table: list[int]
    num_tokens: int
    prompt_tokens: int
    output_tokens: int
    # Additions to the contract, so a client that joins late can still draw a sequence whole.
    max_tokens: int = DEFAULT_MAX_TOKENS
    text: str = ""
    # Addition (protocol 2): every group's tables (`block_table` and `host_table` are group 0's),
    # only when the pool has more than one group.
    block_tables: list[list[int]] = []
    host_tables: list[list[int]] = []


class Hello(Struct, tag_field="type", tag="hello", kw_only=True):
    protocol: int = PROTOCOL_VERSION
    engine: EngineInfo
    config: PoolConfig
    # Additions: a replay of a recording; the engine loop's state when this client connected;
    # which server this is; the commands it carries out (None: every command of the protocol;
    # others answer `unsupported`).
    replay: bool = False
    paused: bool = False
    step_delay_ms: float = 0.0
    server: str = "kvscope"
    supports: list[str] | None = None
    features: list[str] = []  # the optional features this client asked for and was granted
    api_url: str | None = None  # the engine's own HTTP API, where its prompts go (vLLM's OpenAI server)


class LoopState(Struct, tag_field="type", tag="loop", kw_only=True):
    """Feature `loop` (addition): the engine loop's pause and pace, sent to every client that
    asked for it whenever they change, whoever changed them."""
    paused: bool
    step_delay_ms: float
    until: list[str] = []       # a run_until in progress: the kinds it stops at
    stopped_at: int | None = None  # the event a run_until stopped at (the first of its kinds)


class SnapshotColumns(Struct, kw_only=True, omit_defaults=True):
    """A snapshot's pools and tables as packed little-endian arrays (base64 on the wire): the
    `columnar` feature. `block_tables` and `host_tables` are every sequence's tables
    concatenated in `seqs` order (group by group within a sequence), cut by the `*_lengths`
    (one per sequence and group)."""
    ref_count: bytes            # int32 per device block
    num_tokens: bytes           # uint16 per device block (derived, as in `device_blocks`)
    hash_block_ids: bytes       # int32: the device blocks that carry a hash, ascending
    hashes: bytes               # uint64 each: their hashes' 16 hex digits as a number, in that order
    odd_hashes: list[tuple[int, str]] = []  # [block, hash] for any hash not in that form, as given
    host_seq: bytes             # int32 per host block: 1 + index in `seqs` of its holder, 0 = free
    host_num_tokens: bytes      # uint16 per host block
    block_tables: bytes         # int32
    block_table_lengths: bytes  # int32 per sequence and group
    host_tables: bytes          # int32
    host_table_lengths: bytes   # int32 per sequence and group
    kv_group: bytes | None = None  # uint8 per device block, as `device_blocks[i].kv_group` (one group: absent)


class Counters(Struct, kw_only=True, omit_defaults=True):
    """Addition: the server's own tally of the stream at a snapshot's event, folded as a client
    folds it (kvscope_contract/counters.py), counted from event `since` (0: the stream's start;
    else its last `reset`). A client that a resync made skip events takes what they counted
    from here, so its numbers stay those of a client that saw every event."""
    since: int = 0
    looked_up_tokens: int = 0
    hit_tokens: int = 0
    preemptions: int = 0
    recomputes: int = 0
    swap_outs: int = 0
    swap_ins: int = 0
    swapped_out_blocks: int = 0
    swapped_in_blocks: int = 0
    host_loaded_blocks: int = 0
    host_stored_blocks: int = 0
    host_evicted_blocks: int = 0
    requests: int = 0
    first_looked_up_tokens: int = 0
    first_hit_tokens: int = 0
    generated: int = 0
    cows: int = 0
    forks: int = 0
    finished: int = 0
    preempted: list[str] = []  # live sequences preempted at least once (their next admission is not a first)


class Snapshot(Struct, tag_field="type", tag="snapshot", kw_only=True, omit_defaults=True):
    seq: int
    config: PoolConfig
    device_blocks: list[DeviceBlock]
    host_blocks: list[HostBlock]
    seqs: list[SeqInfo]
    # Addition, only to clients that asked for `columnar`: the pools and tables as arrays;
    # `device_blocks`, `host_blocks` and every `block_table` / `host_table` are then empty.
    columns: SnapshotColumns | None = None
    counters: Counters | None = None  # addition: the server's tally at `seq`, where it keeps one
    # Addition (protocol 3): the host tier's blocks that hold content, by id (in either form).
    offload_blocks: list[OffloadBlock] = []


class Events(Struct, tag_field="type", tag="events"):
    events: list[AnyEvent]


class Ack(Struct, tag_field="type", tag="ack", kw_only=True):
    op: str
    id: Any = None
    request_id: str | UnsetType = UNSET
    seq_ids: list[str] | UnsetType = UNSET


class Error(Struct, tag_field="type", tag="error", kw_only=True):
    code: ErrorCode
    message: str
    op: str | None = None
    id: Any = None


ServerMessage = Union[Hello, Snapshot, Events, Ack, Error, LoopState]
FEATURES = ("loop", "columnar")  # optional features a client may ask for (`?features=...`)


# ------------------------------------------------------------------------ client commands

class ChatMessage(Struct, forbid_unknown_fields=True):
    role: Literal["system", "user", "assistant"]
    content: Annotated[str, Meta(max_length=MAX_TEXT_CHARS)]


class Command(Struct, tag_field="op", kw_only=True, forbid_unknown_fields=True):
    id: Any = None


class Submit(Command, tag="submit"):
    prompt: Annotated[str, Meta(min_length=1, max_length=MAX_TEXT_CHARS)] | None = None
    messages: Annotated[list[ChatMessage], Meta(min_length=1, max_length=256)] | None = None
    request_id: Annotated[str, Meta(min_length=1, max_length=128)] | None = None
    max_tokens: Annotated[int, Meta(ge=1, le=4096)] = DEFAULT_MAX_TOKENS
    temperature: Annotated[float, Meta(ge=0, le=100)] = 0.0
    top_p: Annotated[float, Meta(gt=0, le=1)] = 1.0
    n: Annotated[int, Meta(ge=1, le=16)] = 1
    seed: Annotated[int, Meta(ge=0, le=2**63 - 1)] | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of `prompt` (a string) or `messages` (a chat list)")


class Abort(Command, tag="abort"):
    request_id: str


class Pause(Command, tag="pause"):
    pass


class Resume(Command, tag="resume"):
    pass


class StepCmd(Command, tag="step"):
    count: Annotated[int, Meta(ge=1, le=10_000)] = 1


class ResetConfig(Struct, kw_only=True, forbid_unknown_fields=True):
    block_size: BlockSize | UnsetType = UNSET
    num_device_blocks: NumDeviceBlocks | UnsetType = UNSET
    num_host_blocks: NumHostBlocks | UnsetType = UNSET
    enable_prefix_caching: bool | UnsetType = UNSET
    preemption_mode: PreemptionMode | UnsetType = UNSET
    max_num_seqs: MaxNumSeqs | UnsetType = UNSET
    num_offload_blocks: NumHostBlocks | UnsetType = UNSET

    def __post_init__(self) -> None:
        if self.block_size is not UNSET and self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")

    def apply_to(self, config: PoolConfig) -> PoolConfig:
        changes = {f: v for f in self.__struct_fields__ if (v := getattr(self, f)) is not UNSET}
        return msgspec.structs.replace(config, **changes)


class ResetCmd(Command, tag="reset"):
    config: ResetConfig = msgspec.field(default_factory=ResetConfig)


class RunUntil(Command, tag="run_until"):
    """Run steps until one emits an event of `kinds` (then pause), or `max_steps` have run."""
    kinds: Annotated[list[str], Meta(min_length=1, max_length=len(EVENT_KINDS))]
    max_steps: Annotated[int, Meta(ge=1, le=100_000)] = 1000

    def __post_init__(self) -> None:
        if unknown := sorted(set(self.kinds) - set(EVENT_KINDS)):
            raise ValueError(f"unknown event kinds {unknown}; known kinds: {', '.join(EVENT_KINDS)}")


class Pace(Command, tag="pace"):
    step_delay_ms: Annotated[float, Meta(ge=0, le=10_000)]


class SnapshotCmd(Command, tag="snapshot"):
    pass


class ClearPrefixCache(Command, tag="clear_prefix_cache"):
    pass


AnyCommand = Union[Submit, Abort, Pause, Resume, StepCmd, ResetCmd, Pace, SnapshotCmd,
                   ClearPrefixCache, RunUntil]
COMMANDS: dict[str, type[Command]] = {t.__struct_config__.tag: t for t in AnyCommand.__args__}


class CommandError(Exception):
    """A command that cannot be carried out; becomes an `error` message."""

    def __init__(self, code: ErrorCode, message: str, op: str | None = None, id: Any = None):
        super().__init__(message)
        self.code, self.message, self.op, self.id = code, message, op, id

    def to_message(self) -> Error:
        return Error(code=self.code, message=self.message, op=self.op, id=self.id)


def parse_command(frame: str | bytes) -> AnyCommand:
    """Decode and validate one client frame, or raise CommandError with the code to answer."""
    if isinstance(frame, (bytes, bytearray, memoryview)):
        raise CommandError("bad_json", "binary frames are not accepted; send JSON as a text frame")
    try:
        obj = json.loads(frame)  # stdlib: accepts any JSON number (1e400), unlike msgspec
    except (ValueError, RecursionError) as e:
        raise CommandError("bad_json", f"frame is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise CommandError("invalid_argument",
                           f"a command must be a JSON object with an `op`, got {type(obj).__name__}")
    op, cid = obj.get("op"), obj.get("id")
    if not isinstance(op, str):
        raise CommandError("unknown_op", "missing `op`: say what to do, for example "
                           "{\"op\": \"submit\", \"prompt\": \"Hi\"}", None, cid)
    if op not in COMMANDS:
        raise CommandError("unknown_op", f"unknown op {op!r}; known ops: {', '.join(COMMANDS)}",
                           op, cid)
    try:
        return msgspec.convert(obj, COMMANDS[op], strict=True)
    except (msgspec.ValidationError, ValueError) as e:
        raise CommandError("invalid_argument", f"{op}: {e}", op, cid) from None


# ----------------------------------------------------------------------------- encoding

_encoder = msgspec.json.Encoder()
_server_decoder = msgspec.json.Decoder(ServerMessage)
_event_decoder = msgspec.json.Decoder(AnyEvent)


def encode(msg: Struct) -> bytes:
    return _encoder.encode(msg)


def encode_snapshot(snap: Snapshot, piece: int = 8192) -> bytes:
    """`encode(snap)`, built from pieces of at most `piece` list items: encoding a snapshot of a
    million blocks then never holds the GIL for more than a few milliseconds at a time, so the
    server's engine and loop threads go on meanwhile."""
    def items(xs: list) -> bytes:
        return b"[" + b",".join(_encoder.encode(xs[i:i + piece])[1:-1] for i in range(0, len(xs), piece)) + b"]"

    out = [b'{"type":"snapshot","seq":', encode(snap.seq), b',"config":', encode(snap.config),
           b',"device_blocks":', items(snap.device_blocks), b',"host_blocks":', items(snap.host_blocks),
           b',"seqs":', items(snap.seqs)]
    if snap.offload_blocks:
        out += [b',"offload_blocks":', items(snap.offload_blocks)]
    if (c := snap.columns) is not None:
        fields = [b'"%s":%s' % (name.encode(), b'"%s"' % base64.b64encode(v) if isinstance(v, bytes) else encode(v))
                  for name in c.__struct_fields__ if (v := getattr(c, name)) is not None]
        out += [b',"columns":{', b",".join(fields), b"}"]
    if snap.counters is not None:
        out += [b',"counters":', encode(snap.counters)]
    out.append(b"}")
    return b"".join(out)


def decode_server_message(data: str | bytes) -> Hello | Snapshot | Events | Ack | Error | LoopState:
    return _server_decoder.decode(data)


def decode_event(data: str | bytes) -> AnyEvent:
    return _event_decoder.decode(data)
