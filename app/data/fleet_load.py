"""The fleet's load generator: a chat workload with a few shared system prompts, sent to the
engines round-robin or with prefix affinity (requests that share their first block go to the
same engine), to show what routing does to the prefix cache across a fleet.

A request's first block is its system prompt's start (every system prompt here is several
blocks long and they differ from their first words), so affinity keys on the system prompt.
"""
from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from kvscope_contract import protocol as p

Policy = Literal["round-robin", "affinity"]
POLICIES: tuple[str, ...] = ("round-robin", "affinity")

# Each opens differently (the first block differs) and is several 32-token blocks long.
SYSTEM_PROMPTS = (
    "Billing desk assistant. You answer questions about invoices, refunds and payment plans for a "
    "small software company. Be brief and polite, quote the policy when you can, and never promise "
    "a refund larger than the amount paid. Ask for the invoice number when it is missing.",
    "Cooking helper. You suggest simple recipes from what is in the fridge, list the steps in order "
    "and give cooking times in minutes. Prefer vegetarian dishes unless asked otherwise, and warn "
    "about common allergens such as nuts, gluten and shellfish.",
    "Travel planner. You propose day plans for a city trip: museums, walks, places to eat, with the "
    "time each takes and how to get from one to the next by public transport. Keep each day under "
    "eight hours and mention what needs a ticket booked ahead.",
    "Code reviewer. You read short Python functions and point out bugs, unclear names and missing "
    "tests, most important first, in at most five sentences. Suggest a fix for each bug and keep "
    "the author's style.",
)
QUESTIONS = ("Can you help me with this?", "What should I do first?", "Give me a short answer, please.",
             "What would you recommend today?", "Is there anything I should watch out for?",
             "How long will this take?")


@dataclass(frozen=True)
class ChatRequest:
    system: str
    question: str
    request_id: str

    def command(self, max_tokens: int = 16) -> p.Submit:
        return p.Submit(messages=[p.ChatMessage("system", self.system), p.ChatMessage("user", self.question)],
                        request_id=self.request_id, max_tokens=max_tokens, temperature=0.0)


def workload(n: int, systems: int = 3, run: str = "load", *, system_prompts: Sequence[str] = SYSTEM_PROMPTS,
             questions: Sequence[str] = QUESTIONS) -> list[ChatRequest]:
    """n requests cycling through the first `systems` system prompts and the questions."""
    systems = max(1, min(systems, len(system_prompts)))
    return [ChatRequest(system_prompts[i % systems], questions[(i // systems) % len(questions)], f"{run}-{i}")
            for i in range(n)]


def affinity_key(req: ChatRequest) -> str:
    return req.system


def assign(requests: Sequence[ChatRequest], engines: Sequence[str], policy: Policy) -> list[tuple[str, ChatRequest]]:
    """Which engine gets each request: in turn (round-robin), or the engine its first block hashes
    to (affinity: a stable hash, so every dashboard and every run agree)."""
    if not engines:
        return []
    if policy == "round-robin":
        turn = itertools.cycle(engines)
        return [(next(turn), r) for r in requests]
    if policy == "affinity":  # a stable hash of the first block: the same engine in every run and dashboard
        return [(engines[int(hashlib.blake2b(affinity_key(r).encode(), digest_size=4).hexdigest(), 16) % len(engines)], r)
                for r in requests]
    raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")


def send_all(plan: Sequence[tuple[str, ChatRequest]], send: Callable[[str, p.Submit], object],
             max_tokens: int = 16) -> dict[str, str]:
    """Send each request to its engine; returns the failures (request id -> why), and goes on past them."""
    failed = {}
    for engine, req in plan:
        try:
            send(engine, req.command(max_tokens))
        except Exception as e:  # one engine down must not stop the others' load
            failed[req.request_id] = f"{engine}: {e}"
    return failed
