"""What a KV-event stream can show, as plain data: per tier (medium, and locality when remote)
and per KV-cache group, the prefix forest its cached blocks form by parent hash
(kvscope_contract/prefix_forest.py, each node with its token ids and its copies: vLLM does not
de-duplicate, so two physical blocks of one group may cache the same content), stored / removed
/ cleared counts over time, and the frames that could not be read. No block ids, ref counts or
request tables: the stream has none.

A hybrid model (Gemma 3: five sliding-window groups and one full-attention group) stores each
block of a prompt once per group, under the same hash: six physical blocks holding the K/V of
different layers, one prefix, not six copies of it. So copies are counted within a group, and
`forest(tier)` shows each prefix once with the groups that hold it.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

from kvscope_contract.prefix_forest import PrefixForest
from integrations.kv_events.decode import MEDIUM_GPU, Batch, Cleared, Removed, Stored

EVICTED_KEPT = 65_536  # removed blocks remembered (the prompt box's "evicted"), newest kept


@dataclass
class Point:
    """Counts after one batch, for the rates chart."""
    ts: float
    stored: int
    removed: int
    cleared: int
    cached: int


@dataclass(frozen=True)
class GroupSpec:
    """A KV-cache group as its store events describe it (absent from older streams)."""
    kind: str | None = None            # "full_attention", "sliding_window", ... as the server names it
    sliding_window: int | None = None  # tokens, for a sliding-window group

    def label(self) -> str:
        if self.kind is None:
            return "kind not sent"
        words = self.kind.replace("_", " ")
        return f"{words} ({self.sliding_window} tokens)" if self.sliding_window else words


@dataclass(frozen=True)
class Extra:
    """What a block's hash covers beyond its tokens: its K/V differ (LoRA) or are kept apart (cache salt)."""
    lora: str | None = None
    keys: tuple | None = None  # vLLM's extra keys of that block: LoRA name, multimodal ids, cache salt, ...

    def label(self) -> str:
        parts = [f"LoRA {self.lora}"] if self.lora else []
        if self.keys:
            parts += [str(k) for k in self.keys if k != self.lora]
        return ", ".join(parts)


# Each server's medium names, onto the tiers KVScope's own engine has (docs/offload.md): vLLM's
# (GPU; CPU and STORAGE from its OffloadingConnector, CPU_TIERED from older releases), SGLang
# HiCache's (GPU, CPU_TIER1 for host memory, CPU_TIER2 for its storage tier) and LMCache's names.
TIERS = {"GPU": "device", "CPU": "host", "CPU_TIERED": "host", "CPU_PINNED": "host", "CPU_TIER1": "host",
         "LocalCPUBackend": "host", "STORAGE": "storage", "DISK": "storage", "CPU_TIER2": "storage",
         "LocalDiskBackend": "storage"}
# an offloading tier keys its blocks by hash: it holds one block per hash however often a store
# announces it (vLLM re-announces a shared prefix once per chunk), so its count is of hashes
ANNOUNCED = frozenset({"host", "storage"})
TIER_WORDS = {"device": "the device", "host": "the host tier", "storage": "the storage tier"}


def tier_kind(medium: str) -> str | None:
    """The tier a medium names (device, host or storage), or None for a name no server here uses."""
    return TIERS.get(medium.split(" ")[0])


def tier_label(name: str) -> str:
    """How the page names a tier: 'the host tier (CPU)'; an unknown medium by its own name."""
    kind = tier_kind(name)
    return f"{TIER_WORDS[kind]} ({name})" if kind else name


def tier(medium: str, locality: str | None) -> str:
    """Where a block lives: its medium, and `(remote)` for a remote tier of an offloading connector."""
    return medium if locality in (None, "LOCAL") else f"{medium} ({locality.lower()})"


@dataclass
class KVEventsState:
    caches: dict[str, dict[int, PrefixForest]] = field(default_factory=dict)  # tier -> group -> its blocks
    specs: dict[int, GroupSpec] = field(default_factory=dict)  # group -> its spec, as last stored
    extras: dict[str, Extra] = field(default_factory=dict)     # hash -> what it covers beyond tokens
    stored: int = 0
    removed: int = 0
    cleared: int = 0
    removed_unknown: int = 0    # removals of blocks this subscriber never saw stored (it joined late)
    batches: int = 0
    last_seq: int = -1
    missed: int = 0             # batches skipped in the sequence numbers (dropped by ZMQ)
    bad_frames: int = 0         # messages that could not be read, batches that could not be applied
    restarts: int = 0           # times the publisher's batch numbers went back (a restarted server)
    unknown_events: int = 0
    errors: deque[str] = field(default_factory=lambda: deque(maxlen=20))
    points: deque[Point] = field(default_factory=lambda: deque(maxlen=5000))
    # the blocks that left the GPU cache (their last copy), newest last: hash -> (parent hash, token
    # ids, the batch's time), so a prompt can be told which of its blocks were evicted, and when
    evicted: OrderedDict = field(default_factory=OrderedDict)

    def apply(self, batch: Batch) -> None:
        if batch.seq >= 0:
            if self.last_seq >= 0 and batch.seq > self.last_seq + 1:
                self.missed += batch.seq - self.last_seq - 1
            self.last_seq = max(self.last_seq, batch.seq)
        for ev in batch.events:
            match ev:
                case Stored():
                    self._store(ev)
                case Removed():
                    self._remove(ev, batch.ts)
                case Cleared():
                    for name, groups in self.caches.items():
                        if ev.medium is None or name.split(" ")[0] == ev.medium:
                            for forest in groups.values():
                                if name == MEDIUM_GPU:
                                    for node in forest.nodes.values():
                                        self._evicted(node, batch.ts)
                                forest.clear()
                    if ev.medium is None:
                        self.extras.clear()
                    self.cleared += 1
        self.unknown_events += len(batch.unknown)
        self.errors.extend(batch.unknown)
        self.batches += 1
        self.points.append(Point(batch.ts, self.stored, self.removed, self.cleared, self.num_cached()))

    def _store(self, ev: Stored) -> None:
        group = ev.group or 0  # a stream that does not name groups has one
        forest = self.caches.setdefault(tier(ev.medium, ev.locality), {}).setdefault(group, PrefixForest())
        if ev.spec_kind is not None:
            self.specs[group] = GroupSpec(ev.spec_kind, ev.sliding_window)
        parent, size = ev.parent, ev.block_size
        for i, h in enumerate(ev.hashes):
            self.stored += 1  # the clock of the forest: blocks stored so far
            forest.store(h, parent, medium=ev.medium, at=self.stored, tokens=ev.token_ids[i * size:(i + 1) * size])
            keys = ev.extra_keys[i] if ev.extra_keys else None
            if ev.lora or keys:
                self.extras[h] = Extra(ev.lora, keys)
            parent = h

    def _remove(self, ev: Removed, ts: float) -> None:
        name = tier(ev.medium, ev.locality)
        forest = self.caches.get(name, {}).get(ev.group or 0)
        for h in ev.hashes:
            self.removed += 1
            node = forest.nodes.get(h) if forest is not None else None
            if node is not None and node.copies == 1 and name == MEDIUM_GPU:
                self._evicted(node, ts)
            if forest is None or not forest.remove(h):
                self.removed_unknown += 1
            elif h in self.extras and not any(h in f.nodes for g in self.caches.values() for f in g.values()):
                del self.extras[h]

    def _evicted(self, node, ts: float) -> None:
        self.evicted[node.key] = (node.parent, tuple(node.tokens), ts)
        self.evicted.move_to_end(node.key)
        while len(self.evicted) > EVICTED_KEPT:
            self.evicted.popitem(last=False)

    def publisher_restarted(self, last: int, seq: int) -> None:
        """Its numbers went back from `last` to `seq`: a new publisher, whose cache starts empty."""
        self.caches.clear()
        self.specs.clear()
        self.extras.clear()
        self.last_seq = -1
        self.restarts += 1
        self.errors.append(f"the publisher restarted (its batch numbers went back from {last} to {seq}): "
                           "what it had cached before is dropped")

    def bad_frame(self, why: str) -> None:
        self.bad_frames += 1
        self.errors.append(why)

    # ------------------------------------------------------------------ reading
    def tiers(self) -> list[str]:
        return sorted(self.caches)

    def groups(self) -> list[int]:
        """The KV-cache groups seen, in vLLM's order."""
        return sorted({g for groups in self.caches.values() for g in groups} | set(self.specs))

    def num_cached(self) -> int:
        return sum(self.per_medium().values())

    def per_medium(self) -> dict[str, int]:
        """Cached physical blocks per tier, every group's (copies of the same content counted on the
        device; an offloading tier's repeated announcements of a block are one block)."""
        out = {name: sum(len(f.nodes) if tier_kind(name) in ANNOUNCED else f.copies() for f in groups.values())
               for name, groups in self.caches.items()}
        return {name: n for name, n in out.items() if n}

    def per_group(self, name: str) -> dict[int, int]:
        """Cached physical blocks of one tier per KV-cache group."""
        return {g: f.copies() for g, f in sorted(self.caches.get(name, {}).items())}

    def prefixes(self, name: str) -> int:
        """Distinct blocks of content (hashes) cached on a tier, however many groups store each."""
        return len({h for f in self.caches.get(name, {}).values() for h in f.nodes})

    def duplicated(self, name: str) -> int:
        """Physical blocks that repeat content their own group already caches on that tier (a
        block stored by several groups of a hybrid model is not one of them)."""
        return sum(f.copies() - len(f.nodes) for f in self.caches.get(name, {}).values())

    def forest(self, name: str) -> tuple[PrefixForest, dict[str, list[int]]]:
        """A tier's cached content as one forest, each hash once (its `copies`: the most any one
        group holds), and which groups hold each hash."""
        groups = self.caches.get(name, {})
        held: dict[str, list[int]] = {}
        for g, f in sorted(groups.items()):
            for h in f.nodes:
                held.setdefault(h, []).append(g)
        if len(groups) == 1:
            return next(iter(groups.values())), held
        merged = PrefixForest()
        nodes = sorted((n for f in groups.values() for n in f.nodes.values()), key=lambda n: n.stored)
        for n in nodes:
            if (m := merged.nodes.get(n.key)) is None:
                merged.store(n.key, n.parent, medium=n.medium, at=n.stored, tokens=n.tokens).copies = n.copies
            else:
                m.copies = max(m.copies, n.copies)
        return merged, held
