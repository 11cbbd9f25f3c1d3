"""Why each prefix-cache miss missed: every admission's tokens split into the hit and, token by
token, the reason the rest was not found (docs/misses.md defines each reason).

Folded event by event, like kvscope_contract/counters.py, so the dashboard's "why not more?"
panel, the engine's /metrics, `kvscope-explain`, the lab and the Perfetto export all explain a
miss by the one rule. Content is named by the chain of token ids (kvscope_contract/content.py),
not by the engine's hashes: a sequence's tokens are its `request_added.prompt_token_ids` then
every `append`'s `token_ids`, and a `cached` block holds the tokens of its holder's logical
block. Pure: no I/O, no clock.

At an admission (the first `prefix_hit` or `alloc` of a waiting sequence) the N tokens the
sequence holds are looked up (`PoolState.prefix_lookup`'s rule; with caching off nothing is, and
every token is `caching_off`). Blocks 0..M-1, M = (N - 1) // block_size, can hit; the tokens
from M * block_size on never can (`partial_block`: the last token must be computed). Of the
full blocks the lookup did not find, each block's content at the lookup was:
- cached (so an earlier block of the chain was missing): `evicted`, with the eviction that broke
  the chain (that of the first missed block);
- evicted before the lookup: `evicted`, with its eviction (when, and which sequence's
  allocation took the block; none when the prefix cache was cleared);
- never cached (as far as the explainer remembers, `remember` evictions back): `cold`, but the
  first such block's tokens that a block cached at the lookup shares (same parent, a common
  start) are `diverged`: the prompt parts from cached content inside that block.
In a hybrid pool (KV-cache groups with sliding windows) content counts as cached when every
full-attention group holds it: the blocks past the hit that those groups had are `window` (a
sliding group lacked the run of blocks its window needs to end the hit there), the rest as above.
A re-admission after a recompute preemption is kept apart, all its missed tokens `recomputed`
(vLLM leaves those lookups out of its prefix-cache counters). A sequence whose tokens the
stream did not show (a recording without prompt token ids, a sequence from before the client
attached) has its missed full blocks `unknown`. The reasons add up to the missed tokens exactly.
"""
from __future__ import annotations

import bisect
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field

import numpy as np

from kvscope_contract import protocol as p
from kvscope_contract.content import ROOT, cached_holder, content_id
from kvscope_contract.rebuild import known_prompt
from kvscope_contract.state import PoolState

# every reason, in the order the views stack them; the words say what each means
REASONS: dict[str, str] = {
    "host_tier": "missed on the device but found in the host tier: loaded back (a copy of each block's K/V "
                 "from host memory, not a recompute)",
    "evicted": "cached earlier, evicted before this lookup: a bigger pool would have kept it",
    "cold": "never cached in this pool before: nothing could have hit",
    "diverged": "the prompt shares these tokens with a cached block but parts from it inside the block: "
                "a smaller block size would have hit them",
    "partial_block": "past the last full block, or in the block holding the last token, which must be computed: "
                     "the block-boundary floor",
    "window": "a hybrid model: the full-attention groups had these blocks, but a sliding-window group had lost "
              "the run its window needs to end the hit there, so the common hit was shorter",
    "recomputed": "a re-admission after a recompute preemption (vLLM leaves these lookups out of its counters)",
    "caching_off": "prefix caching is off: nothing is looked up",
    "unknown": "the stream did not show these tokens (a recording without prompt token ids, a sequence from "
               "before this client attached), or the engine missed content cached under another key",
}
# each reason in a few words, as the views name it
LABELS: dict[str, str] = {"host_tier": "hit in the host tier", "evicted": "evicted", "cold": "cold",
                          "diverged": "diverged mid-block",
                          "partial_block": "partial block", "window": "sliding window",
                          "recomputed": "recomputed after preemption", "caching_off": "caching off",
                          "unknown": "unknown"}
assert LABELS.keys() == REASONS.keys()
REMEMBER = 1 << 18  # evicted contents remembered, newest first: older ones count as cold


@dataclass
class Eviction:
    """One cached block evicted: `event`/`step`/`t` of its `evict`, and who took the block."""
    event: int
    step: int
    t: float
    block_id: int
    by_seq: str | None = None      # the sequence whose allocation took the block; None: the cache was cleared
    by_request: str | None = None
    how: str = "clear"             # "alloc", "cow", "swap_in", or "clear" (clear_prefix_cache)


@dataclass(frozen=True)
class Span:
    """Tokens [start, end) of a sequence that missed for one reason."""
    reason: str
    start: int
    end: int
    evictions: tuple[Eviction, ...] = ()  # `evicted`: the evictions of its blocks, in block order

    @property
    def tokens(self) -> int:
        return self.end - self.start


@dataclass
class Admission:
    """One admission of a sequence: the tokens it held, the hit, and every missed token's reason."""
    seq_id: str
    request_id: str
    event: int           # the event number of its first `prefix_hit` or `alloc`
    step: int
    t: float
    tokens: int          # tokens the sequence held (those a lookup covers)
    looked_up: int       # as counted by /metrics and the header: `tokens`, or 0 with caching off
    hit: int = 0         # tokens found in the cache
    loaded: int = 0      # the end of the blocks loaded from the host tier after the hit (0: none)
    readmission: bool = False  # after a recompute preemption
    spans: list[Span] = field(default_factory=list)

    @property
    def missed(self) -> int:
        return self.tokens - self.hit

    def by_reason(self) -> Counter:
        out: Counter = Counter()
        for s in self.spans:
            out[s.reason] += s.tokens
        return out


@dataclass
class MissTotals:
    """Sums over every admission closed so far."""
    admissions: int = 0
    tokens: int = 0          # tokens held at admission (looked up when caching is on)
    looked_up: int = 0       # `EventCounts.looked_up_tokens`
    hit: int = 0             # `EventCounts.hit_tokens`
    first_looked_up: int = 0  # first admissions only: vLLM's prefix_cache_queries
    first_hit: int = 0        # and prefix_cache_hits
    by_reason: Counter = field(default_factory=Counter)

    def add(self, a: Admission) -> None:
        self.admissions += 1
        self.tokens += a.tokens
        self.looked_up += a.looked_up
        self.hit += a.hit
        if not a.readmission:
            self.first_looked_up += a.looked_up
            self.first_hit += a.hit
        for s in a.spans:
            self.by_reason[s.reason] += s.tokens

    @property
    def missed(self) -> int:
        return self.tokens - self.hit


# a block's content at a lookup: ("cached", None), ("evicted", its Eviction) or ("never", None)
_CACHED, _EVICTED, _NEVER = "cached", "evicted", "never"


@dataclass
class _Seq:
    """What the explainer knows of a live sequence's tokens."""
    request_id: str
    tokens: list[int] | None  # None: not shown by the stream
    chain: list[str] = field(default_factory=list)  # content ids of its full blocks, computed so far
    preempted: bool = False   # preempted by recompute since its last admission


@dataclass
class _Open:
    """An admission under way: what the lookup saw, until its `status` (running) closes it."""
    adm: Admission
    seq: _Seq
    statuses: list[tuple[str, Eviction | None]]  # per full block that could hit, at the lookup
    diverged: tuple[int, int]                    # (block, tokens shared) of the first never-cached block


class MissExplainer:
    """Folds events (`observe`, each with the pool just before it) into admissions explained.

    `keep`: the latest admissions kept (`admissions`); 0 keeps none (a server needs only the
    totals), None every one. `remember`: evicted contents remembered for `evicted` (older ones count as cold)."""

    def __init__(self, config: p.PoolConfig, keep: int | None = 100_000, remember: int = REMEMBER):
        self.remember = remember
        self.totals = MissTotals()  # counted from the start, resets included (as /metrics counts)
        self.admissions: deque[Admission] = deque(maxlen=keep)
        self._new_pool(config)

    def _new_pool(self, config: p.PoolConfig) -> None:
        """A pool with nothing in it (the start, a reset): nothing of the old one is remembered."""
        self.config = config
        groups = config.groups
        full = [g for g, grp in enumerate(groups) if grp.kind == "full_attention"]
        # the groups whose blocks make content "cached": every full-attention group (a hit starts
        # there); a pool of sliding windows alone, any group
        self._watched, self._every = (full, True) if full else (list(range(len(groups))), False)
        self._hybrid = len(full) < len(groups)
        self.seqs: dict[str, _Seq] = {}
        self._open: dict[str, _Open] = {}
        self._block_content: dict[int, tuple[int, str]] = {}  # hashed device block -> (its group, its content id)
        self._cached: Counter = Counter()            # content id -> hashed blocks holding it, in any group
        self._in_group: Counter = Counter()          # (group, content id) -> hashed blocks holding it
        # parent id -> its cached children's tokens (big-endian uint32, so bytes sort as token lists), sorted
        self._children: dict[str, list[bytes]] = {}
        self._tokens: dict[str, bytes] = {}          # cached content id -> its tokens, as in `_children`
        self._parent: dict[str, str] = {}            # cached content id -> its parent's
        self._evicted: OrderedDict[str, Eviction] = OrderedDict()  # content id -> its last eviction
        self._pending: dict[int, Eviction] = {}      # block evicted, not yet taken by an allocation

    @classmethod
    def from_state(cls, state: PoolState, **kw) -> MissExplainer:
        """Start at a pool whose history is unknown: its live sequences' tokens are unknown, its
        cached blocks' content too (they can hit, but no miss can be told against them)."""
        x = cls(state.config, **kw)
        for s in state.seqs.values():
            x.seqs[s.seq_id] = _Seq(s.request_id, None)
        return x

    @property
    def block_size(self) -> int:
        return self.config.block_size

    # ------------------------------------------------------------------ folding
    def observe(self, ev: p.AnyEvent, before: PoolState) -> Admission | None:
        """Fold one event in; `before` is the pool just before it. Returns the admission the
        event closed, if it closed one."""
        closed = None
        match ev:
            case p.RequestAdded():
                toks = list(ev.prompt_token_ids) if known_prompt(ev) else None
                self.seqs[ev.seq_id] = _Seq(ev.request_id, toks)
            case p.Fork():
                parent = self.seqs.get(ev.parent_seq_id)
                toks = None if parent is None or parent.tokens is None else list(parent.tokens)
                self.seqs[ev.seq_id] = _Seq(ev.request_id, toks, list(parent.chain) if toks is not None else [])
            case p.Append(token_ids=ids) if ids:
                s = self.seqs.get(ev.seq_id)
                if s is not None and s.tokens is not None:
                    s.tokens.extend(ids)
            case p.PrefixHit() | p.Alloc():
                if ev.seq_id not in self._open:
                    self._admit(ev, before)
                o = self._open.get(ev.seq_id)
                if o is not None and isinstance(ev, p.PrefixHit):
                    o.adm.hit = max(o.adm.hit, (ev.logical_index + 1) * self.block_size)
                if isinstance(ev, p.Alloc):
                    self._taken(ev.block_id, ev, "alloc", ev.seq_id, before)
            case p.OffloadLoad():  # a device miss the host tier served: a block taken, as an alloc takes one
                if ev.seq_id not in self._open:
                    self._admit(ev, before)
                if (o := self._open.get(ev.seq_id)) is not None:
                    o.adm.loaded = max(o.adm.loaded, (ev.logical_index + 1) * self.block_size)
                self._taken(ev.block_id, ev, "alloc", ev.seq_id, before)
            case p.StatusChange():
                closed = self._close(ev.seq_id)
            case p.Cached():
                self._cached_block(ev, before)
            case p.Evict():
                self._evict(ev)
            case p.Cow():
                self._taken(ev.dst_block_id, ev, "cow", ev.seq_id, before)
            case p.SwapIn():
                for _, d in ev.mapping:
                    self._taken(d, ev, "swap_in", ev.seq_id, before)
            case p.Preempt():
                closed = self._close(ev.seq_id)
                s = self.seqs.get(ev.seq_id)
                if s is not None and ev.mode == "recompute":
                    s.preempted = True
            case p.Finish():
                closed = self._close(ev.seq_id)
                self.seqs.pop(ev.seq_id, None)
            case p.Reset():
                for sid in list(self._open):
                    self._close(sid)
                self._new_pool(ev.config)
        return closed

    def _admit(self, ev: p.PrefixHit | p.Alloc, before: PoolState) -> None:
        s = before.seqs.get(ev.seq_id)
        if s is None or s.status != "waiting":
            return
        seq = self.seqs.setdefault(ev.seq_id, _Seq(s.request_id, None))
        n = s.prompt_tokens + s.output_tokens
        caching = self.config.enable_prefix_caching
        adm = Admission(ev.seq_id, s.request_id, ev.seq, ev.step, ev.t, n, n if caching else 0,
                        readmission=seq.preempted or s.output_tokens > 0)  # has sampled: it was admitted before
        seq.preempted = False
        statuses, diverged = [], (0, 0)
        if caching and not adm.readmission and seq.tokens is not None and len(seq.tokens) == n:
            statuses, diverged = self._lookup(seq, (n - 1) // self.block_size)
        self._open[ev.seq_id] = _Open(adm, seq, statuses, diverged)

    def _chain(self, seq: _Seq, blocks: int) -> list[str]:
        """The content ids of the sequence's first `blocks` full blocks."""
        bs, toks, chain = self.block_size, seq.tokens, seq.chain
        while len(chain) < blocks:
            i = len(chain)
            chain.append(content_id(chain[-1] if chain else ROOT, toks[i * bs:(i + 1) * bs]))
        return chain[:blocks]

    def _lookup(self, seq: _Seq, blocks: int) -> tuple[list, tuple[int, int]]:
        """Each of the first `blocks` full blocks' content as the pool has it now, and the
        (block, tokens shared with a cached block) of the first one never cached."""
        statuses, diverged = [], (0, 0)
        for i, cid in enumerate(self._chain(seq, blocks)):
            if self._is_cached(cid):
                statuses.append((_CACHED, None))
            elif (e := self._evicted.get(cid)) is not None:
                statuses.append((_EVICTED, e))
            else:
                if diverged == (0, 0):
                    parent = seq.chain[i - 1] if i else ROOT
                    diverged = (i, self._shared(parent, seq.tokens[i * self.block_size:(i + 1) * self.block_size]))
                statuses.append((_NEVER, None))
        return statuses, diverged

    def _is_cached(self, cid: str) -> bool:
        have = (self._in_group[g, cid] for g in self._watched)
        return all(have) if self._every else any(have)

    def _shared(self, parent: str, tokens: list[int]) -> int:
        """The most leading tokens `tokens` shares with a cached block under `parent`: the
        longest common start is with a neighbour in sorted order."""
        kids, mine = self._children.get(parent), _packed(tokens)
        if not kids:
            return 0
        i = bisect.bisect_left(kids, mine)
        return max(_common(mine, kids[j]) for j in (i - 1, i) if 0 <= j < len(kids))

    def _close(self, seq_id: str) -> Admission | None:
        o = self._open.pop(seq_id, None)
        if o is None:
            return None
        adm, bs = o.adm, self.block_size
        adm.spans = self._spans(o, adm, bs)
        self.totals.add(adm)
        if self.admissions.maxlen != 0:
            self.admissions.append(adm)
        return adm

    def _spans(self, o: _Open, adm: Admission, bs: int) -> list[Span]:
        n, hit = adm.tokens, adm.hit
        if not self.config.enable_prefix_caching:
            return [Span("caching_off", hit, n)] if hit < n else []
        loaded = [Span("host_tier", hit, adm.loaded)] if adm.loaded > hit else []  # right after the device's hit
        hit = max(hit, adm.loaded)
        if adm.readmission:
            return loaded + ([Span("recomputed", hit, n)] if hit < n else [])
        return loaded + self._device_spans(o, n, hit, bs)

    def _device_spans(self, o: _Open, n: int, hit: int, bs: int) -> list[Span]:
        """The reasons of the tokens past `hit` (the device's hit and the host tier's loads)."""
        m = max(hit // bs, (n - 1) // bs)  # full blocks that could hit (a hit past them is counted as it came)
        out: list[Span] = []
        if not o.statuses:
            if hit < m * bs:
                out.append(Span("unknown", hit, m * bs))
        else:
            start = hit // bs
            if self._hybrid:  # the blocks full attention had past the hit: a sliding window lacked its run
                while start < m and o.statuses[start][0] == _CACHED:
                    start += 1
                out.append(Span("window", hit, start * bs))
            first = o.statuses[start] if start < len(o.statuses) else (_NEVER, None)
            for i in range(start, m):
                status, e = o.statuses[i]
                lo, hi = i * bs, (i + 1) * bs
                if status == _CACHED:  # reachable only past the first miss: that miss broke the chain
                    evicted = first[0] == _EVICTED
                    out.append(Span("evicted", lo, hi, (first[1],)) if evicted else Span("unknown", lo, hi))
                elif status == _EVICTED:
                    out.append(Span("evicted", lo, hi, (e,)))
                else:
                    shared = o.diverged[1] if o.diverged[0] == i else 0
                    if shared:
                        out.append(Span("diverged", lo, lo + shared))
                    out.append(Span("cold", lo + shared, hi))
        if max(hit, m * bs) < n:
            out.append(Span("partial_block", max(hit, m * bs), n))
        return _merged(out)

    def _cached_block(self, ev: p.Cached, before: PoolState) -> None:
        self._uncache(ev.block_id)
        seq_id, index = cached_holder(ev, before)
        s = self.seqs.get(seq_id) if seq_id is not None else None
        bs = self.block_size
        if s is None or s.tokens is None or len(s.tokens) < (index + 1) * bs:
            return  # its content is unknown here: it can hit, but no miss is told against it
        chain = self._chain(s, index + 1)
        cid, parent = chain[index], chain[index - 1] if index else ROOT
        self._block_content[ev.block_id] = (ev.kv_group, cid)
        self._in_group[ev.kv_group, cid] += 1
        self._cached[cid] += 1
        if self._cached[cid] == 1:
            self._parent[cid] = parent
            self._tokens[cid] = packed = _packed(s.tokens[index * bs:(index + 1) * bs])
            bisect.insort(self._children.setdefault(parent, []), packed)

    def _uncache(self, b: int) -> tuple[int, str] | None:
        """Block b loses its hash: its group and content id, if known."""
        known = self._block_content.pop(b, None)
        if known is not None:
            g, cid = known
            self._in_group[g, cid] -= 1
            if not self._in_group[g, cid]:
                del self._in_group[g, cid]
            self._cached[cid] -= 1
            if not self._cached[cid]:
                del self._cached[cid]
                parent, packed = self._parent.pop(cid), self._tokens.pop(cid)
                kids = self._children[parent]
                del kids[bisect.bisect_left(kids, packed)]
                if not kids:
                    del self._children[parent]
        return known

    def _evict(self, ev: p.Evict) -> None:
        e = Eviction(ev.seq, ev.step, ev.t, ev.block_id)
        self._pending[ev.block_id] = e
        known = self._uncache(ev.block_id)
        if known is not None and known[0] in self._watched and not self._is_cached(cid := known[1]):
            self._evicted[cid] = e
            self._evicted.move_to_end(cid)
            while len(self._evicted) > self.remember:
                self._evicted.popitem(last=False)

    def _taken(self, b: int, ev: p.Event, how: str, seq_id: str, before: PoolState) -> None:
        """Block b goes to a new owner: if an eviction in this step freed it, that owner's
        allocation evicted it (an eviction no allocation takes at once is a cleared cache)."""
        e = self._pending.pop(b, None)
        if e is not None and e.step == ev.step:
            s = before.seqs.get(seq_id)
            e.by_seq, e.how = seq_id, how
            e.by_request = s.request_id if s is not None else None


def _packed(tokens: list[int]) -> bytes:
    return np.asarray(tokens, ">u4").tobytes()


def _common(a: bytes, b: bytes) -> int:
    """Leading tokens two packed token lists share."""
    n, i = min(len(a), len(b)), 0
    while i < n and a[i] == b[i]:
        i += 1
    return i // 4


def _merged(spans: list[Span]) -> list[Span]:
    """Adjacent spans of one reason as one (an `evicted` one keeps every eviction, once)."""
    out: list[Span] = []
    for s in spans:
        if not s.tokens:
            continue
        if out and out[-1].reason == s.reason and out[-1].end == s.start:
            last = out[-1]
            evictions = last.evictions + tuple(e for e in s.evictions if all(e is not x for x in last.evictions))
            out[-1] = Span(s.reason, last.start, s.end, evictions)
        else:
            out.append(s)
    return out


@dataclass
class ExplainedPool:
    """The reducer and the explainer following one stream: for a script or a view that has no
    pool state of its own (`kvscope-explain`, the dashboard's panel, the Perfetto export)."""
    state: PoolState
    explainer: MissExplainer

    @classmethod
    def from_state(cls, state: PoolState, **kw) -> ExplainedPool:
        return cls(state.clone(), MissExplainer.from_state(state, **kw))

    @classmethod
    def from_snapshot(cls, snap: p.Snapshot, **kw) -> ExplainedPool:
        st = PoolState.from_snapshot(snap)
        return cls(st, MissExplainer.from_state(st, **kw))

    @property
    def last_event(self) -> int:
        return self.state.last_event

    def apply(self, ev: p.AnyEvent) -> Admission | None:
        closed = self.explainer.observe(ev, self.state)
        self.state.apply(ev)
        return closed


# ---------------------------------------------------------------------------------- summaries
def totals_of(admissions) -> MissTotals:
    """The totals over some admissions (those of a time window, say)."""
    t = MissTotals()
    for a in admissions:
        t.add(a)
    return t


@dataclass
class RequestMisses:
    """A request's admissions together (its samples, and its sequences admitted again)."""
    request_id: str
    admissions: list[Admission] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return sum(a.tokens for a in self.admissions)

    @property
    def hit(self) -> int:
        return sum(a.hit for a in self.admissions)

    @property
    def missed(self) -> int:
        return self.tokens - self.hit

    def by_reason(self) -> Counter:
        out: Counter = Counter()
        for a in self.admissions:
            out.update(a.by_reason())
        return out


def by_request(admissions) -> list[RequestMisses]:
    """Every request's admissions, the request that missed the most tokens first."""
    out: dict[str, RequestMisses] = {}
    for a in admissions:
        out.setdefault(a.request_id, RequestMisses(a.request_id)).admissions.append(a)
    return sorted(out.values(), key=lambda r: (-r.missed, r.admissions[0].event))


def evicted_cases(admissions) -> list[tuple[Admission, Span]]:
    """Every run of tokens missed because it was evicted before this reuse, newest first."""
    return [(a, s) for a in reversed(list(admissions)) for s in a.spans if s.reason == "evicted"]


def reason_line(counts: Counter, words: bool = False) -> str:
    """'cold 464, partial_block 15': the reasons in REASONS order, tokens each (`words`: their
    LABELS, 'partial block 15')."""
    return ", ".join(f"{LABELS[r] if words else r} {counts[r]:,}" for r in REASONS if counts.get(r))


def eviction_summary(evictions: tuple[Eviction, ...]) -> str:
    """The evictions of one run of missed blocks in a line: 'block 26 evicted at event 1,358
    (step 134) by load3-8's allocation', or for several, their span and who made them."""
    if not evictions:
        return "evicted"
    by = sorted({e.by_request or e.by_seq for e in evictions if e.by_seq})
    cleared = any(e.by_seq is None for e in evictions)
    who = " and ".join(([f"{', '.join(by)}'s allocation{'s' if len(evictions) > 1 else ''}"] if by else [])
                       + (["clearing the prefix cache"] if cleared else []))
    if len(evictions) == 1:
        e = evictions[0]
        return f"block {e.block_id} evicted at event {e.event:,} (step {e.step}) by {who}"
    first, last = min(evictions, key=lambda e: e.event), max(evictions, key=lambda e: e.event)
    return (f"{len(evictions)} blocks evicted between events {first.event:,} and {last.event:,} "
            f"(steps {first.step}-{last.step}) by {who}")
