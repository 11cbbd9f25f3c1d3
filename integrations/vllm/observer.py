"""Watch vLLM's KV block pool from inside its engine core, as KVScope events.

vLLM v1 keeps its allocator in three objects: the `BlockPool` (blocks, ref counts, the prefix
cache's hash map), one `SingleTypeKVCacheManager` per KV-cache group (each request's block
table in that group, `req_to_blocks`) and the `Scheduler` (requests, admission, preemption,
finishing). `PoolObserver` wraps a handful of their methods on the instances (nothing is copied
or replaced) and turns each change they make into a protocol event, in the order vLLM makes it:

    add_local_computed_blocks  -> prefix_hit   (touch: the request adopts cached blocks)
    allocate_*_blocks          -> alloc        (get_new_blocks; evictions inside come first)
    remove_skipped_blocks      -> window_free  (a sliding window passed a block: null in the table)
    _remove_cached_block_hashes -> evict       (a cached block with no holder loses its hash)
    cache_full_blocks          -> cached       (full blocks enter the prefix cache)
    manager.free               -> free         (tail first, with vLLM's ref count after)
    _preempt_request           -> preempt      (mode recompute: vLLM drops the blocks)
    add_request / schedule / update_from_output / _free_blocks
                               -> request_added, status, append, step, finish

A hybrid model (Gemma 3: five sliding-window groups and one full-attention group) has one
manager per group over the one pool: each hook knows its group, and events carry it
(`kv_group`). vLLM's null block in a table (a sliding window's skipped or passed blocks) is
NULL_BLOCK in the protocol's. A table change reads the request's table in that group back and
emits only the difference, so vLLM's code runs unchanged. A change the protocol cannot express
(a KV connector's deferred free, copy-on-write of a partial hit) marks the stream `diverged`;
the backend then sends every client a fresh snapshot built from vLLM's own structures.
Everything here runs on the engine core's thread, under `lock`, which a snapshot also takes
only to copy what it reads (`capture`; the pool is built from the copy off the lock, `build`).
The observer never hurts vLLM: its hooks run around vLLM's methods, never instead of them, and
the first one that fails puts every wrapped method back and says so once (`on_detach`).
"""
from __future__ import annotations

import logging
import re
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from kvscope_contract import protocol as p
from kvscope_contract.snapshot_codec import hash_columns
from kvscope_contract.state import PoolState, SeqState
from engine.core.events import EventLog
from vllm.v1.request import RequestStatus
from integrations.kv_events.decode import vllm_hash_hex

log = logging.getLogger("kvscope")
VLLM_NULL_BLOCK = 0  # vLLM's BlockPool pops block 0 as a placeholder that is never handed out
NULL = p.NULL_BLOCK  # a table entry with no block: where vLLM's tables hold that null block
_LAYER = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")
_REASONS = {"stop": "stop", "length": "length", "abort": "abort", "error": "error"}


class UnsupportedEngine(RuntimeError):
    """A vLLM configuration this observer cannot show (the message says which)."""


# The methods the observer wraps, by the vLLM class that has them: all are checked before any is
# wrapped. Those in OPTIONAL_HOOKS only catch what the protocol has no words for (a KV
# connector's deferred free, sub-block prefix hits): a vLLM without them cannot do that.
HOOKS = {
    "Scheduler": ("add_request", "finish_requests", "reset_prefix_cache", "schedule", "update_from_output",
                  "_free_request", "_free_blocks", "_preempt_request", "_enqueue_waiting_request",
                  "get_request_counts", "shutdown"),
    "KVCacheManager": ("pop_blocks_for_free",),
    "SingleTypeKVCacheManager": ("add_local_computed_blocks", "allocate_external_computed_blocks",
                                 "allocate_new_blocks", "free", "remove_skipped_blocks"),
    "BlockPool": ("cache_full_blocks", "_remove_cached_block_hashes", "reset_prefix_cache",
                  "cache_partial_block", "move_block_hashes", "get_num_free_blocks"),
}
OPTIONAL_HOOKS = {"pop_blocks_for_free", "cache_partial_block", "move_block_hashes"}
TESTED = "0.27.1 to 0.32.0"  # the vLLM releases the tests ran on (docs/vllm.md, Versions)
SHOWN_KINDS = ("full_attention", "sliding_window")  # the KV-cache group kinds the protocol has


def spec_kind(spec) -> str:
    """vLLM's name for the kind of a KV-cache group's spec ("full_attention", "mamba", ...)."""
    from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind

    return get_kv_cache_spec_kind(spec).value


def check_engine(scheduler) -> None:
    """Raise UnsupportedEngine if this vLLM keeps state the protocol cannot show: a KV
    connector (it saves and loads blocks outside the pool, and frees them later), or a group that
    is not attention (Mamba / linear-attention state, cross-attention, ...)."""
    if (connector := getattr(scheduler, "connector", None)) is not None:
        raise UnsupportedEngine(f"vLLM runs with a KV connector ({type(connector).__name__}), which loads, "
                                "saves and frees blocks outside what the plugin sees; vLLM runs on, unobserved")
    for g, group in enumerate(scheduler.kv_cache_config.kv_cache_groups):
        if (kind := spec_kind(group.kv_cache_spec)) not in SHOWN_KINDS:
            layers = ", ".join(group.layer_names[:3]) + (", ..." if len(group.layer_names) > 3 else "")
            raise UnsupportedEngine(f"KV-cache group {g} of this model holds {kind.replace('_', ' ')} state "
                                    f"({type(group.kv_cache_spec).__name__}, layers {layers}); KVScope shows "
                                    "full-attention and sliding-window blocks only; vLLM runs on, unobserved")


def hooked_objects(scheduler) -> dict[str, Any]:
    """The objects whose methods the observer wraps, by the name of their class in HOOKS."""
    kvm = scheduler.kv_cache_manager
    return {"Scheduler": scheduler, "KVCacheManager": kvm, "BlockPool": kvm.block_pool,
            "SingleTypeKVCacheManager": kvm.coordinator.single_type_managers[0]}


def missing_hooks(objects: dict[str, Any]) -> list[str]:
    """`Class.method` for each required hook that `objects` (instances or their classes, by
    their name in HOOKS) lack: empty when every one is there."""
    return [f"{cls}.{name}" for cls, names in HOOKS.items() for name in names
            if name not in OPTIONAL_HOOKS and not callable(getattr(objects[cls], name, None))]


def check_hooks(objects: dict[str, Any]) -> None:
    """Raise UnsupportedEngine naming every hook this vLLM lacks, before anything is wrapped."""
    if missing := missing_hooks(objects):
        import vllm

        raise UnsupportedEngine(f"vLLM {vllm.__version__} has no {', '.join(missing)}, which the plugin "
                                f"wraps to see its pool (it was tested on vLLM {TESTED}); vLLM runs on, unobserved")


def _block_hash(key: bytes) -> str:
    """vLLM keys a cached block by hash bytes + a 4-byte group id; the hash alone is published."""
    return vllm_hash_hex(key[:-4])


def _key_group(key: bytes) -> int:
    """The KV-cache group in a cached block's key (its last 4 bytes, big-endian)."""
    return int.from_bytes(key[-4:], "big")


def layer_index(name: str, default: int) -> int:
    """The model's layer index in a vLLM layer name (`model.layers.5.self_attn.attn` -> 5)."""
    m = _LAYER.search(name)
    return int(m.group(1)) if m else default


def kv_groups(kv_cache_config) -> list[p.KVGroup]:
    """vLLM's KV-cache groups as the protocol's, in vLLM's order (its group ids); empty for one
    full-attention group, the protocol's default."""
    out = []
    for group in kv_cache_config.kv_cache_groups:
        kind = spec_kind(group.kv_cache_spec)
        window = getattr(group.kv_cache_spec, "sliding_window", None) if kind == "sliding_window" else None
        out.append(p.KVGroup(kind=kind, sliding_window=window,
                             layers=[layer_index(n, i) for i, n in enumerate(group.layer_names)]))
    return [] if len(out) == 1 and out[0].kind == "full_attention" else out


def _finish_reason(request) -> p.FinishReason:
    reason = request.get_finished_reason()
    return _REASONS.get(str(reason).lower(), "stop") if reason is not None else "stop"


class PoolObserver:
    def __init__(self, scheduler, on_batch: Callable[[list[p.Event]], None],
                 on_detach: Callable[[str], None] = lambda why: None):
        kvm = scheduler.kv_cache_manager
        check_engine(scheduler)
        check_hooks(hooked_objects(scheduler))
        self.scheduler, self.kvm, self.pool = scheduler, kvm, kvm.block_pool
        self.managers = list(kvm.coordinator.single_type_managers)  # one per KV-cache group, in group order
        self.on_batch = on_batch  # receives each call's events, in order, under the lock
        self.on_detach = on_detach  # told once, why, when a hook failed and every hook was taken out
        self.detached = False
        self._wrapped: list[tuple[Any, str, Any]] = []  # (object, method name, its original), to put back
        self.lock = threading.Lock()
        self.log = EventLog()
        self.diverged = False
        # what the events said so far, per request and per block: the baseline of each diff
        self.tables: dict[str, list[list[int]]] = {}  # each request's table per group, NULLs included
        self.live_from: dict[str, list[int]] = {}     # per group: its first entry a window has not passed
        self.tokens: dict[str, int] = {}    # tokens in the cache (append.num_tokens)
        self.outputs: dict[str, int] = {}   # sampled tokens sent
        self.running: set[str] = set()
        self.hashes: dict[int, str] = {}    # block -> hash in the prefix cache
        self.hash_group: dict[int, int] = {}  # block -> the group whose prefix cache holds it
        self.prompts: dict[str, list[int]] = {}  # prompt ids of new requests, for the text of their tokens
        self.cached_free = 0                # hashed blocks no request holds (evictable)
        self._step_t0 = time.perf_counter()
        self._install()

    # ------------------------------------------------------------------ hooks
    def _install(self) -> None:
        s, pool = self.scheduler, self.pool
        for name in ("add_request", "finish_requests", "reset_prefix_cache"):
            self._wrap(s, name, None, top=True)
        self._wrap(s, "schedule", self._after_schedule, before=self._before_schedule, top=True)
        self._wrap(s, "update_from_output", self._after_update, top=True)
        self._wrap(s, "_free_request", None, before=lambda req, *a, **k: self._progress(req))
        self._wrap(s, "_free_blocks", lambda req, *a, **k: self._finish(req))
        self._wrap(s, "_preempt_request", lambda req, *a, **k: self._preempt(req))
        for g, m in enumerate(self.managers):
            self._wrap(m, "add_local_computed_blocks", lambda rid, *a, g=g, **k: self._sync(rid, g, hit=True))
            for name in ("allocate_external_computed_blocks", "allocate_new_blocks", "free", "remove_skipped_blocks"):
                self._wrap(m, name, lambda rid, *a, g=g, **k: self._sync(rid, g))
        if hasattr(self.kvm, "pop_blocks_for_free"):
            self._wrap(self.kvm, "pop_blocks_for_free", lambda req, *a, **k: self._diverge(
                f"{req.request_id}'s blocks are freed later (a KV connector's deferred free)"))
        self._wrap(pool, "cache_full_blocks", self._after_cache_full_blocks)
        self._wrap(pool, "_remove_cached_block_hashes", None, around=self._removing_hashes)
        self._wrap(pool, "reset_prefix_cache", None, around=self._resetting_prefix_cache)
        for name in ("cache_partial_block", "move_block_hashes"):  # sub-block hits, copy-on-write
            if hasattr(pool, name):
                self._wrap(pool, name, lambda *a, **k: self._diverge("a partial block entered the prefix cache"))
        # add_request's event: after vLLM queued it (a duplicate or a streaming chunk is not new)
        self._wrap(s, "_enqueue_waiting_request", lambda req: self._added(req))

    def _wrap(self, obj: Any, name: str, after: Callable | None, *, before: Callable | None = None,
              around: Callable | None = None, top: bool = False) -> None:
        """Replace `obj.name` on the instance by a call that runs `before`/`after` hooks (given
        the same arguments), or `around(original, *args)`; `top`: an entry point of a scheduler
        step, run under the lock and followed by a hand-off of its events. vLLM's own method runs
        exactly once and its errors are its own; a hook's failure detaches the observer (`_guard`)."""
        original = getattr(obj, name)
        self._wrapped.append((obj, name, original))

        def hooked(*args, **kwargs):
            if self.detached:
                return original(*args, **kwargs)
            if top:
                with self.lock:
                    try:
                        return _call(args, kwargs)
                    finally:
                        self._guard(self._hand_off)
            return _call(args, kwargs)

        def _call(args, kwargs):
            if around is not None:
                return self._around(around, original, args, kwargs)
            if before is not None:
                self._guard(before, *args, **kwargs)
            out = original(*args, **kwargs)
            if after is not None:
                self._guard(after, *args, **kwargs)
            return out

        setattr(obj, name, hooked)

    def _guard(self, hook: Callable, *args, **kwargs) -> None:
        """Run one of the observer's hooks: its failure never reaches vLLM's step, it detaches."""
        if self.detached:
            return
        try:
            hook(*args, **kwargs)
        except Exception as e:
            self._detach(e)

    def _around(self, around: Callable, original: Callable, args, kwargs):
        """`around(original, ...)`, guarded: vLLM's method runs once whatever the hook does."""
        if self.detached:
            return original(*args, **kwargs)
        ran: list = []  # [None] once vLLM's method was entered, then [None, its result]

        def call(*a, **k):
            ran.append(None)
            out = original(*a, **k)  # its errors are vLLM's own: they propagate
            ran.append(out)
            return out
        try:
            return around(call, *args, **kwargs)
        except Exception as e:
            if len(ran) == 1:  # vLLM's method raised
                raise
            self._detach(e)
            return ran[1] if ran else original(*args, **kwargs)

    def _detach(self, error: Exception) -> None:
        """Put back every method wrapped, drop what was kept, and say so once: vLLM runs on, unobserved."""
        if self.detached:
            return
        self.detached = True
        for obj, name, original in reversed(self._wrapped):
            setattr(obj, name, original)
        self.log.drain()
        self.prompts.clear()
        self.tables.clear()
        why = f"a KVScope hook failed ({type(error).__name__}: {error})"
        log.error("kvscope: %s; the plugin detached from vLLM, which runs on unobserved", why, exc_info=error)
        self.on_detach(why)

    def _emit(self, ev: p.Event) -> None:
        self.log.emit(ev)

    def _hand_off(self) -> None:
        if self.log.pending:
            self.on_batch(self.log.drain())

    def _diverge(self, why: str) -> None:
        if not self.diverged:
            log.warning("kvscope: %s; clients get a fresh snapshot", why)
        self.diverged = True

    # ------------------------------------------------------------------ requests
    def _added(self, req) -> None:
        rid = req.request_id
        if rid in self.tables or req.resumable:
            return
        self.tables[rid] = [[] for _ in self.managers]
        self.live_from[rid] = [0] * len(self.managers)
        self.tokens[rid], self.outputs[rid] = 0, 0
        self.prompts[rid] = req.prompt_token_ids or []
        self._emit(p.RequestAdded(request_id=request_group(rid), seq_id=rid,
                                  prompt_tokens=req.num_prompt_tokens, max_tokens=req.max_tokens,
                                  prompt_token_ids=list(self.prompts[rid])))  # content identity (docs/fleet.md)

    def _processed(self, req) -> int:
        """Tokens whose KV vLLM holds: computed minus those still in flight, as vLLM advances
        `num_computed_tokens` when it schedules them."""
        return max(0, req.num_computed_tokens - req.num_in_flight_tokens)

    def _progress(self, req) -> None:
        """An append for new sampled tokens or a new number of tokens in the cache."""
        rid = req.request_id
        if rid not in self.tables:
            return
        n, sent = self._processed(req), self.outputs[rid]
        out = req.output_token_ids
        new = list(out[sent:]) if len(out) > sent else []
        if new or n != self.tokens[rid]:
            self.tokens[rid], self.outputs[rid] = n, sent + len(new)
            self._emit(p.Append(seq_id=rid, num_tokens=n, token_ids=new))

    def _before_schedule(self, *args, **kwargs) -> None:
        self._step_t0 = time.perf_counter()
        self.log.step += 1

    def _after_schedule(self, *args, **kwargs) -> None:
        for req in self.scheduler.running:
            rid = req.request_id
            if rid not in self.running and rid in self.tables:
                self.running.add(rid)
                self._emit(p.StatusChange(seq_id=rid, status="running"))
            self._progress(req)  # a prefix hit puts tokens in the cache before any compute

    def _after_update(self, scheduler_output, *args, **kwargs) -> None:
        s = self.scheduler
        prefill = decode = 0
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            if (req := s.requests.get(rid)) is not None:
                self._progress(req)
            if n == 1:
                decode += 1
            else:
                prefill += n
        running, waiting = s.get_request_counts()
        self._emit(p.StepDone(
            num_running=running, num_waiting=waiting, num_swapped=0, prefill_tokens=prefill,
            decode_tokens=decode, duration_ms=round((time.perf_counter() - self._step_t0) * 1000, 3),
            free_blocks=self.pool.get_num_free_blocks() - self.cached_free,
            cached_blocks=self.cached_free))

    def _preempt(self, req) -> None:
        rid = req.request_id
        if rid in self.tables:
            self.running.discard(rid)
            self.tokens[rid] = 0
            self._emit(p.Preempt(seq_id=rid, mode="recompute"))

    def _finish(self, req) -> None:
        rid = req.request_id
        if rid not in self.tables:
            return
        if any(b != NULL for table in self.tables[rid] for b in table):
            self._diverge(f"{rid} finished still holding blocks {self.tables[rid]}")
            return
        for d in (self.tables, self.live_from, self.tokens, self.outputs):
            del d[rid]
        self.running.discard(rid)
        self._emit(p.Finish(seq_id=rid, reason=_finish_reason(req)))

    # ------------------------------------------------------------------ block tables
    def _sync(self, rid: str, g: int, hit: bool = False) -> None:
        """Emit the change in `rid`'s table of group `g` since the last sync: entries a sliding
        window passed (vLLM nulls them from the head), appended blocks (prefix hits, with nulls
        where a window skips, or allocations), or the whole table freed, tail first."""
        tables = self.tables.get(rid)
        if tables is None:
            return
        seen = tables[g]
        blocks = self.managers[g].req_to_blocks.get(rid, ())
        n_seen, n_now = len(seen), len(blocks)
        if not n_now:
            return self._free_table(rid, g, seen) if n_seen else None
        if n_now < n_seen:
            return self._diverge(f"{rid}'s block table in group {g} shrank without a free")
        live = self.live_from[rid]
        i = live[g]
        while i < n_seen and blocks[i].is_null:  # a window passed these: vLLM freed them
            b = seen[i]
            seen[i] = NULL
            ref = blocks_ref(self.pool, b)
            if ref == 0 and b in self.hashes:
                self.cached_free += 1
            self._emit(p.WindowFree(seq_id=rid, kv_group=g, logical_index=i, block_id=b, ref_count=ref))
            i += 1
        if n_seen and seen[-1] != NULL and blocks[n_seen - 1].block_id != seen[-1]:
            return self._diverge(f"{rid}'s block table in group {g} changed in place")
        for i in range(n_seen, n_now):
            blk = blocks[i]
            b = blk.block_id
            if blk.is_null:  # a sliding window's hit skips the blocks before what it still sees
                seen.append(NULL)
                continue
            if hit:
                h = self.hashes.get(b)
                if h is None:
                    return self._diverge(f"{rid} hit block {b}, which the events never cached")
                if blk.ref_cnt == 1:
                    self.cached_free -= 1
                self._emit(p.PrefixHit(seq_id=rid, block_id=b, logical_index=i, hash=h, kv_group=g))
            else:
                self._emit(p.Alloc(seq_id=rid, block_id=b, logical_index=i, kv_group=g))
            seen.append(b)
        first = live[g]
        while first < len(seen) and seen[first] == NULL:
            first += 1
        live[g] = first

    def _free_table(self, rid: str, g: int, seen: list[int]) -> None:
        """vLLM freed `rid`'s whole table in group `g`, tail first."""
        for b in reversed(seen):
            if b == NULL:
                continue
            ref = blocks_ref(self.pool, b)
            if ref == 0 and b in self.hashes:
                self.cached_free += 1
            self._emit(p.Free(seq_id=rid, block_id=b, ref_count=ref, kv_group=g))
        seen.clear()
        self.live_from[rid][g] = 0

    # ------------------------------------------------------------------ the prefix cache
    def _after_cache_full_blocks(self, request, blocks, num_cached_blocks, num_full_blocks, block_size=None,
                                 kv_cache_group_id=0, *args, **kwargs) -> None:
        rid = request.request_id
        for i in range(num_cached_blocks, min(num_full_blocks, len(blocks))):
            blk = blocks[i]
            key = blk.block_hash
            if blk.is_null or key is None:
                continue
            h = _block_hash(key)
            if self.hashes.get(blk.block_id) == h:
                continue
            self.hashes[blk.block_id], self.hash_group[blk.block_id] = h, _key_group(key)
            self._emit(p.Cached(block_id=blk.block_id, hash=h, parent_hash=self._parent_hash(request, blocks, i),
                                seq_id=rid if rid in self.tables else None, kv_group=_key_group(key)))

    def _parent_hash(self, request, blocks, i: int) -> str | None:
        """The hash of the block before block i of a request's chain (None for its first): the
        table's block when it has one, else (a sliding window passed it) the request's own hash
        of it, when vLLM hashes by the block size."""
        if not i:
            return None
        prev = blocks[i - 1]
        if not prev.is_null and prev.block_hash is not None:
            return _block_hash(prev.block_hash)
        hashes = request.block_hashes
        same_size = getattr(self.pool, "hash_block_size", None) in (None, self.managers[0].block_size)
        return vllm_hash_hex(hashes[i - 1]) if same_size and len(hashes) >= i else None

    def _removing_hashes(self, original, block, *args, **kwargs):
        b = block.block_id
        h = self.hashes.get(b)
        out = original(block, *args, **kwargs)
        if h is not None and block.block_hash is None:
            del self.hashes[b]
            g = self.hash_group.pop(b, 0)
            if block.ref_cnt == 0:
                self.cached_free -= 1
                self._emit(p.Evict(block_id=b, hash=h, kv_group=g))
            else:  # a held block loses its hash: only a partial block's promotion re-caches it
                self._diverge(f"block {b} lost its hash while held")
        return out

    def _resetting_prefix_cache(self, original, *args, **kwargs):
        ok = original(*args, **kwargs)
        if ok:
            for b, h in sorted(self.hashes.items()):
                self._emit(p.Evict(block_id=b, hash=h, kv_group=self.hash_group.get(b, 0)))
            self.hashes.clear()
            self.hash_group.clear()
            self.cached_free = 0
        return ok

    # ------------------------------------------------------------------ snapshots
    def live_state(self, config: p.PoolConfig) -> PoolState:
        """The pool as vLLM's structures hold it now (call under `lock`), numbered after the
        last event emitted: what a client applying every event must have."""
        return build(config, self.capture())

    def capture(self) -> Captured:
        """A copy of what `live_state` reads of vLLM (call under `lock`): plain lists, so the pool
        is built from it after the lock is let go and vLLM's next step goes on meanwhile."""
        pool, s = self.pool, self.scheduler
        n = len(pool.blocks)
        ref = [0 if blk.is_null else blk.ref_cnt for blk in pool.blocks]
        hashes: list[str | None] = [None] * n
        groups = [0] * n
        for blk in pool.blocks:
            if blk.block_hash is not None and not blk.is_null:
                hashes[blk.block_id], groups[blk.block_id] = _block_hash(blk.block_hash), _key_group(blk.block_hash)
        seqs = [SeqState(rid, request_group(rid), "running" if req.status == RequestStatus.RUNNING else "waiting",
                         [[NULL if blk.is_null else blk.block_id for blk in m.req_to_blocks.get(rid, ())]
                          for m in self.managers], [[] for _ in self.managers], self._processed(req),
                         req.num_prompt_tokens, len(req.output_token_ids), req.max_tokens)
                for rid, req in s.requests.items() if rid in self.tables]
        return Captured(self.log.seq, ref, hashes, groups if len(self.managers) > 1 else None, seqs)

    def rebase(self, state: PoolState) -> None:
        """Take `state` (vLLM's, from `live_state`) as what the clients now hold: after a
        divergence, every client gets it as a snapshot and the diffs start again from it."""
        self.tables = {rid: [list(t) for t in s.block_tables] for rid, s in state.seqs.items()}
        self.live_from = {rid: [next((i for i, b in enumerate(t) if b != NULL), len(t)) for t in tables]
                          for rid, tables in self.tables.items()}
        self.tokens = {rid: s.num_tokens for rid, s in state.seqs.items()}
        self.outputs = {rid: s.output_tokens for rid, s in state.seqs.items()}
        self.running = {rid for rid, s in state.seqs.items() if s.status == "running"}
        self.hashes = {b: state.hash_of(b) for b in np.flatnonzero(state.has_hash).tolist()}
        self.hash_group = {b: int(state.kv_group[b]) for b in self.hashes}
        self.cached_free = sum(1 for b in self.hashes if state.ref_counts[b] == 0)
        self.diverged = False


@dataclass
class Captured:
    """What a snapshot reads of vLLM, copied under the observer's lock."""
    seq: int
    ref: list[int]
    hashes: list[str | None]
    groups: list[int] | None
    seqs: list[SeqState]


def build(config: p.PoolConfig, c: Captured) -> PoolState:
    """The pool a capture describes (off the lock: the numpy work)."""
    return PoolState.build(config, c.seq, c.ref, hash_columns(c.hashes), c.seqs, c.groups)


def blocks_ref(pool, b: int) -> int:
    """vLLM's ref count of block b now."""
    return pool.blocks[b].ref_cnt


def request_group(rid: str) -> str:
    """The request a vLLM engine-core id belongs to: the id its client gave, without what vLLM's
    OpenAI server adds (`cmpl-ID-PROMPT-RANDOM`, `chatcmpl-ID-RANDOM`, `SAMPLE_` for n > 1).

        cmpl-r1-0-1a2b3c4d -> r1      1_chatcmpl-sys1-2-0a1b2c3d -> sys1-2      abc -> abc
    """
    head, sep, tail = rid.partition("_")
    rest = tail if sep and head.isdigit() else rid
    for prefix, cut in (("cmpl-", 2), ("chatcmpl-", 1)):
        if rest.startswith(prefix):
            parts = rest[len(prefix):].rsplit("-", cut)
            if len(parts) == cut + 1 and len(parts[-1]) == 8 and all(x.isdigit() for x in parts[1:-1]):
                return parts[0]
    return rest
