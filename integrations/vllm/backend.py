"""The hub backend inside vLLM's engine core: the observer's events out, commands in.

Nothing here may hurt vLLM. The observer's hooks go in only once the server listens (`start`:
a plugin that cannot serve installs none, keeps no prompt, queues nothing), and a hook that fails
takes them all out and says so once (the clients are closed with the reason; vLLM runs on).
Events leave the engine core's thread in one hand-off per scheduler call into a bounded queue
(MAX_QUEUED_BATCHES: past it the queue is dropped and every client gets a fresh snapshot), with
at most one wake-up of the hub's loop pending; the loop adds each sampled token's text and
publishes. A snapshot takes the observer's lock only to publish what is queued and copy what it
reads of vLLM's structures (between two scheduler calls they say exactly what the events so far
say); the pool is built from the copy on the hub's worker thread. Snapshots are coalesced: at
most one is pending, and one is taken at most every SNAPSHOT_INTERVAL_S, however many clients
connect or ask (a dashboard reconnecting in a loop costs vLLM a copy five times a second at most).

The engine core runs as a child of vLLM's API server, which alone sends it requests. When that
parent dies (killed, crashed) the engine core lives on as an orphan nobody can use: the backend
notices within PARENT_POLL_S, answers every pending submit with the reason, closes its clients'
connections with it (the dashboard says why the engine went down) and stops the engine core as
vLLM stops it on SIGTERM (killed after ORPHAN_EXIT_S if that hangs).
"""
from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable


from kvscope_contract import protocol as p
from engine.core.detokenizer import Detokenizer
from engine.serve.hub import Client, Hub
from integrations.vllm import SNAPSHOT_INTERVAL_S
from integrations.vllm.forward import Forwarder, Submission
from integrations.vllm.observer import VLLM_NULL_BLOCK, PoolObserver, build, kv_groups, request_group
from kvscope_contract.state import PoolState

log = logging.getLogger("kvscope")
PARENT_POLL_S = 0.5
FLUSH_S = 2.0        # for the replies queued to clients before their connections close
ORPHAN_EXIT_S = 30.0  # after SIGTERM, then SIGKILL
CLOSE_GOING_AWAY = 1001
CLOSE_INTERNAL_ERROR = 1011
MAX_QUEUED_BATCHES = 1024   # scheduler calls' events waiting for the hub's loop; past it they give way to a snapshot


@dataclass
class _Text:
    ids: list[int]
    detok: Detokenizer
    text: str = ""


def pool_config(scheduler) -> p.PoolConfig:
    """vLLM's pool: one block size and one page size for every KV-cache group (vLLM's uniform
    page size), so a physical block holds one page for each of a group's layers."""
    kv = scheduler.kv_cache_config
    group = kv.kv_cache_groups[0]
    pool = scheduler.kv_cache_manager.block_pool
    layers_per_group = max(len(g.layer_names) for g in kv.kv_cache_groups)
    return p.PoolConfig(
        block_size=group.kv_cache_spec.block_size, num_device_blocks=pool.num_gpu_blocks,
        num_host_blocks=0, enable_prefix_caching=pool.enable_caching, preemption_mode="recompute",
        max_num_seqs=scheduler.scheduler_config.max_num_seqs,
        bytes_per_block=group.kv_cache_spec.page_size_bytes * layers_per_group,
        reserved_blocks=[VLLM_NULL_BLOCK], kv_groups=kv_groups(kv))


def engine_info(vllm_config) -> p.EngineInfo:
    from vllm.platforms import current_platform

    mc, par = vllm_config.model_config, vllm_config.parallel_config
    return p.EngineInfo(model=mc.served_model_name, device=current_platform.device_type,
                        dtype=str(mc.dtype).removeprefix("torch."), num_layers=mc.get_num_layers(par),
                        num_kv_heads=mc.get_num_kv_heads(par), head_dim=mc.get_head_size())


class VllmBackend:
    def __init__(self, scheduler, api_url: str):
        import vllm
        from vllm import envs

        self.vllm_config = scheduler.vllm_config
        self.config = pool_config(scheduler)
        self.info = engine_info(self.vllm_config)
        self.server = f"vllm {vllm.__version__} + kvscope plugin"
        self.supports = ["submit", "abort", "snapshot"] + (
            ["clear_prefix_cache"] if envs.VLLM_SERVER_DEV_MODE else [])
        self.hub: Hub | None = None
        self.batches: deque[list[p.Event]] = deque()
        self.texts: dict[str, _Text] = {}
        self.tokenizer = None
        self.forwarder = Forwarder(api_url, self.info.model)
        self.scheduler = scheduler
        self.observer: PoolObserver | None = None  # hooked in once the server listens (start)
        self._resync_due = False
        self._flush_due = False       # a wake-up of the loop is pending (set under the observer's lock)
        self._snapshot_due = False    # a snapshot is pending on the loop
        self._last_snapshot = 0.0
        self.dropped_batches = 0      # hand-offs the loop fell too far behind on (a snapshot replaced them)
        self._next_id = 0
        self.stop_serving: Callable[[], None] | None = None  # the plugin's: stop listening (any thread)

    # ------------------------------------------------------------------ Backend
    def start(self, hub: Hub) -> None:
        """Called once the server listens: only now are vLLM's methods wrapped (UnsupportedEngine
        if they cannot be, and the server stops: nothing stays hooked)."""
        self.hub = hub
        self.observer = PoolObserver(self.scheduler, self._queue, self._detached)
        threading.Thread(target=self._load_tokenizer, name="kvscope-tokenizer", daemon=True).start()
        self._flush()
        if (parent := multiprocessing.parent_process()) is not None:  # None: an engine core in-process
            hub.loop.create_task(self._watch_parent(parent.pid))

    def stop(self) -> None:
        self.hub.loop.create_task(self.forwarder.close())

    def hello(self) -> p.Hello:
        return p.Hello(engine=self.info, config=self.config, server=self.server, supports=self.supports,
                       api_url=self.forwarder.base_url)

    def request_snapshot(self) -> None:
        """Coalesced: the clients waiting share the next snapshot, taken SNAPSHOT_INTERVAL_S after
        the last at the soonest."""
        if self._snapshot_due:
            return
        self._snapshot_due = True
        wait = max(0.0, self._last_snapshot + SNAPSHOT_INTERVAL_S - time.monotonic())
        self.hub.loop.call_later(wait, self._deliver_snapshot)

    def _deliver_snapshot(self) -> None:
        self._snapshot_due = False
        self._last_snapshot = time.monotonic()
        if not self.observer.detached:
            self.hub.deliver_snapshot(self._snapshot())

    def handle(self, cmd: p.AnyCommand, client: Client) -> None:
        match cmd:
            case p.Submit():
                return self._submit(cmd, client)
            case p.Abort():
                if not self.forwarder.abort(cmd.request_id):
                    raise p.CommandError("not_found", f"no request {cmd.request_id!r} submitted from "
                                         "KVScope is running (vLLM aborts a request when its own "
                                         "client disconnects, so only KVScope's can be aborted here)")
                return self.hub.reply(client, p.Ack(op="abort", id=cmd.id))
            case p.ClearPrefixCache() if "clear_prefix_cache" in self.supports:
                return self._clear_prefix_cache(cmd, client)
        raise p.CommandError("unsupported", _UNSUPPORTED.get(cmd.__struct_config__.tag, "vLLM cannot do this"))

    # ------------------------------------------------------------------ events
    def _queue(self, events: list[p.Event]) -> None:
        """The engine core's thread, under the observer's lock: hand the batch to the loop (at most
        MAX_QUEUED_BATCHES wait: a loop that far behind gets a snapshot in their place)."""
        if len(self.batches) >= MAX_QUEUED_BATCHES:
            self.dropped_batches += len(self.batches)
            self.batches.clear()
            self.observer.prompts.clear()  # the prompts of requests whose `request_added` was dropped
            self.observer.diverged = True
        self.batches.append(events)
        if self.observer.diverged:
            self._resync_due = True
        if not self._flush_due:
            self._flush_due = True
            self.hub.call(self._flush)

    def _flush(self) -> None:
        with self.observer.lock:
            self._flush_due = False
        self._publish_queued()
        if self._resync_due:
            self._resync_due = False
            self.hub.deliver_snapshot(self._snapshot(rebase=True), everyone=True)

    def _snapshot(self, rebase: bool = False):
        """The pool after every event published so far: copied under the observer's lock, built
        on the hub's worker (a callable), or here when the diffs must start again from it (rebase)."""
        with self.observer.lock:
            self._publish_queued()
            rebase = rebase or self.observer.diverged
            captured = self.observer.capture()
            if rebase:
                state = build(self.config, captured)
                self.observer.rebase(state)
        if rebase:  # the texts of sequences whose `finish` a dropped queue took
            self.texts = {k: v for k, v in self.texts.items() if k in state.seqs}
        texts = {seq_id: t.text for seq_id, t in self.texts.items()}

        def pool() -> PoolState:
            out = state if rebase else build(self.config, captured)
            for seq_id, s in out.seqs.items():
                if (text := texts.get(seq_id)) is not None:
                    s.text = text
            return out
        return pool() if rebase else pool

    def _publish_queued(self) -> None:
        while self.batches:
            events = self.batches.popleft()
            self._add_text(events)
            self._accept(events)
            self.hub.publish_events(events)

    def _add_text(self, events: list[p.Event]) -> None:
        """Text of each sampled token (vLLM detokenizes in its API server, not here)."""
        prompts = self.observer.prompts
        for ev in events:
            if isinstance(ev, p.RequestAdded):
                ids = list(prompts.pop(ev.seq_id, ()))
                self.texts[ev.seq_id] = _Text(ids, Detokenizer.after_prompt(len(ids)))
            elif isinstance(ev, p.Append) and ev.token_ids and (t := self.texts.get(ev.seq_id)):
                t.ids.extend(ev.token_ids)
                if self.tokenizer is not None:
                    ev.text = t.detok.step(self.tokenizer, t.ids)
                    t.text += ev.text
            elif isinstance(ev, p.Finish):
                self.texts.pop(ev.seq_id, None)

    def _load_tokenizer(self) -> None:
        try:
            from transformers import AutoTokenizer

            mc = self.vllm_config.model_config
            self.tokenizer = AutoTokenizer.from_pretrained(mc.tokenizer, revision=mc.tokenizer_revision,
                                                           trust_remote_code=mc.trust_remote_code)
        except Exception as e:  # text is a nicety: the pool is what the plugin is for
            log.warning("kvscope: no tokenizer (%s); appends carry token ids without text", e)

    def _detached(self, why: str) -> None:
        """The engine core's thread: a hook failed and the observer took every hook out. Said once,
        in vLLM's log and to every client (closed with the reason); no new client is taken."""
        print(f"[kvscope] {why}: the plugin detached from vLLM, which runs on unobserved", file=sys.stderr,
              flush=True)
        self.batches.clear()
        if self.hub is not None and self.hub.loop is not None:
            self.hub.call(lambda: self.hub.loop.create_task(self._close_all(f"{why}; vLLM runs on, unobserved")))

    async def _close_all(self, why: str) -> None:
        reason = why.encode()[:120].decode(errors="ignore")  # a close reason holds 123 bytes
        await asyncio.gather(*(c.ws.close(CLOSE_INTERNAL_ERROR, reason) for c in list(self.hub.clients)),
                             return_exceptions=True)
        if self.stop_serving is not None:
            self.stop_serving()

    # ------------------------------------------------------------------ its API server
    async def _watch_parent(self, pid: int) -> None:
        while os.getppid() == pid:
            await asyncio.sleep(PARENT_POLL_S)
        await self._orphaned(f"vLLM's API server (pid {pid}) died")

    async def _orphaned(self, why: str) -> None:
        print(f"[kvscope] {why}: this engine core is an orphan that can take no request; "
              "closing its clients and stopping it", file=sys.stderr, flush=True)
        self.forwarder.fail_all(why)
        clients = list(self.hub.clients)
        for _ in range(int(FLUSH_S / 0.05)):  # the errors just queued, sent first
            if not any(c.outbox or c.sending for c in clients):
                break
            await asyncio.sleep(0.05)
        reason = why.encode()[:120].decode(errors="ignore")  # a close reason holds 123 bytes
        await asyncio.gather(*(c.ws.close(CLOSE_GOING_AWAY, reason) for c in clients), return_exceptions=True)
        if self.stop_serving is not None:  # no new client finds it live meanwhile
            self.stop_serving()
        killer = threading.Timer(ORPHAN_EXIT_S, os.kill, (os.getpid(), signal.SIGKILL))
        killer.daemon = True
        killer.start()
        os.kill(os.getpid(), signal.SIGTERM)

    # ------------------------------------------------------------------ commands
    def _submit(self, cmd: p.Submit, client: Client) -> None:
        if self.forwarder.gone:
            raise p.CommandError("busy", f"{self.forwarder.gone}: this engine takes no more requests")
        rid = cmd.request_id or self._fresh_id()
        if rid in self.forwarder.live or any(request_group(s) == rid for s in self.texts):
            raise p.CommandError("duplicate_id", f"request {rid!r} is still running; "
                                 "pick another request_id or leave it out")

        def refused(code: p.ErrorCode, message: str) -> None:
            self.hub.reply(client, p.Error(code=code, message=message, op="submit", id=cmd.id))

        def accepted(seq_ids: list[str]) -> None:
            self.hub.reply(client, p.Ack(op="submit", id=cmd.id, request_id=rid, seq_ids=seq_ids))

        self.forwarder.submit(cmd, rid, Submission(rid, cmd.n, refused, accepted))

    def _accept(self, events: list[p.Event]) -> None:
        """Ack a submission once vLLM queued all its samples (their ids are vLLM's)."""
        live = self.forwarder.live
        for ev in events:
            if isinstance(ev, p.RequestAdded) and (sub := live.get(ev.request_id)) and not sub.accepted:
                sub.seq_ids.append(ev.seq_id)
                if len(sub.seq_ids) == sub.n:
                    sub.accepted = True
                    sub.on_accept(sorted(sub.seq_ids))

    def _fresh_id(self) -> str:
        while True:
            self._next_id += 1
            rid = f"r{self._next_id}"
            if rid not in self.forwarder.live:
                return rid

    def _clear_prefix_cache(self, cmd: p.ClearPrefixCache, client: Client) -> None:
        async def run() -> None:
            try:
                ok = await self.forwarder.post("/reset_prefix_cache")
            except Exception as e:
                return self.hub.reply(client, p.Error(code="busy", message=str(e), op="clear_prefix_cache",
                                                      id=cmd.id))
            self.hub.reply(client, p.Ack(op="clear_prefix_cache", id=cmd.id) if ok else p.Error(
                code="busy", message="vLLM keeps its prefix cache while requests run",
                op="clear_prefix_cache", id=cmd.id))
        self.hub.loop.create_task(run())


_UNSUPPORTED = {
    "step": "vLLM steps on its own; it cannot be stepped from here",
    "pause": "vLLM cannot be paused from here; travel back in time to look at a past step",
    "resume": "vLLM cannot be paused from here",
    "pace": "vLLM runs at its own pace",
    "reset": "vLLM's pool is fixed when it starts (restart vLLM with another --num-gpu-blocks-override "
             "or --block-size); it has no swap space to configure either",
    "clear_prefix_cache": "vLLM resets its prefix cache over HTTP only with VLLM_SERVER_DEV_MODE=1",
}
