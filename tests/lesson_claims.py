"""What each lesson stop's caption claims, checked against the reducer's state at the stop and
the events that led there (independently of the numbers the caption was filled with, which
are checked against them too). One function per stop, keyed by (lesson, stop index), and one per
lesson for its goal line (GOALS: checked against the lesson's own requests and every stop of the
run); a stop or a lesson without a function fails the test, so a new one cannot go unchecked."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import msgspec

from kvscope_contract import protocol as p
from kvscope_contract.state import PoolState, held_tokens


@dataclass
class AtStop:
    state: PoolState        # the pool at the end of the stop's step (what the views show)
    step: list              # that step's events
    events: list            # every event up to the stop's end, since the lesson last reset the pool
    values: dict[str, str]  # the caption's placeholders, as filled
    blocks: list[int]       # the blocks the stop highlights
    hit: p.Event | None     # the event the run stopped at
    previous: int | None = None  # the end of the stop before (None: the first stop)

    def seqs(self, request_id: str | None = None):
        return [s for s in self.state.seqs.values() if request_id is None or s.request_id == request_id]

    def seq(self):
        return self.state.seqs[self.values["seq"]]

    def of(self, kind) -> list:
        return [e for e in self.step if isinstance(e, kind)]

    def steps_since(self, n: int) -> int:
        return sum(1 for e in self.events if isinstance(e, p.StepDone) and e.seq > n)

    def last_holder(self, block: int, before: int) -> str:
        """The sequence that last took device block `block` before event `before`."""
        for e in reversed([e for e in self.events if e.seq < before]):
            if isinstance(e, (p.Alloc, p.PrefixHit)) and e.block_id == block:
                return e.seq_id
            if isinstance(e, p.Cow) and e.dst_block_id == block:
                return e.seq_id
            if isinstance(e, p.SwapIn) and any(d == block for _, d in e.mapping + e.shared):
                return e.seq_id
        raise AssertionError(f"nobody took block {block} before event {before}")


def num(text: str) -> int:
    return int(text.replace(",", ""))


def full_blocks_but_last(at: AtStop) -> None:
    """Only each sequence's last block is partly filled."""
    bs = at.state.config.block_size
    for s in at.seqs():
        for i, b in enumerate(s.block_table):
            assert held_tokens(s.num_tokens, i, bs) == (bs if i < len(s.block_table) - 1 else s.num_tokens - i * bs)
        assert len(s.block_table) == math.ceil(s.num_tokens / bs) or not s.num_tokens


def slots(at: AtStop) -> None:
    st, v = at.state, at.values
    bs, used = st.config.block_size, st.counts().used
    assert num(v["used"]) == used and num(v["paged_slots"]) == used * bs
    empty = sum(len(s.block_table) * bs - s.num_tokens for s in at.seqs() if s.block_table)
    assert num(v["waste"]) == empty  # no block is shared in these lessons: the empty slots, counted here
    assert num(v["entries"]) == sum(len(s.block_table) for s in at.seqs())
    assert v["slot_util"] == f"{1 - empty / (used * bs):.0%}"


# ---------------------------------------------------------------- 1. block tables
def l1_admission(at: AtStop) -> None:
    """Both prompts admitted; each got ⌈prompt / bs⌉ blocks, nothing more; the blocks allocated in
    this step are the ones highlighted; {table} is {seq}'s table."""
    bs = at.state.config.block_size
    assert [s.status for s in at.seqs()] == ["running", "running"]
    for s in at.seqs():
        assert len(s.block_table) == math.ceil(s.prompt_tokens / bs)
    seq = at.seq()
    assert num(at.values["pblocks"]) == len(seq.block_table) and num(at.values["prompt"]) == seq.prompt_tokens
    assert sorted(at.blocks) == sorted(e.block_id for e in at.of(p.Alloc))
    assert at.values["table"] == "[" + ", ".join(f"{i}→{b}" for i, b in enumerate(seq.block_table)) + "]"


def l1_decode(at: AtStop) -> None:
    """One more token each into the block of its newest token; no block allocated while the last has room."""
    bs = at.state.config.block_size
    assert at.of(p.StepDone) and len(at.of(p.StepDone)) == 1
    for e in at.of(p.Append):
        s = at.state.seqs[e.seq_id]
        assert s.block_table[(s.num_tokens - 1) // bs] in at.blocks
    assert not at.of(p.Alloc)  # neither sequence's last block was full
    seq = at.seq()
    assert num(at.values["tokens"]) == seq.num_tokens
    assert num(at.values["last_fill"]) == held_tokens(seq.num_tokens, len(seq.block_table) - 1, bs) < bs


def l1_next_block(at: AtStop) -> None:
    """{seq}'s last block filled up, so its next token took a new block, one more table entry."""
    bs = at.state.config.block_size
    (alloc,) = [e for e in at.of(p.Alloc) if e.seq_id == at.values["seq"]]
    seq = at.seq()
    assert alloc.logical_index == len(seq.block_table) - 1 and at.blocks == [alloc.block_id]
    assert seq.num_tokens == alloc.logical_index * bs + 1  # its newest token is the first in it


def l1_interleave(at: AtStop) -> None:
    """Both sequences' physical ids interleave."""
    a, b = [s.block_table for s in at.seqs()]
    owner = [0 if x in a else 1 for x in sorted(a + b)]
    assert sum(x != y for x, y in zip(owner, owner[1:])) >= 2, (a, b)
    assert at.steps_since(at.hit.seq if at.hit else 0) >= 0


def l1_finished(at: AtStop) -> None:
    """{what} (the sequences that finished); their blocks went back to the free list: {free} of {total} free."""
    done = [e.seq_id for e in at.of(p.Finish)]
    assert done and all(f"{d}" in at.values["what"] for d in done)
    freed = [e.block_id for e in at.of(p.Free) if e.seq_id in done]
    assert sorted(freed) == sorted(at.blocks)
    assert freed and all(at.state.ref_counts[b] == 0 and not at.state.has_hash[b] for b in freed)
    assert num(at.values["free"]) == at.state.counts().free


# ---------------------------------------------------------------- 2. fragmentation
def l2_block_size(at: AtStop) -> None:
    """After nine steps; only last blocks partly filled (at most bs - 1 empty each); the same memory."""
    st = at.state
    assert at.steps_since(max(e.seq for e in at.events if isinstance(e, p.Reset))) == 9
    assert st.config.block_size * st.config.num_device_blocks == 2048
    full_blocks_but_last(at)
    slots(at)
    assert len(at.seqs()) == 4


def l2_side_by_side(at: AtStop) -> None:
    l2_block_size(at)
    assert at.values["records"].count("\n| block size ") == 3


# ---------------------------------------------------------------- 3. reservation
def reservation(at: AtStop) -> None:
    st, v = at.state, at.values
    holding = [s for s in at.seqs() if s.block_table]
    assert num(v["reserved_slots"]) == sum(s.prompt_tokens + s.max_tokens for s in holding)
    assert num(v["paged_slots"]) == st.counts().used * st.config.block_size < num(v["reserved_slots"])


def l3_admission(at: AtStop) -> None:
    """Paging holds the blocks the prompts fill, nothing more."""
    bs = at.state.config.block_size
    reservation(at)
    for s in at.seqs():
        assert len(s.block_table) == math.ceil(s.prompt_tokens / bs)


def l3_generating(at: AtStop) -> None:
    """24 steps later; {saved_pct} less."""
    reservation(at)
    assert at.steps_since(at.previous) == 24
    v = at.values
    assert v["saved_pct"] == f"{1 - num(v['paged_slots']) / num(v['reserved_slots']):.0%}"


def l3_short(at: AtStop) -> None:
    """{what}: an answer ended; paging took a block only when its tokens filled the one before;
    still running: reserved vs paged."""
    bs = at.state.config.block_size
    (fin,) = at.of(p.Finish)
    added = next(e for e in at.events if isinstance(e, p.RequestAdded) and e.seq_id == fin.seq_id)
    sampled = sum(len(e.token_ids) for e in at.events if isinstance(e, p.Append) and e.seq_id == fin.seq_id)
    taken = [e for e in at.events if isinstance(e, p.Alloc) and e.seq_id == fin.seq_id]
    assert len(taken) == math.ceil((added.prompt_tokens + sampled - 1) / bs)  # the tokens it filled
    prompt_blocks = math.ceil(added.prompt_tokens / bs)
    assert len({e.step for e in taken[prompt_blocks:]}) == len(taken) - prompt_blocks
    assert fin.seq_id in at.values["what"]
    allowed = next(e for e in at.events if isinstance(e, p.RequestAdded) and e.request_id == added.request_id)
    if sampled < allowed.max_tokens:  # what {ended} says: stopped early, the slots it never touched
        assert at.values["ended"].startswith(f"{fin.seq_id} stopped after {sampled:,} token")
        assert f"{allowed.max_tokens - sampled:,} reserved slot" in at.values["ended"]
    else:
        assert at.values["ended"].startswith(f"{fin.seq_id} ran to its max of {allowed.max_tokens:,} token")
    assert [s.status for s in at.seqs("q3")] == ["running"]  # still running: the numbers below are not 0
    reservation(at)


# ---------------------------------------------------------------- 4. prefix caching
def l4_chained(at: AtStop) -> None:
    """A's full blocks registered under chained hashes; the last one's parent is the block before it."""
    (a,) = at.seqs("A")
    cached = at.of(p.Cached)
    assert [e.block_id for e in cached] == a.block_table[:len(cached)] == at.blocks
    for prev, e in zip([None] + cached, cached):
        assert e.parent_hash == (prev.hash if prev else None)
    assert at.values["hash"] == cached[-1].hash and at.state.hash_of(cached[-1].block_id) == cached[-1].hash


def l4_prefix_hit(at: AtStop) -> None:
    """B found A's blocks by their hashes ({hits} of {pblocks}), never the block of its last prompt token."""
    bs = at.state.config.block_size
    (a,), (b,) = at.seqs("A"), at.seqs("B")
    hits = [e for e in at.of(p.PrefixHit) if e.seq_id == "B"]
    assert hits and num(at.values["hits"]) == len(hits)
    assert [e.block_id for e in hits] == a.block_table[:len(hits)] == b.block_table[:len(hits)]
    assert len(hits) * bs < b.prompt_tokens and len(hits) < num(at.values["pblocks"])
    assert len(hits) <= (b.prompt_tokens - 1) // bs


def _shared_beginning(at: AtStop) -> list[p.PrefixHit]:
    return [e for e in at.events if isinstance(e, p.PrefixHit) and e.seq_id == "B"]


def l4_finished(at: AtStop) -> None:
    """A and B finished; their hashed blocks stay cached with no holder ({cached}); freed tail first,
    the shared beginning last to lose its last holder."""
    assert not at.seqs("A") and not at.seqs("B")
    st = at.state
    assert num(at.values["cached"]) == st.counts().cached > 0 and num(at.values["free"]) == st.counts().free
    shared = {e.block_id for e in _shared_beginning(at)}
    assert all(st.has_hash[b] and st.ref_counts[b] == 0 for b in shared)
    last_holder_lost = [e.block_id for e in at.events if isinstance(e, p.Free) and e.ref_count == 0
                        and e.seq_id in ("A", "B")]
    assert set(last_holder_lost[-len(shared):]) == shared  # last in line
    for seq_id in ("A", "B"):  # tail first
        mine = [e for e in at.events if isinstance(e, p.Free) and e.seq_id == seq_id]
        indices = [i for i, _ in enumerate(mine)]
        assert indices == sorted(indices)
        first = next(e for e in at.events if isinstance(e, p.Finish) and e.seq_id == seq_id)
        assert all(e.seq < first.seq for e in mine)


def l4_eviction(at: AtStop) -> None:
    """Evicted in the order they lost their last holder: A's and B's own cached blocks first, then
    the end of the chain they share; its beginning still cached; no held block evicted."""
    st = at.state
    evicted = [e.block_id for e in at.of(p.Evict)]
    assert evicted and sorted(at.blocks) == sorted(evicted)
    assert {at.last_holder(b, at.hit.seq) for b in evicted} <= {"A", "B"}
    first = min(e.seq for e in at.events if isinstance(e, p.Evict))
    lru = [e.block_id for e in at.events if isinstance(e, p.Free) and e.ref_count == 0 and e.seq < first
           and e.seq_id in ("A", "B") and any(isinstance(c, p.Cached) and c.block_id == e.block_id
                                              and c.seq < e.seq for c in at.events)]
    assert evicted == lru[:len(evicted)]  # least recently used first
    shared = [e.block_id for e in _shared_beginning(at)]
    own = [b for b in lru if b not in shared]
    assert set(own) <= set(evicted) and set(evicted) & set(shared)  # own blocks, then the chain's end
    assert evicted[len(own):] == shared[::-1][:len(evicted) - len(own)]  # from its tail
    head = _shared_beginning(at)[0]
    assert st.hash_of(head.block_id) == head.hash and st.ref_counts[head.block_id] == 0  # still cached
    assert not at.seqs("A") and not at.seqs("B")


def l4_why(at: AtStop) -> None:
    """C asks B's question again: each of its full blocks it did not find had been cached (B took
    it) and was evicted before C's admission; its last block is partial; {why_seq} says so, and
    {why} adds up to the tokens looked up less those hit."""
    bs, ev = at.state.config.block_size, at.events
    added = {e.request_id: e for e in ev if isinstance(e, p.RequestAdded)}
    assert added["C"].prompt_token_ids == added["B"].prompt_token_ids
    n = added["C"].prompt_tokens
    admitted = min(e.seq for e in ev if isinstance(e, (p.PrefixHit, p.Alloc)) and e.seq_id == "C")
    hit = len([e for e in ev if isinstance(e, p.PrefixHit) and e.seq_id == "C"])
    last_full = (n - 1) // bs
    assert hit < last_full, (hit, last_full, at.values["why_seq"])
    b_blocks = {e.logical_index: e.block_id for e in ev if isinstance(e, (p.Alloc, p.PrefixHit)) and e.seq_id == "B"}
    for i in range(hit, last_full):  # B's block i: cached, then evicted before C came
        cached = [e.seq for e in ev if isinstance(e, p.Cached) and e.block_id == b_blocks[i]]
        assert cached and any(isinstance(e, p.Evict) and e.block_id == b_blocks[i] and cached[0] < e.seq < admitted
                              for e in ev), i
    evicted, partial = (last_full - hit) * bs, n - last_full * bs
    assert at.values["why_seq"] == (f"{hit * bs:,} of its {n:,} tokens hit; evicted {evicted:,}, "
                                    f"partial block {partial:,} missed")
    missed = sum(num(x) for x in re.findall(r"[a-z ]+ ([\d,]+)", at.values["why"]))
    assert missed == num(at.values["looked_up"]) - num(at.values["hit_tokens"]) > evicted
    assert not at.seqs("C")


# ---------------------------------------------------------------- 5. copy-on-write
def l5_fork(at: AtStop) -> None:
    """The prompt computed once; every block shared by the four; the last holds {last_fill} < bs."""
    bs = at.state.config.block_size
    seqs = at.seqs("P")
    assert len(seqs) == 4 and len({tuple(s.block_table) for s in seqs}) == 1
    table = seqs[0].block_table
    assert all(at.state.ref_counts[b] == 4 for b in table)
    (step,) = at.of(p.StepDone)
    assert step.prefill_tokens == seqs[0].prompt_tokens  # computed once
    assert num(at.values["last_fill"]) == held_tokens(seqs[0].num_tokens, len(table) - 1, bs) < bs


def l5_cow(at: AtStop) -> None:
    """The first writers copy the shared last block ({cows} in this step); the last keeps the original."""
    cows = at.of(p.Cow)
    assert len(cows) == 3 and num(at.values["cows"]) == len(cows)
    src = {e.src_block_id for e in cows}
    assert len(src) == 1 and at.state.ref_counts[next(iter(src))] == 1
    keeper = [s for s in at.seqs("P") if next(iter(src)) in s.block_table]
    assert len(keeper) == 1 and keeper[0].seq_id not in {e.seq_id for e in cows}


def l5_still_shared(at: AtStop) -> None:
    """Twelve steps later {shared} blocks still shared: the prompt's full blocks; {cows} copies in all."""
    bs = at.state.config.block_size
    seqs = at.seqs("P")
    full = seqs[0].prompt_tokens // bs
    assert num(at.values["shared"]) == at.state.counts().shared == full
    assert all(s.block_table[:full] == seqs[0].block_table[:full] for s in seqs)
    assert num(at.values["cows"]) == sum(isinstance(e, p.Cow) for e in at.events) == 3


# ---------------------------------------------------------------- 6. preemption
def l6_swapped(at: AtStop) -> None:
    """The newest sequence gave way by swap: its blocks {blocks} copied to the host, {moved} of them."""
    (pre,) = at.of(p.Preempt)
    (out,) = at.of(p.SwapOut)
    assert pre.mode == "swap" and out.group == [pre.seq_id] == ["s3"]  # the latest arrival
    assert at.blocks == [d for d, _ in out.mapping] and num(at.values["moved"]) == len(out.mapping)
    s = at.state.seqs[pre.seq_id]
    assert s.status == "swapped" and not s.block_table and len(s.host_table) == len(out.mapping)
    assert num(at.values["total"]) == at.state.config.num_device_blocks


def l6_back(at: AtStop) -> None:
    """Back in with nothing computed again, {moved} copies each way."""
    (inn,) = at.of(p.SwapIn)
    out = [e for e in at.events if isinstance(e, p.SwapOut) and e.seq_id == inn.seq_id][-1]
    assert num(at.values["moved"]) == len(inn.mapping) == len(out.mapping)
    s = at.state.seqs[inn.seq_id]
    assert s.status == "running" and s.num_tokens >= len(out.mapping) and not s.host_table
    assert not any(isinstance(e, p.Preempt) and e.mode == "recompute" for e in at.events)


def l6_recompute(at: AtStop) -> None:
    """{seq} had {lost} tokens; its blocks {blocks} freed; computed again later."""
    (pre,) = at.of(p.Preempt)
    assert pre.mode == "recompute" and at.values["seq"] == pre.seq_id
    s = at.state.seqs[pre.seq_id]
    assert s.status == "waiting" and not s.block_table and s.num_tokens == 0
    freed = [e.block_id for e in at.of(p.Free) if e.seq_id == pre.seq_id]
    assert sorted(freed) == sorted(at.blocks)
    lost = num(at.values["lost"])
    assert lost > 0 and len(freed) == math.ceil(lost / at.state.config.block_size)


# ---------------------------------------------------------------- 7. offloading
@dataclass
class Rerun:
    """What one run of the offloading lesson did before A2's admission: A's and A2's requests (the
    same prompt), where A2's admission starts (its first hit, load or allocation), the blocks the
    device evicted before it (A's, as (A's logical index, event)) and A's cached chain."""
    a: p.RequestAdded
    a2: p.RequestAdded
    admission: int
    evicted: list[tuple[int, p.Evict]]
    chain: list[p.Cached]


def _rerun(at: AtStop) -> Rerun:
    ev, bs = at.events, at.state.config.block_size
    added = {e.request_id: e for e in ev if isinstance(e, p.RequestAdded)}
    a, a2 = added["A"], added["A2"]
    assert a.prompt_token_ids == a2.prompt_token_ids and len(added) == 4
    admission = min(e.seq for e in ev if isinstance(e, (p.PrefixHit, p.OffloadLoad, p.Alloc)) and e.seq_id == a2.seq_id)
    table = {e.logical_index: e.block_id for e in ev if isinstance(e, p.Alloc) and e.seq_id == a.seq_id}
    index = {b: i for i, b in table.items()}
    fin = next(e.seq for e in ev if isinstance(e, p.Finish) and e.seq_id == a.seq_id)
    chain = [e for e in ev if isinstance(e, p.Cached) and e.seq_id == a.seq_id and e.seq < fin]
    assert [e.block_id for e in chain] == [table[i] for i in range(len(chain))]  # A's full blocks, in order
    assert len(chain) >= (a.prompt_tokens - 1) // bs
    evicted = []
    for e in [e for e in ev if isinstance(e, p.Evict) and e.seq < admission]:
        assert at.last_holder(e.block_id, e.seq) == a.seq_id  # only A's blocks: the fillers fit beside the rest
        taker = next(x for x in ev if isinstance(x, (p.Alloc, p.PrefixHit)) and x.seq > e.seq
                     and x.block_id == e.block_id)
        assert isinstance(taker, p.Alloc) and taker.seq_id in ("F1", "F2"), taker  # a filler's allocation evicted it
        evicted.append((index[e.block_id], e))
    return Rerun(a, a2, admission, evicted, chain)


def _device_hits(at: AtStop, r: Rerun) -> int:
    """A2's hits on the device, A's chain from its beginning; the step's only prompt is A2's."""
    hits = [e for e in at.events if isinstance(e, p.PrefixHit)]
    assert {e.seq_id for e in hits} <= {r.a2.seq_id}  # the only hits since the reset: A2's, in this step
    assert [e.logical_index for e in hits] == list(range(len(hits)))
    assert [e.block_id for e in hits] == [c.block_id for c in r.chain[:len(hits)]]
    assert num(at.values["hits"]) == len(hits) > 0
    assert num(at.values["hit_tokens"]) == len(hits) * at.state.config.block_size
    return len(hits)


def _tail_of_the_chain(r: Rerun, hits: int, bs: int) -> None:
    """The device evicted A's chain from its end (least recently used first: A freed its blocks tail
    first), down to the beginning it kept: the blocks A2's lookup could hit and did not."""
    indices = [i for i, _ in r.evicted]
    assert indices == sorted(indices, reverse=True) and indices
    assert sorted(indices) == list(range(hits, (r.a2.prompt_tokens - 1) // bs))


def _one_at_a_time(at: AtStop) -> None:
    assert at.state.config.max_num_seqs == 1 and all(e.num_running <= 1 for e in at.events if isinstance(e, p.StepDone))


def _prefill(at: AtStop, computed: int) -> None:
    (step,) = at.of(p.StepDone)
    assert step.num_running == 1 and num(at.values["prefill"]) == step.prefill_tokens == computed


def l7_no_tier(at: AtStop) -> None:
    """No host tier; {total} blocks of {bs}, one request at a time; A finished with its full blocks cached;
    the fillers' allocations evicted A's cached blocks from the end of its chain, least recently used first;
    {what}: A2 admitted, A's prompt again, {prompt} tokens in {pblocks} blocks; {hits} from the device's cache,
    the beginning of A's chain; the rest computed again ({why_seq}): {prefill} prompt tokens in this step."""
    v, cfg = at.values, at.state.config
    bs = cfg.block_size
    assert cfg.num_offload_blocks == 0 and cfg.enable_prefix_caching and cfg.preemption_mode == "recompute"
    assert num(v["total"]) == cfg.num_device_blocks and num(v["bs"]) == bs
    _one_at_a_time(at)
    r = _rerun(at)
    assert not [e for e in at.events if isinstance(e, (p.OffloadStore, p.OffloadLoad))]
    (seq,) = at.seqs("A2")
    assert seq.status == "running" and v["seq"] == seq.seq_id and v["what"].startswith(f"{seq.seq_id} admitted")
    n = r.a2.prompt_tokens
    assert num(v["prompt"]) == n and num(v["pblocks"]) == math.ceil(n / bs)
    hits = _device_hits(at, r)
    _tail_of_the_chain(r, hits, bs)
    last_full = (n - 1) // bs
    evicted, partial = (last_full - hits) * bs, n - last_full * bs
    assert v["why_seq"] == (f"{hits * bs:,} of its {n:,} tokens hit; evicted {evicted:,}, "
                            f"partial block {partial:,} missed")
    _prefill(at, n - hits * bs)


def _records(at: AtStop) -> dict[str, list[str]]:
    """{records}' rows: name -> cells."""
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in at.values["records"].splitlines()[2:]]
    return {row[0]: row[1:] for row in rows}


def l7_loaded(at: AtStop) -> None:
    """A host tier of 64; every full block a step computed (A's, the fillers') stored to it as it completed;
    A2 found {hits} blocks on the device; the host tier held the blocks the device had evicted, {host_loads}
    loaded into {blocks} (highlighted); {prefill} computed; side by side, the device's hits and hit rate
    ({hit_rate}) the same both times, the extra hits all the host tier's; `Why not more?` counts them as
    hit in the host tier."""
    st, v, cfg = at.state, at.values, at.state.config
    bs = cfg.block_size
    assert cfg.num_offload_blocks == 64 and cfg.enable_prefix_caching and cfg.preemption_mode == "recompute"
    _one_at_a_time(at)
    r = _rerun(at)
    loads = [e for e in at.events if isinstance(e, p.OffloadLoad)]
    assert loads and loads == at.of(p.OffloadLoad) and {e.seq_id for e in loads} == {r.a2.seq_id}
    stores = [e for e in at.events if isinstance(e, p.OffloadStore) and e.seq < r.admission]
    computed = [e for e in at.events if isinstance(e, p.Cached) and e.seq < r.admission]
    assert [(e.block_id, e.hash, e.step) for e in stores] == [(e.block_id, e.hash, e.step) for e in computed]
    assert not [e for e in at.events if isinstance(e, p.OffloadEvict)]
    hits = _device_hits(at, r)
    _tail_of_the_chain(r, hits, bs)
    assert [e.logical_index for e in loads] == list(range(hits, hits + len(loads)))
    assert [e.hash for e in loads] == [e.hash for _, e in sorted(r.evicted, key=lambda x: x[0])]  # the ones evicted
    assert all(st.offload_hash_of(e.offload_block_id) == e.hash for e in loads)
    assert sorted(at.blocks) == sorted(e.block_id for e in loads) and num(v["host_loads"]) == len(loads)
    n = r.a2.prompt_tokens
    _prefill(at, n - (hits + len(loads)) * bs)
    rows = _records(at)
    assert list(rows) == ["no host tier", "host tier of 64"]
    (hit0, loads0, prefill0, rate0), (hit1, loads1, prefill1, rate1) = rows.values()
    assert hit0 == hit1 == v["hit_tokens"] and rate0 == rate1 == v["hit_rate"]  # the device's, the same both times
    assert num(loads0) == 0 and num(loads1) == len(loads) and num(prefill0) - num(prefill1) == len(loads) * bs
    assert f"hit in the host tier {len(loads) * bs:,}" in v["why_seq"]


def l7_cost(at: AtStop) -> None:
    """{what}: A2 finished; its {host_loads} loads, each a copy of {bytes_per_block} bytes ({kib_per_block} KiB)
    for {model}, in place of computing {bs} tokens through {layers} layers; the host tier still holds every
    block it loaded, and the device caches them again ({cached} cached blocks)."""
    st, v, cfg = at.state, at.values, at.state.config
    (fin,) = at.of(p.Finish)
    assert not at.seqs("A2") and v["what"].startswith(f"{fin.seq_id} finished") and fin.seq_id == v["seq"]
    loads = [e for e in at.events if isinstance(e, p.OffloadLoad)]
    assert loads and {e.seq_id for e in loads} == {fin.seq_id} and num(v["host_loads"]) == len(loads)
    l8_bytes(at)
    assert v["kib_per_block"] == f"{cfg.bytes_per_block / 1024:,.1f}" and num(v["bs"]) == cfg.block_size
    for e in loads:
        assert st.offload_hash_of(e.offload_block_id) == e.hash  # copied, not moved
        assert st.hash_of(e.block_id) == e.hash and st.ref_counts[e.block_id] == 0  # cached on the device again
    assert num(v["cached"]) == st.counts().cached


# ---------------------------------------------------------------- 8. sizing
def l8_bytes(at: AtStop) -> None:
    """bytes per block = bs x layers x KV heads x head dim x 2 x dtype bytes, the pool's own number."""
    v, cfg = at.values, at.state.config
    product = cfg.block_size * num(v["layers"]) * num(v["kv_heads"]) * num(v["head_dim"]) * 2 * num(v["dtype_bytes"])
    assert num(v["bytes_per_block"]) == product == cfg.bytes_per_block
    assert num(v["blocks_per_gib"]) == (1 << 30) // product
    assert num(v["tokens_per_gib"]) == (1 << 30) // product * cfg.block_size


# ---------------------------------------------------------------- 9. sliding windows and hybrid models
def _groups(at: AtStop) -> tuple[list[int], list[int]]:
    """The pool's sliding-window and full-attention groups: the lesson's goal says it has both."""
    groups = at.state.config.groups
    sliding = [g for g, x in enumerate(groups) if x.window is not None]
    full = [g for g, x in enumerate(groups) if x.window is None]
    assert sliding and full, "a hybrid pool: sliding-window and full-attention groups"
    return sliding, full


def _window(at: AtStop) -> int:
    sliding, _ = _groups(at)
    return at.state.config.groups[sliding[0]].window


def l9_tables(at: AtStop) -> None:
    """A admitted: its prompt takes ⌈prompt / bs⌉ blocks in each of its {ngroups} tables ({used} in all,
    those highlighted); {ngroups} groups of {group_layers} layers of the model's {layers}; bytes per block
    = bs × group_layers × KV heads × head dim × 2 × dtype bytes, the pool's own number."""
    sliding, full = _groups(at)
    st, v, cfg = at.state, at.values, at.state.config
    (a,) = at.seqs("A")
    assert a.status == "running" and v["seq"] == "A" and num(v["prompt"]) == a.prompt_tokens
    need = math.ceil(a.prompt_tokens / cfg.block_size)
    assert num(v["pblocks"]) == need and all(t == [b for b in t if b != p.NULL_BLOCK] for t in a.block_tables)
    assert [len(t) for t in a.block_tables] == [need] * len(cfg.groups) and num(v["ngroups"]) == len(cfg.groups)
    held = [b for t in a.block_tables for b in t]
    assert num(v["used"]) == st.counts().used == len(held) == len(set(held)) and sorted(at.blocks) == sorted(held)
    assert num(v["group_layers"]) == len(cfg.groups[0].layers) and all(len(g.layers) == len(cfg.groups[0].layers)
                                                                       for g in cfg.groups)
    assert sorted(x for g in cfg.groups for x in g.layers) == list(range(num(v["layers"])))
    product = cfg.block_size * num(v["group_layers"]) * num(v["kv_heads"]) * num(v["head_dim"]) * 2 \
        * num(v["dtype_bytes"])
    assert num(v["bytes_per_block"]) == product == cfg.bytes_per_block
    assert num(v["window"]) == _window(at)


def l9_window(at: AtStop) -> None:
    """{freed} blocks left A's sliding-window tables (and only those) in this step, each wholly before the
    last {window} tokens; their entries are empty now; the blocks keep their hashes (cached, no holder);
    the full-attention table keeps every block."""
    sliding, full = _groups(at)
    st, v, bs, w = at.state, at.values, at.state.config.block_size, _window(at)
    (a,) = at.seqs("A")
    freed = at.of(p.WindowFree)
    assert freed and num(v["freed"]) == len(freed) and sorted(at.blocks) == sorted(e.block_id for e in freed)
    assert {e.seq_id for e in freed} == {"A"} and {e.kv_group for e in freed} == set(sliding)
    assert num(v["tokens"]) == a.num_tokens
    for e in freed:
        assert a.block_tables[e.kv_group][e.logical_index] == p.NULL_BLOCK
        assert (e.logical_index + 1) * bs <= a.num_tokens - w + 1  # wholly before the window of the next token
        assert st.has_hash[e.block_id] and st.ref_counts[e.block_id] == 0
    (f,) = full
    assert p.NULL_BLOCK not in a.block_tables[f] and num(v["full_table"]) == len(a.block_tables[f])
    assert len(a.block_tables[f]) == math.ceil(a.num_tokens / bs) or len(a.block_tables[f]) == math.ceil(
        (a.num_tokens + 1) / bs)


def l9_saved(at: AtStop) -> None:
    """A's full-attention table: {full_table} blocks; each sliding table holds {sliding_held}, no more than
    its window reads; full attention everywhere = groups × the full group's blocks; the pool holds {used};
    the windows save the difference, in blocks, MiB and share."""
    sliding, (f,) = _groups(at)
    st, v, cfg, w = at.state, at.values, at.state.config, _window(at)
    (a,) = at.seqs("A")
    assert v["seq"] == "A" and num(v["tokens"]) == a.num_tokens and num(v["full_table"]) == len(a.block_tables[f])
    for g in sliding:
        held = [b for b in a.block_tables[g] if b != p.NULL_BLOCK]
        assert len(held) == num(v["sliding_held"]) <= math.ceil(w / cfg.block_size) + 1
    full_used = len({b for s in at.seqs() for b in s.block_tables[f]})
    everywhere, used = len(cfg.groups) * full_used, st.counts().used
    assert num(v["full_everywhere"]) == everywhere and num(v["used"]) == used
    assert num(v["window_saved"]) == everywhere - used > 0
    assert v["window_saved_mib"] == f"{(everywhere - used) * cfg.bytes_per_block / 2**20:,.2f} MiB"
    assert v["full_everywhere_mib"] == f"{everywhere * cfg.bytes_per_block / 2**20:,.2f} MiB"
    assert v["window_saved_pct"] == f"{(everywhere - used) / everywhere:.0%}"


def l9_hit(at: AtStop) -> None:
    """B's prompt shares A's document: the full group hits {hit_full} blocks from block 0; each sliding group
    only the ⌈(W-1)/bs⌉ blocks before the hit's end, from {hit_from}; B's entries before them empty; the
    hit's tokens count once ({hit_tokens} = hit_full × bs, the only hit since the lesson's reset)."""
    sliding, (f,) = _groups(at)
    v, bs, w = at.values, at.state.config.block_size, _window(at)
    (b,) = at.seqs("B")
    hits = [e for e in at.of(p.PrefixHit) if e.seq_id == "B"]
    full = sorted(e.logical_index for e in hits if e.kv_group == f)
    assert full == list(range(len(full))) and num(v["hit_full"]) == len(full) > 0
    want = min(len(full), math.ceil((w - 1) / bs))
    for g in sliding:
        mine = sorted(e.logical_index for e in hits if e.kv_group == g)
        assert mine == list(range(len(full) - want, len(full))) and num(v["hit_sliding"]) == want
        assert b.block_tables[g][:len(full) - want] == [p.NULL_BLOCK] * (len(full) - want)
    assert num(v["hit_from"]) == len(full) - want and num(v["window_blocks"]) == math.ceil((w - 1) / bs)
    everything = [e for e in at.events if isinstance(e, p.PrefixHit)]
    assert {e.seq_id for e in everything} == {"B"}
    assert num(v["hit_tokens"]) == len(full) * bs


def l9_every_group(at: AtStop) -> None:
    """The cache was cleared of every unheld block first; C admitted; the full group had {full_only} blocks
    of C's prompt cached, the sliding groups not; C found {hit_full} (none) in the cache and computes every
    prompt token; A still holds those full-attention blocks."""
    sliding, (f,) = _groups(at)
    v, st = at.values, at.state
    clear = [e for e in at.events if isinstance(e, p.Evict) and e.seq < at.hit.seq]
    (c,) = at.seqs("C")
    (a,) = at.seqs("A")
    assert c.status == "running" and v["seq"] == "C" and num(v["prompt"]) == c.prompt_tokens
    assert not [e for e in at.of(p.PrefixHit) if e.seq_id == "C"] and num(v["hit_full"]) == 0
    cached = [e for e in at.of(p.Cached) if e.seq_id == "C"]
    in_full = {e.hash for e in at.events if isinstance(e, p.Cached) and e.kv_group == f and e.seq_id == "A"}
    mine = [e for e in cached if e.kv_group == sliding[0]]
    shared = [e for e in mine if e.hash in in_full]
    assert num(v["full_only"]) == len(shared) > 0  # A's full-attention blocks of the same content, still cached
    assert not [e for e in cached if e.kv_group == f and e.hash in in_full]  # the full group had them: not again
    for e in shared:  # A holds them in its full-attention table
        assert any(st.hash_of(x) == e.hash for x in a.block_tables[f])
    since = max(e.seq for e in at.events if isinstance(e, p.StepDone) and e.seq < at.hit.seq and e.step < at.hit.step)
    clear = [e for e in clear if e.seq > since]  # Clear prefix cache: between the last step and C's
    assert clear
    for e in clear:  # every block it evicted had left a window: its last holder's release was a window's
        last = [r for r in at.events if isinstance(r, (p.Free, p.WindowFree)) and r.block_id == e.block_id
                and r.ref_count == 0 and r.seq < e.seq][-1]
        assert isinstance(last, p.WindowFree) and last.seq_id in ("A", "B")
    assert c.num_tokens >= c.prompt_tokens  # computed, all of it


CLAIMS = {
    ("01_block_tables", 0): l1_admission, ("01_block_tables", 1): l1_decode,
    ("01_block_tables", 2): l1_next_block, ("01_block_tables", 3): l1_interleave,
    ("01_block_tables", 4): l1_finished,
    ("02_fragmentation", 0): l2_block_size, ("02_fragmentation", 1): l2_block_size,
    ("02_fragmentation", 2): l2_side_by_side,
    ("03_reservation", 0): l3_admission, ("03_reservation", 1): l3_short, ("03_reservation", 2): l3_generating,
    ("04_prefix_caching", 0): l4_chained, ("04_prefix_caching", 1): l4_prefix_hit,
    ("04_prefix_caching", 2): l4_finished, ("04_prefix_caching", 3): l4_eviction, ("04_prefix_caching", 4): l4_why,
    ("05_copy_on_write", 0): l5_fork, ("05_copy_on_write", 1): l5_cow, ("05_copy_on_write", 2): l5_still_shared,
    ("06_preemption", 0): l6_swapped, ("06_preemption", 1): l6_back, ("06_preemption", 2): l6_recompute,
    ("07_offloading", 0): l7_no_tier, ("07_offloading", 1): l7_loaded, ("07_offloading", 2): l7_cost,
    ("08_sizing", 0): l8_bytes, ("08_sizing", 1): l8_bytes,
    ("09_sliding_windows", 0): l9_tables, ("09_sliding_windows", 1): l9_window,
    ("09_sliding_windows", 2): l9_saved, ("09_sliding_windows", 3): l9_hit,
    ("09_sliding_windows", 4): l9_every_group,
}


# ---------------------------------------------------------------- the goal lines
def _submits(lesson) -> list:
    return [r for stop in lesson.stops for r in stop.submit]


def _pools(lesson) -> list:
    """Each stop's pool (a reset applies to the stops after it, until the next)."""
    out, cfg = [], {}
    for stop in lesson.stops:
        if stop.reset is not None:
            cfg = {**cfg, **{k: v for k, v in msgspec.structs.asdict(stop.reset).items()
                             if v is not None and v is not msgspec.UNSET}}
        out.append(cfg)
    return out


def g1(lesson, stops: list[AtStop]) -> None:
    """Two short prompts, blocks of 4 tokens; a block only when needed; logical blocks in order."""
    assert len(lesson.stops[0].submit) == 2 and {c["block_size"] for c in _pools(lesson)} == {4}
    for seq_id in {e.seq_id for e in stops[-1].events if isinstance(e, p.Alloc)}:
        logical = [e.logical_index for e in stops[-1].events if isinstance(e, p.Alloc) and e.seq_id == seq_id]
        assert logical == list(range(len(logical)))


def g2(lesson, stops: list[AtStop]) -> None:
    """The same four requests at 4, 16 and 64 (the same memory each time): waste per sequence grows
    with the block size, the block tables get shorter."""
    runs = [stop.submit for stop in lesson.stops if stop.submit]
    assert len(runs) == 3 and all(len(r) == 4 and r == runs[0] for r in runs)
    pools = [c for stop, c in zip(lesson.stops, _pools(lesson)) if stop.submit]
    assert [c["block_size"] for c in pools] == [4, 16, 64]
    assert len({c["block_size"] * c["num_device_blocks"] for c in pools}) == 1
    waste = [num(at.values["waste"]) for at in stops]
    entries = [num(at.values["entries"]) for at in stops]
    assert waste == sorted(waste) and waste[0] < waste[-1] and entries == sorted(entries, reverse=True)


def g3(lesson, stops: list[AtStop]) -> None:
    """Four requests, three allowed up to 256 new tokens and one 48."""
    subs = _submits(lesson)
    assert len(subs) == 4 and sorted(r.max_tokens for r in subs) == [48, 256, 256, 256]
    assert "three allowed up to 256 new tokens and one 48" in " ".join(lesson.goal.split())


def g4(lesson, stops: list[AtStop]) -> None:
    """Two requests share a system prompt; the second hits the first's blocks but the last prompt
    token's; later prompts fill the pool and evict, least recently used first."""
    a, b = (next(r for r in _submits(lesson) if r.request_id == k) for k in ("A", "B"))
    assert a.messages[0].role == b.messages[0].role == "system" and a.messages[0].content == b.messages[0].content
    assert any(isinstance(e, p.PrefixHit) and e.seq_id == "B" for e in stops[-1].events)
    assert any(isinstance(e, p.Evict) for e in stops[-1].events)


def g5(lesson, stops: list[AtStop]) -> None:
    """One prompt, four samples (n = 4)."""
    (sub,) = _submits(lesson)
    assert sub.n == 4 and sum(isinstance(e, p.Fork) for e in stops[-1].events) == 3


def g6(lesson, stops: list[AtStop]) -> None:
    """Three requests that together need more blocks than the pool has; the newest gives way, by
    swap, then by recompute."""
    for stop, cfg in zip(lesson.stops, _pools(lesson)):
        if stop.submit:
            assert len(stop.submit) == 3
            adds = [e for e in stops[lesson.stops.index(stop)].events if isinstance(e, p.RequestAdded)]
            need = sum(math.ceil((e.prompt_tokens + e.max_tokens) / cfg["block_size"]) for e in adds)
            assert need > cfg["num_device_blocks"], (need, cfg)
    modes = [e.mode for at in stops for e in at.of(p.Preempt)]
    assert modes[0] == "swap" and modes[-1] == "recompute"


def g7(lesson, stops: list[AtStop]) -> None:
    """The same four requests twice on the same device pool, one at a time (A, two fillers, A2 with A's
    prompt); without a host tier what the device evicted is computed again, with one A's evicted
    blocks are loaded back; the bench's figures quoted as docs/offload.md has them."""
    runs = [stop.submit for stop in lesson.stops if stop.submit]
    assert len(runs) == 2 and runs[0] == runs[1] and [r.request_id for r in runs[0]] == ["A", "F1", "F2", "A2"]
    assert runs[0][0].prompt == runs[0][3].prompt
    pools = [c for stop, c in zip(lesson.stops, _pools(lesson)) if stop.submit]
    assert [c.pop("num_offload_blocks") for c in map(dict, pools)] == [0, 64]
    assert {k: x for k, x in pools[0].items() if k != "num_offload_blocks"} == \
        {k: x for k, x in pools[1].items() if k != "num_offload_blocks"}
    without, with_tier = _rerun(stops[0]), _rerun(stops[1])
    assert [i for i, _ in without.evicted] == [i for i, _ in with_tier.evicted]  # the same blocks of A, both times
    assert not any(isinstance(e, p.OffloadLoad) for e in stops[0].events)
    loaded = [e.hash for e in stops[1].events if isinstance(e, p.OffloadLoad)]
    assert loaded == [e.hash for _, e in sorted(with_tier.evicted, key=lambda x: x[0])]
    # the bench figures of the last stop, as docs/offload.md ("What a load costs against a recompute") has them
    from pathlib import Path
    doc = (Path(__file__).resolve().parents[1] / "docs" / "offload.md").read_text()
    bench = [(f"{int(t):,}", r) for t, r in re.findall(r"^\| (\d+) \|[^|\n]+\|[^|\n]+\| ([\d.]+x) \|$", doc, re.M)]
    text = " ".join(lesson.stops[-1].caption.split())
    quoted = [(t, r) for r, t in re.findall(r"([\d.]+x) (?:as long as loading them )?at (\d+(?:,\d{3})*)", text)]
    assert quoted == bench and len(bench) == 4, (quoted, bench)
    ratio = {t: float(r[:-1]) for t, r in bench}
    assert abs(ratio["16"] - 1) < 0.1 and all(x > 1 for t, x in ratio.items() if t != "16")  # even at one block
    assert "SmolLM2-135M, blocks of 16" in text and "SmolLM2-135M, blocks of 16 tokens" in doc
    assert "2-core" in text and "2-core" in doc


def g8(lesson, stops: list[AtStop]) -> None:
    """The running model's own numbers (checked at each stop by l8_bytes)."""
    assert all(num(at.values["bytes_per_block"]) == at.state.config.bytes_per_block for at in stops)


def g9(lesson, stops: list[AtStop]) -> None:
    """A hybrid model: sliding-window and full-attention groups in one pool, a table per group,
    blocks freed as the window moves, a hit as long as every group serves it, what the windows save."""
    sliding, full = _groups(stops[0])
    events = stops[-1].events
    assert any(isinstance(e, p.WindowFree) for e in events)  # freed as the window moved on
    assert any(isinstance(e, p.PrefixHit) for e in events)
    assert all(len(s.block_tables) == len(sliding) + len(full) for at in stops for s in at.seqs())


GOALS = {"01_block_tables": g1, "02_fragmentation": g2, "03_reservation": g3, "04_prefix_caching": g4,
         "05_copy_on_write": g5, "06_preemption": g6, "07_offloading": g7,
         "08_sizing": g8, "09_sliding_windows": g9}
