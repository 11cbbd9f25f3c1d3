"""The fleet's load generator: a chat workload with a few shared system prompts, sent to the
engines round-robin or with prefix affinity (requests that share their first block go to the
same engine), to show what routing does to the prefix cache across a fleet.

A request's first block is its system prompt's start (every system prompt here is several
blocks long and they differ from their first words), so affinity keys on the system prompt.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from kvscope_contract import protocol as p
from app.link import gate

Policy = Literal["round-robin", "affinity"]
POLICIES: tuple[str, ...] = ("round-robin", "affinity")

# Each opens differently (the first block differs) and is 100 to 115 tokens long (SmolLM2's
# tokenizer): with the chat template's opening, three full 32-token blocks (six of 16) that every
# request of a system prompt shares, the blocks a fleet pays for twice when two engines cache them.
SYSTEM_PROMPTS = (
    "Billing desk assistant. You answer questions about invoices, refunds and payment plans for a "
    "small software company. Be brief and polite, quote the policy when you can, and never promise "
    "a refund larger than the amount paid. Ask for the invoice number when it is missing. Refunds "
    "are possible within thirty days of payment; after that, offer a credit note instead. Payment "
    "plans split an invoice over at most six months and need the customer's written agreement. "
    "Never ask for a full card number, and send anything about a data breach to the security team.",
    "Cooking helper. You suggest simple recipes from what is in the fridge, list the steps in order "
    "and give cooking times in minutes. Prefer vegetarian dishes unless asked otherwise, and warn "
    "about common allergens such as nuts, gluten and shellfish. Assume a home kitchen with one oven, "
    "two pans and no special tools. Keep a recipe under ten ingredients, name a substitute for any "
    "ingredient that is hard to find, and say how long leftovers keep in the fridge. When a dish "
    "needs meat, say how to tell that it is cooked through.",
    "Travel planner. You propose day plans for a city trip: museums, walks, places to eat, with the "
    "time each takes and how to get from one to the next by public transport. Keep each day under "
    "eight hours and mention what needs a ticket booked ahead. Put the busiest sights early in the "
    "morning, leave an hour free in the afternoon, and suggest an indoor plan for a rainy day. Give "
    "prices in the local currency, say which places are closed on Mondays, and keep walks under "
    "five kilometres a day for travellers with children.",
    "Code reviewer. You read short Python functions and point out bugs, unclear names and missing "
    "tests, most important first, in at most five sentences. Suggest a fix for each bug and keep "
    "the author's style. Flag mutable default arguments, bare except clauses, and files or sockets "
    "that are never closed. Prefer the standard library to a new dependency, ask for type hints on "
    "public functions, and say when a loop could be a comprehension, but never rewrite working "
    "code only to make it shorter.",
)
QUESTIONS = ("Can you help me with this?", "What should I do first?", "Give me a short answer, please.",
             "What would you recommend today?", "Is there anything I should watch out for?",
             "How long will this take?")


@dataclass(frozen=True)
class ChatRequest:
    system: str
    question: str
    request_id: str

    def messages(self) -> list[p.ChatMessage]:
        return [p.ChatMessage("system", self.system), p.ChatMessage("user", self.question)]

    def command(self, max_tokens: int = 16) -> p.Submit:
        return p.Submit(messages=self.messages(), request_id=self.request_id, max_tokens=max_tokens, temperature=0.0)


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
        digest = lambda r: int(hashlib.blake2b(affinity_key(r).encode(), digest_size=4).hexdigest(), 16)
        return [(engines[digest(r) % len(engines)], r)
                for r in requests]
    raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")


# ------------------------------------------------------------------------------ over HTTP
_models: dict[str, str] = {}  # OpenAI server -> the model it serves (asked once)


def served_model(api: str, timeout: float = 5.0) -> str:
    """The first model an OpenAI server lists at /v1/models (vLLM serves one)."""
    if api not in _models:
        with urllib.request.urlopen(api.rstrip("/") + "/v1/models", timeout=timeout) as r:
            _models[api] = json.loads(r.read())["data"][0]["id"]
    return _models[api]


def chat_body(cmd: p.Submit, model: str) -> dict:
    """The OpenAI chat (or completion) request that asks what `cmd` asks."""
    body = {"model": model, "max_tokens": cmd.max_tokens, "temperature": cmd.temperature, "top_p": cmd.top_p,
            "n": cmd.n, "ignore_eos": cmd.ignore_eos, **({"seed": cmd.seed} if cmd.seed is not None else {})}
    if cmd.messages is not None:
        return {**body, "messages": [{"role": m.role, "content": m.content} for m in cmd.messages]}
    return {**body, "prompt": cmd.prompt}


def post_openai(api: str, cmd: p.Submit, timeout: float = 600.0) -> dict:
    """Send `cmd` to an OpenAI server (vLLM, SGLang) and wait for the answer; its error in words."""
    path = "/v1/chat/completions" if cmd.messages is not None else "/v1/completions"
    req = urllib.request.Request(api.rstrip("/") + path, json.dumps(chat_body(cmd, served_model(api))).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"{api}: HTTP {e.code}: {e.read()[:300].decode(errors='replace')}") from None


def post_in_background(api: str, cmd: p.Submit | None, failed: Callable[[str], object],
                       path: str = "") -> threading.Thread:
    """`post_openai` on a thread of its own (or an empty POST to `path`): the page never waits for
    a server's answer; a failure is handed to `failed`, in words. Refused (gate) in a viewer's session."""
    gate.check()  # here, in the caller's thread: the thread below runs outside any session

    def go() -> None:
        try:
            if cmd is not None:
                post_openai(api, cmd)
            else:
                req = urllib.request.Request(api.rstrip("/") + path, b"", method="POST")
                urllib.request.urlopen(req, timeout=60).close()
        except urllib.error.HTTPError as e:
            failed(f"{path or cmd.request_id}: HTTP {e.code}: {e.read()[:200].decode(errors='replace')}")
        except Exception as e:  # a server down, a bad answer: said on the page
            failed(f"{path or cmd.request_id or 'request'}: {e}")
    t = threading.Thread(target=go, daemon=True, name=f"load {api}")
    t.start()
    return t


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
