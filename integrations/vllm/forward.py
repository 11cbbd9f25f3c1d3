"""Prompts from the dashboard, run by vLLM's own OpenAI-compatible server.

A `submit` becomes a streamed POST to /v1/completions (a prompt) or /v1/chat/completions
(chat messages), made from the plugin's event loop; `abort` closes that stream, and vLLM's
server aborts a request whose client went away. The engine core itself is never called.

Every submission gets an answer: its ack, or an error in words. While the server has never
answered (it comes up after the engine core and this plugin) a refused connection is tried again
for up to API_WAIT_S; once it has answered, a refused connection means it is gone, said at once.
"""
from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, field
from typing import Callable

import aiohttp

from kvscope_contract import protocol as p

log = logging.getLogger("kvscope")
API_WAIT_S = 120  # vLLM's OpenAI server comes up a little after its engine core (and this plugin)


@dataclass
class Submission:
    request_id: str
    n: int
    on_error: Callable[[p.ErrorCode, str], None]  # before vLLM took the request
    on_accept: Callable[[list[str]], None]        # vLLM queued every sample: their ids
    task: asyncio.Task | None = None
    accepted: bool = False  # vLLM queued it (its request_added events came)
    seq_ids: list[str] = field(default_factory=list)


def request_body(cmd: p.Submit, model: str, request_id: str) -> tuple[str, dict]:
    """The endpoint and JSON body for `cmd`; the request id comes back in vLLM's ids."""
    body = {"model": model, "max_tokens": cmd.max_tokens, "temperature": cmd.temperature,
            "top_p": cmd.top_p, "n": cmd.n, "ignore_eos": cmd.ignore_eos, "stream": True,
            "request_id": request_id}
    if cmd.seed is not None:
        body["seed"] = cmd.seed
    if cmd.messages is not None:
        body["messages"] = [{"role": m.role, "content": m.content} for m in cmd.messages]
        return "/v1/chat/completions", body
    body["prompt"] = cmd.prompt
    return "/v1/completions", body


def error_code(status: int, message: str) -> p.ErrorCode:
    if status == 400 and ("maximum context length" in message or "too long" in message
                          or "max_model_len" in message or "longer than" in message):
        return "too_long"
    return "invalid_argument" if 400 <= status < 500 else "busy"


class Forwarder:
    """Runs submissions against vLLM's OpenAI server, on the loop that calls it."""

    def __init__(self, base_url: str, model: str):
        self.base_url, self.model = base_url.rstrip("/"), model
        self.live: dict[str, Submission] = {}  # by request id, until its stream ends
        self.answered = False  # the server has answered once: it is up, or was
        self.gone = ""         # why no submission can be run any more (its server died)
        self._session: aiohttp.ClientSession | None = None

    def fail_all(self, why: str) -> None:
        """The server is gone: every submission not yet taken by vLLM gets `why`, none is tried again."""
        self.gone = why
        for sub in list(self.live.values()):
            if not sub.accepted:
                sub.accepted = True  # answered: no second error from its cancelled task
                sub.on_error("busy", why)
            if sub.task is not None:
                sub.task.cancel()

    def submit(self, cmd: p.Submit, request_id: str, sub: Submission) -> None:
        path, body = request_body(cmd, self.model, request_id)
        self.live[request_id] = sub
        sub.task = asyncio.get_running_loop().create_task(self._run(path, body, sub))

    async def post(self, path: str) -> bool:
        """A bodiless POST (e.g. /reset_prefix_cache); True on HTTP 200."""
        async with self._client().post(self.base_url + path) as resp:
            return resp.status == 200

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=5))
        return self._session

    def abort(self, request_id: str) -> bool:
        sub = self.live.get(request_id)
        if sub is None or sub.task is None or sub.task.done():
            return False
        sub.task.cancel()  # the connection closes: vLLM aborts every sample of the request
        return True

    async def _run(self, path: str, body: dict, sub: Submission) -> None:
        try:
            for waited in range(API_WAIT_S):
                try:
                    return await self._stream(path, body, sub)
                except aiohttp.ClientConnectorError:
                    if self.answered or self.gone or waited == API_WAIT_S - 1:
                        raise
                    await asyncio.sleep(1)
        except asyncio.CancelledError:
            raise
        except (aiohttp.ClientError, OSError) as e:
            if sub.accepted:
                log.warning("kvscope: the stream of %s ended: %s", sub.request_id, e)
            elif self.answered:
                sub.on_error("busy", f"vLLM's OpenAI server at {self.base_url} stopped answering ({e}): "
                             "it is down, or its process died")
            else:
                sub.on_error("busy", f"cannot reach vLLM's OpenAI server at {self.base_url} ({e}); "
                             "set KVSCOPE_VLLM_URL to where `vllm serve` listens")
        finally:
            if self.live.get(sub.request_id) is sub:
                del self.live[sub.request_id]

    async def _stream(self, path: str, body: dict, sub: Submission) -> None:
        async with self._client().post(self.base_url + path, json=body) as resp:
            self.answered = True
            if resp.status != 200:
                text = await resp.text()
                try:
                    text = json.loads(text).get("error", {}).get("message", text)
                except (ValueError, AttributeError):
                    pass
                return sub.on_error(error_code(resp.status, text), f"vLLM refused it: {text}")
            async for _ in resp.content:  # the stream runs until vLLM finishes the request
                pass

    async def close(self) -> None:
        for sub in list(self.live.values()):
            if sub.task:
                sub.task.cancel()
        if self._session is not None:
            await self._session.close()
