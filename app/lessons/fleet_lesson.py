"""The routing lesson: a script over two engines of a fleet (`app/lessons/fleet/*.toml`),
run stop by stop, each caption filled with the fleet's numbers when its stop is reached.

A stop does one thing and is reached when it is done:
- `clear`: empty both engines' prefix caches (a KVScope engine is reset to the lesson's pool, a
  vLLM gets `clear_prefix_cache`), reached when both report nothing cached and nothing running;
- `send`: the chat workload (app/fleet/load.py) with a routing policy, each engine's share
  sent one request at a time (the next once the one before finished, so what a request finds
  cached does not depend on timing), reached when every request has finished;
- `probe`: a conversation of the last workload scored on each engine as a prefix-aware router
  would (app/fleet/index.py), then sent to the engine picked, reached when it finished.

The engines are the first two live ones of the fleet that take prompts and can be cleared; with
fewer, the lesson starts two KVScope engines of its own (`launch`), as the Lessons mode starts its
engine. Each stop runs on a thread of its own; the page polls `pending` and `reached`.
"""
from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import msgspec

from kvscope_contract import protocol as p
from app.fleet import load as fleet_load
from app.lessons.lesson import read_lesson
from app.lessons.walk import ThreadedWalk
from app.fleet.engines import Endpoint, Fleet, FleetEngine
from app.fleet.content import chain_ids
from app.fleet.index import EngineCache, FleetIndex, pick
from app.link.launcher import ServerProcess
from app.derived.words import plural

FLEET_LESSONS_DIR = Path(__file__).resolve().parent / "fleet"
STOP_TIMEOUT_S = 600.0   # a stop that is not done by then says so (a slow CPU, a stuck engine)
POLL_S = 0.05


class FleetStop(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    title: str
    caption: str                              # markdown; {placeholders} from `PLACEHOLDERS`
    do: Literal["clear", "send", "probe"]
    policy: str = "round-robin"               # send: round-robin | affinity
    requests: int = 12                        # send: the workload's size
    systems: int = 3                          # send: how many system prompts it cycles through
    max_tokens: int = 8
    record: str = ""                          # keep this stop's numbers under this name, for {records}

    def __post_init__(self) -> None:
        if self.policy not in fleet_load.POLICIES:
            raise ValueError(f"policy must be one of {', '.join(fleet_load.POLICIES)}, got {self.policy!r}")


class FleetLesson(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    title: str
    goal: str
    stops: list[FleetStop]
    columns: list[str] = []
    # the pool a KVScope engine is reset to (a vLLM keeps its own)
    pool: p.ResetConfig = msgspec.field(default_factory=lambda: p.ResetConfig(
        block_size=16, num_device_blocks=128, num_host_blocks=0, enable_prefix_caching=True, max_num_seqs=8))
    key: str = ""


PLACEHOLDERS = {
    "engines": "the two engines' names", "blocks": "device blocks per engine", "bs": "block size",
    "caching": "whether both engines cache prefixes",
    "physical": "cached blocks in both pools", "contents": "distinct cached contents",
    "duplicated": "duplicated blocks (every copy but one)", "dup_mib": "their MiB",
    "on_both": "contents cached on both engines", "on_both_engines": "where they are (both engines' names)",
    "elsewhere": "with other engines in the fleet: that these numbers are the two engines' alone (from a space)",
    "dup_names": "the system prompts cached on both engines, by their first words",
    "requests": "requests sent", "systems": "system prompts", "per_engine": "requests per engine",
    "hit_rates": "each engine's hit rate over this stop's requests", "hit_rate": "the hit rate over both",
    "probe": "the conversation scored", "probe_system": "its system prompt's first words",
    "probe_tokens": "its prompt tokens", "scores": "cached tokens per engine", "picked": "the engine picked",
    "reused": "prompt tokens it then found cached", "records": "the numbers kept by earlier stops",
    "cards_count": "what a card's hit rate counts (this run only, or since the page attached)",
}
RECORDED = ("requests", "per_engine", "duplicated", "dup_mib", "on_both", "hit_rate")


def load(path: Path) -> FleetLesson:
    lesson = read_lesson(path, FleetLesson, PLACEHOLDERS, RECORDED)
    if not lesson.stops or lesson.stops[0].do != "clear":
        raise ValueError(f"{path.name}: the first stop must clear the engines (a lesson starts from empty caches)")
    return lesson


def all_fleet_lessons(folder: Path = FLEET_LESSONS_DIR) -> list[FleetLesson]:
    return [load(f) for f in sorted(folder.glob("*.toml"))]


def first_words(system: str) -> str:
    """A system prompt by its opening words (each of the load's opens with its role: "Billing desk assistant.")."""
    return "“" + " ".join(system.split(".")[0].split()[:4]) + "”"


# ------------------------------------------------------------------------------ the engines
def can_drive(eng: FleetEngine) -> bool:
    """A live engine that takes prompts and whose prefix cache can be emptied."""
    c = eng.client
    return (c is not None and c.status.state == "connected" and c.view() is not None and c.supports("submit")
            and (c.supports("reset") or c.supports("clear_prefix_cache")))


_LAUNCHED: dict[int, list[ServerProcess]] = {}  # id(fleet) -> the engines lessons started for it
_LAUNCH_LOCK = threading.Lock()


def launch(fleet: Fleet, model: str, say: Callable[[str], None] = lambda s: None) -> list[str]:
    """Two KVScope engines (`model`) started for the lesson and added to the fleet as lesson-a and
    lesson-b; once per fleet (a second call waits for the first and finds them there)."""
    with _LAUNCH_LOCK:
        names = ["lesson-a", "lesson-b"]
        if all(n in fleet.engines for n in names):
            return names
        say(f"starting two KVScope engines ({model}) for the lesson")
        procs = [ServerProcess("engine.serve.server", ["--model", model, "--port", "0", "--block-size", "16",
                                                        "--num-device-blocks", "128", "--num-host-blocks", "0"],
                               token=secrets.token_urlsafe(24)).start()  # as every engine the dashboard starts
                 for _ in names]
        _LAUNCHED.setdefault(id(fleet), []).extend(procs)
        for name, proc in zip(names, procs):
            if not proc.wait_ready(STOP_TIMEOUT_S):
                raise RuntimeError(f"{name} did not start: " + " | ".join(proc.tail(5)))
            fleet.add(Endpoint(name, proc.url, token=proc.token))
        return names


def stop_launched(fleet: Fleet) -> None:
    for proc in _LAUNCHED.pop(id(fleet), []):
        proc.stop()


def _wait(cond: Callable[[], object], what: str, timeout: float = STOP_TIMEOUT_S):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if got := cond():
            return got
        time.sleep(POLL_S)
    raise TimeoutError(f"{what}: not within {timeout:.0f} s")


def _acked(client, cid: int, what: str) -> None:
    r = _wait(lambda: client.reply(cid), f"{what}: no reply")
    if isinstance(r, p.Error):
        raise RuntimeError(f"{what}: {r.op}: {r.message}")


# ------------------------------------------------------------------------------ a run
@dataclass
class Phase:
    """One `send` stop's requests and the engines' counters before them."""
    policy: str
    plan: list[tuple[str, fleet_load.ChatRequest]]
    before: dict[str, tuple[int, int]]  # engine -> (hit tokens, looked-up tokens) before the first request
    after: dict[str, tuple[int, int]] = field(default_factory=dict)


@dataclass
class FleetLessonRun(ThreadedWalk):
    lesson: FleetLesson
    fleet: Fleet
    model: str = "smollm2"                          # for the engines the lesson starts, if it must
    engines: list[str] = field(default_factory=list)
    reached: list[dict[str, str]] = field(default_factory=list)   # each reached stop's words
    viewing: int = -1
    pending: int | None = None                      # the stop being run to
    progress: str = ""                              # what the pending stop is doing, in words
    errors: list[str] = field(default_factory=list)
    phases: list[Phase] = field(default_factory=list)
    probe: dict = field(default_factory=dict)       # the probe stop's scores, pick and result
    records: dict[str, dict[str, str]] = field(default_factory=dict)
    _thread: threading.Thread | None = None

    def words(self) -> dict[str, str]:
        return self.reached[self.viewing]

    # ------------------------------------------------------------------ a stop
    def _reach(self, index: int) -> None:
        stop = self.lesson.stops[index]
        try:
            if not self.engines:
                self.engines = self._pick_engines()
            {"clear": self._clear, "send": self._send, "probe": self._probe}[stop.do](stop)
            self.progress = "filling in the numbers"
            words = self._words(stop)
            if stop.record:
                self.records[stop.record] = {k: words[k] for k in RECORDED}
            words["records"] = records_table_of(self.records, self.lesson.columns)
            self.reached.append(words)
            self.viewing = index
        except Exception as e:  # said on the page; Restart starts over
            self.errors.append(f"stop {index + 1}: {e}")
        finally:
            self.pending = None

    def _pick_engines(self) -> list[str]:
        found = [e.name for e in self.fleet.members() if can_drive(e)]
        if len(found) >= 2:
            return found[:2]
        names = launch(self.fleet, self.model, lambda s: setattr(self, "progress", s))
        self.progress = "waiting for the lesson's engines to connect"
        _wait(lambda: all(can_drive(self.fleet.engines[n]) for n in names), "the lesson's engines to connect", 60)
        return names

    def _client(self, name: str):
        return self.fleet.engines[name].client

    # ------------------------------------------------------------------ the stops
    def _clear(self, stop: FleetStop) -> None:
        self.progress = "clearing both prefix caches"
        for name in self.engines:
            c = self._client(name)
            if c.supports("reset"):
                _acked(c, c.send(p.ResetCmd(config=self.lesson.pool)), f"{name}: reset")
                if c.supports("resume") and c.loop.paused:
                    _acked(c, c.send(p.Resume()), f"{name}: resume")
            else:
                _acked(c, c.send(p.ClearPrefixCache()), f"{name}: clear the prefix cache")

        def empty(name: str) -> bool:
            view = self._client(name).view()
            if view is None:
                return False
            counts = view.mirror.state.counts()
            return counts.cached == 0 and counts.used == 0 and not view.mirror.state.seqs \
                and not self.fleet.engines[name].contents()
        _wait(lambda: all(empty(n) for n in self.engines), "both prefix caches to empty")

    def _counters(self, name: str) -> tuple[int, int]:
        tl = self._client(name).view().mirror.tally
        return tl.hit_tokens, tl.looked_up_tokens

    def _send(self, stop: FleetStop) -> None:
        run = f"{stop.policy[:2]}{len(self.phases) + 1}"
        plan = fleet_load.assign(fleet_load.workload(stop.requests, stop.systems, run), self.engines, stop.policy)
        phase = Phase(stop.policy, plan, {n: self._counters(n) for n in self.engines})
        queues = {n: [r for e, r in plan if e == n] for n in self.engines}
        sent = 0  # one at a time per engine, the engines side by side
        in_flight: dict[str, int] = {}  # engine -> finished count to wait for
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while any(queues.values()) or in_flight:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{stop.policy}: {sent} of {len(plan)} requests sent, not all finished")
            for name in self.engines:
                c = self._client(name)
                if c.status.state != "connected":  # said at once, not after the stop's timeout
                    raise RuntimeError(f"{name} is {c.status.state}: {c.status.last_error or 'no reason given'}")
                view = c.view()
                if view is None:
                    continue
                if name in in_flight:
                    if view.mirror.tally.finished < in_flight[name] or view.mirror.state.seqs:
                        continue
                    del in_flight[name]
                if queues[name]:
                    req = queues[name].pop(0)
                    in_flight[name] = view.mirror.tally.finished + 1
                    _acked(c, c.send(req.command(stop.max_tokens)), f"{name}: submit {req.request_id}")
                    sent += 1
                    self.progress = f"{stop.policy}: {sent} of {len(plan)} requests sent"
            time.sleep(POLL_S)
        phase.after = {n: self._counters(n) for n in self.engines}
        self.phases.append(phase)

    def _probe(self, stop: FleetStop) -> None:
        phase = self.phases[-1]
        engine, req = phase.plan[0]
        ids = prompt_ids(self._client(engine), req.request_id)
        if ids is None:
            raise RuntimeError(f"{engine} did not send {req.request_id}'s prompt token ids")
        ix = self.index()
        scores = [s for s in ix.score(ids) if s.engine in self.engines]
        free = {n: (v := self._client(n).view().mirror.state.counts()).free + v.cached for n in self.engines}
        picked = pick(scores, free)
        c = self._client(picked)
        before = self._counters(picked)
        finished = c.view().mirror.tally.finished
        self.progress = f"sending {req.request_id} again to {picked}"
        again = fleet_load.ChatRequest(req.system, req.question, f"{req.request_id}-again")
        _acked(c, c.send(again.command(stop.max_tokens)), f"{picked}: submit")
        _wait(lambda: c.view().mirror.tally.finished > finished and not c.view().mirror.state.seqs,
              f"{picked} to finish")
        self.probe = dict(request=req, first_engine=engine, ids=ids, scores=scores, picked=picked, again=again,
                          reused=self._counters(picked)[0] - before[0])

    # ------------------------------------------------------------------ what a stop says
    def index(self) -> FleetIndex:
        """The prefix cache across the lesson's two engines, now."""
        caches = []
        for name in self.engines:
            eng = self.fleet.engines[name]
            row = eng.row()
            caches.append(EngineCache(name, row.block_size, row.bytes_per_block, eng.contents()))
        return FleetIndex.build(caches)

    def _words(self, stop: FleetStop) -> dict[str, str]:
        ix = self.index()
        a, b = self.engines
        cfg = self._client(a).view().mirror.config
        on_both = sum(1 for held in ix.holders.values() if len(held) > 1)
        w = {k: "" for k in PLACEHOLDERS}
        caching = {self._client(n).view().mirror.config.enable_prefix_caching for n in self.engines}
        w.update(engines=f"**{a}** and **{b}**", blocks=f"{cfg.num_device_blocks:,}", bs=str(cfg.block_size),
                 caching="prefix caching on" if caching == {True} else "prefix caching off on one of them",
                 physical=f"{sum(ix.copies(c) for c in ix.holders):,}", contents=f"{len(ix.holders):,}",
                 duplicated=f"{ix.duplicated_blocks():,}", dup_mib=f"{ix.duplicated_bytes() / 2**20:,.2f}",
                 on_both=f"{on_both:,}", on_both_engines=f"both {a} and {b}")
        if others := [e.name for e in self.fleet.members() if e.name not in self.engines]:
            w["elsewhere"] = (f" (These numbers are {a}'s and {b}'s alone; the fleet's panel below counts "
                              f"{plural(len(others), 'other engine')} too: {', '.join(others)}.)")
        if stop.do == "send":
            phase = self.phases[-1]
            firsts = {}  # system prompt -> its first block's content id, as each engine's request sent it
            for engine, req in phase.plan:
                ids = prompt_ids(self._client(engine), req.request_id)
                if ids is not None and (chain := chain_ids(ids, cfg.block_size)):
                    firsts.setdefault(req.system, chain[0])
            dup = [s for s, cid in firsts.items() if len(ix.holders.get(cid, {})) > 1]
            hits = {n: (phase.after[n][0] - phase.before[n][0], phase.after[n][1] - phase.before[n][1])
                    for n in self.engines}
            w.update(requests=str(len(phase.plan)), systems=str(len({r.system for _, r in phase.plan})),
                     per_engine=", ".join(f"{n}: {sum(e == n for e, _ in phase.plan)}" for n in self.engines),
                     dup_names=", ".join(first_words(s) for s in dup) or "(none)",
                     hit_rates=", ".join(f"{n} {_rate(*hits[n])}" for n in self.engines),
                     hit_rate=_rate(sum(h for h, _ in hits.values()), sum(n for _, n in hits.values())),
                     cards_count=self._cards_count(phase))
        if stop.do == "probe":
            pr = self.probe
            w.update(probe=f"`{pr['request'].request_id}`", probe_system=first_words(pr["request"].system),
                     probe_tokens=f"{len(pr['ids']):,}", picked=pr["picked"], reused=f"{pr['reused']:,}",
                     scores=", ".join(f"{s.engine} {plural(s.cached_tokens, 'token')} ({plural(s.blocks, 'block')})"
                                      for s in sorted(pr["scores"], key=lambda s: self.engines.index(s.engine))))
        return w


    def _cards_count(self, phase: Phase) -> str:
        """What the cards' hit rates count: an engine the lesson reset counts this run only, one it
        could only clear (a vLLM) every request since the page attached."""
        fresh = [n for n in self.engines if phase.before[n] == (0, 0)]
        if len(fresh) == len(self.engines):
            return "(The cards' hit rates below count this run's requests only.)"
        since = "; ".join(f"{n}'s every request since {self._client(n).view().mirror.tally.since}"
                          + (", both runs together" if n not in fresh else "") for n in self.engines)
        return f"(The cards' hit rates below count {since}.)"


def _rate(hit: int, looked: int) -> str:
    return f"{hit / looked:.0%} ({hit:,} of {looked:,} tokens)" if looked else "– (no lookup)"


def records_table_of(records: dict[str, dict[str, str]], columns: list[str]) -> str:
    if not records:
        return ""
    names = {"requests": "requests", "per_engine": "per engine", "duplicated": "duplicated blocks",
             "dup_mib": "duplicated MiB", "on_both": "on both engines", "hit_rate": "hit rate"}
    cols = list(columns) or list(RECORDED)
    head = "| | " + " | ".join(names[c] for c in cols) + " |\n|---|" + "---:|" * len(cols) + "\n"
    return head + "\n".join(f"| {name} | " + " | ".join(r[c] for c in cols) + " |" for name, r in records.items())


def prompt_ids(client, request_id: str) -> list[int] | None:
    """The prompt token ids an engine's `request_added` gave for `request_id` (None: not seen, or not sent)."""
    with client.lock:
        h = client.history
        events = list(h.events) if h else []
    for ev in reversed(events):
        if isinstance(ev, p.RequestAdded) and ev.request_id == request_id:
            return list(ev.prompt_token_ids) if ev.prompt_token_ids else None
    return None


def caption(stop: FleetStop, words: dict[str, str]) -> str:
    return stop.caption.format_map(words)
