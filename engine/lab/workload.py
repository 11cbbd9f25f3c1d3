"""Workloads for the lab: requests as token streams (prompt in, every sample's outputs replayed).

From a recording (`engine.serve.server --record`, or the dashboard's session), or a preset mix built
at the token level: chat with shared system prompts, parallel sampling, long and short mixed.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

from kvscope_contract import protocol as p
from kvscope_contract.lab import PRESETS
from kvscope_contract.rebuild import PromptRebuilder, known_prompt
from kvscope_contract.state import PoolState
from kvscope_contract.recording import Recording


@dataclass
class Request:
    request_id: str
    arrival: int                 # the engine step it was submitted after (0: before the first)
    prompt: list[int]
    outputs: list[list[int]]     # per sample (sample 0 is the request's own sequence), replayed
    max_tokens: int

    @property
    def n(self) -> int:
        return len(self.outputs)

    @property
    def tokens(self) -> int:
        return len(self.prompt) + sum(map(len, self.outputs))


@dataclass
class Workload:
    name: str
    requests: list[Request]
    base: p.PoolConfig = field(default_factory=p.PoolConfig)  # the pool it was recorded on, or a default
    notes: list[str] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return sum(r.tokens for r in self.requests)

    @property
    def sequences(self) -> int:
        return sum(r.n for r in self.requests)


# ------------------------------------------------------------------------------ recordings
def from_recording(path: Path) -> Workload:
    rec = Recording(Path(path))
    workload = from_messages(Path(path).name, rec.start, [ev for batch in rec.batches for ev in batch])
    if rec.cut_short:
        workload.notes.append(rec.cut_short)
    return workload


def from_messages(name: str, start: p.Snapshot, events: list[p.AnyEvent]) -> Workload:
    """The requests submitted in `events` (which follow `start`), with the outputs each sample
    produced. Prompts come from `prompt_token_ids`; where a server did not send them, they are
    rebuilt from the block hashes the events show (kvscope_contract/rebuild.py: shared prefixes
    are kept to whole blocks)."""
    state = PoolState.from_snapshot(start)
    rebuilder = PromptRebuilder()
    added: dict[str, p.RequestAdded] = {}
    outputs: dict[str, dict[int, list[int]]] = {}  # request -> sample index -> tokens
    sample_of: dict[str, tuple[str, int]] = {}      # seq_id -> (request, sample index)
    first_step: int | None = None
    for ev in events:
        if ev.seq <= state.last_event:
            continue
        rebuilder.observe(ev, state)
        state.apply(ev)
        match ev:
            case p.RequestAdded():
                first_step = ev.step if first_step is None else first_step
                added[ev.request_id] = ev
                outputs[ev.request_id] = {0: []}
                sample_of[ev.seq_id] = (ev.request_id, 0)
            case p.Fork() if ev.parent_seq_id in sample_of:
                rid = sample_of[ev.parent_seq_id][0]
                index = len(outputs[rid])
                sample_of[ev.seq_id] = (rid, index)
                outputs[rid][index] = []
            case p.Append() if ev.token_ids and ev.seq_id in sample_of:
                rid, index = sample_of[ev.seq_id]
                outputs[rid][index] += ev.token_ids
    bs = start.config.block_size
    requests, rebuilt, dropped = [], 0, []
    for rid, ev in added.items():
        outs = [outputs[rid].get(i, []) for i in range(ev.n)]
        if not all(outs):
            dropped.append(rid)  # aborted or cut off before every sample had a token
            continue
        if known_prompt(ev):
            prompt = list(ev.prompt_token_ids)
        else:
            prompt = rebuilder.prompt(rid, ev.prompt_tokens)
            rebuilt += 1
        requests.append(Request(rid, ev.step - (first_step or 0), prompt, outs, ev.max_tokens))
    notes = []
    if rebuilt:
        notes.append(f"{rebuilt} prompts rebuilt from block hashes (the recording has no prompt token ids): "
                     f"prefixes shared in whole blocks of {bs} are kept, finer sharing is not")
    if dropped:
        notes.append(f"{len(dropped)} requests left out: they produced no token for some sample "
                     f"({', '.join(dropped[:5])}{'…' if len(dropped) > 5 else ''})")
    return Workload(name, requests, start.config, notes)


# ------------------------------------------------------------------------------ presets
VOCAB = 49_152  # SmolLM2's vocabulary: preset tokens look like real ones


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def chat(scale: int = 1, seed: int = 0) -> Workload:
    """Conversations under three system prompts (160, 280 and 400 tokens), each with its own
    question (12-40 tokens) and answer (24-160 tokens), arriving two per step."""
    rng = random.Random(seed)
    systems = [_tokens(rng, n) for n in (160, 280, 400)]
    reqs = []
    for i in range(24 * scale):
        prompt = systems[i % 3] + _tokens(rng, rng.randint(12, 40))
        out = rng.randint(24, 160)
        reqs.append(Request(f"chat{i}", i // 2, prompt, [_tokens(rng, out)], 192))
    return Workload("chat with shared system prompts", reqs,
                    notes=["3 system prompts of 160/280/400 tokens, a question of 12-40 tokens and an "
                           "answer of 24-160 tokens per request, two requests per step"])


def parallel(scale: int = 1, seed: int = 0) -> Workload:
    """Requests of n=4 samples: a 40-120 token prompt, each sample 40-120 tokens of its own."""
    rng = random.Random(seed)
    reqs = [Request(f"par{i}", 3 * i, _tokens(rng, rng.randint(40, 120)),
                    [_tokens(rng, rng.randint(40, 120)) for _ in range(4)], 128)
            for i in range(6 * scale)]
    return Workload("parallel sampling (n=4)", reqs,
                    notes=["prompts of 40-120 tokens, 4 samples of 40-120 tokens each, one request every 3 steps"])


def mixed(scale: int = 1, seed: int = 0) -> Workload:
    """The dashboard's "Long and short mixed": two long generations (256 tokens) among six
    short answers (3-20 tokens), every request allowed 256 tokens."""
    rng = random.Random(seed)
    reqs = []
    for k in range(scale):
        arrival = 40 * k
        reqs += [Request(f"mix{k}-long{i}", arrival, _tokens(rng, rng.randint(24, 32)),
                         [_tokens(rng, 256)], 256) for i in (1, 2)]
        reqs += [Request(f"mix{k}-short{i}", arrival, _tokens(rng, rng.randint(18, 28)),
                         [_tokens(rng, rng.randint(3, 20))], 256) for i in range(1, 7)]
    return Workload("long and short mixed", reqs,
                    notes=["2 long answers of 256 tokens and 6 short ones of 3-20 tokens per round "
                           "(prompts of 18-32 tokens, as the dashboard's scenario on SmolLM2), a round every 40 steps"])


BUILDERS = {"chat": chat, "parallel": parallel, "mixed": mixed}
assert BUILDERS.keys() == PRESETS.keys(), "a preset needs a builder here and its words in kvscope_contract/lab.py"


def load(spec: str, scale: int = 1) -> Workload:
    """A preset name (chat, parallel, mixed) or the path of a recording."""
    if spec in BUILDERS:
        return BUILDERS[spec](scale)
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"{spec!r} is neither a preset ({', '.join(PRESETS)}) nor a recording file")
    return from_recording(path)
