"""Subscribe to a ZMQ KV-event stream (vLLM `--kv-events-config`, SGLang, TensorRT-LLM).

    tcp://HOST:5557                       the publisher's PUB socket
    tcp://HOST:5557?topic=kv&replay=tcp://HOST:5558
                                          a topic filter, and vLLM's replay (ROUTER) socket

A daemon thread reads the stream into a KVEventsState. With a replay socket it first asks for
every batch the publisher still buffers, so a late subscriber starts from what is cached.
Frames that cannot be read, batches that cannot be applied and ZMQ errors are counted and said
(`state.errors`); none ends the thread. A publisher that restarts (its batch numbers go back, as
a restarted vLLM's do) is said too: what it cached before is dropped, and the stream is followed
anew (from its replay socket, where there is one).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit

import zmq

from integrations.kv_events.decode import FrameError, decode_frames
from integrations.kv_events.model import KVEventsState

END_SEQ = -1
REPLAY_TIMEOUT_MS = 2000


@dataclass(frozen=True)
class Endpoint:
    pub: str
    topic: str = ""
    replay: str | None = None

    @classmethod
    def parse(cls, url: str) -> Endpoint:
        parts = urlsplit(url)
        if parts.scheme not in ("tcp", "ipc") or not (parts.netloc or parts.path):
            raise ValueError(f"a KV-event endpoint looks like tcp://HOST:5557[?topic=T&replay=tcp://HOST:5558], "
                             f"got {url!r}")
        q = parse_qs(parts.query)
        base = f"{parts.scheme}://{parts.netloc}{parts.path}"
        return cls(base, q.get("topic", [""])[0], q.get("replay", [None])[0])


class KVEventsSubscriber:
    def __init__(self, url: str):
        self.endpoint = Endpoint.parse(url)
        self.url = url
        self.lock = threading.Lock()
        self.state = KVEventsState()
        self.connected_at = time.time()
        self.received_at = 0.0
        self._last_live = -1  # the last batch number heard on the PUB socket
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._thread = threading.Thread(target=self._run, name=f"kvscope-kv-events {url}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt_string(zmq.SUBSCRIBE, self.endpoint.topic)
        sub.connect(self.endpoint.pub)
        try:
            if self.endpoint.replay:
                self._replay(0)
            while not self._stop.is_set():
                try:
                    if sub.poll(100) and self._take(sub.recv_multipart(), live=True) and self.endpoint.replay:
                        self._replay(0)  # a restarted publisher: what it sent before this subscriber heard it
                except zmq.ZMQError as e:  # said, and the stream followed on
                    with self.lock:
                        self.state.bad_frame(f"ZMQ: {e}")
                    self._stop.wait(0.1)
        finally:
            sub.close()

    def _replay(self, start: int) -> None:
        """Ask the ROUTER for buffered batches from `start` on, up to its end marker."""
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoint.replay)
        try:
            sock.send_multipart([b"", start.to_bytes(8, "big")])
            while sock.poll(REPLAY_TIMEOUT_MS):
                frames = sock.recv_multipart()[1:]  # the empty delimiter first
                if len(frames) == 3 and int.from_bytes(frames[1], "big", signed=True) == END_SEQ:
                    return
                self._take(frames)
            with self.lock:
                self.state.bad_frame(f"the replay socket {self.endpoint.replay} did not answer")
        finally:
            sock.close()

    def _take(self, frames: list[bytes], live: bool = False) -> bool:
        """Apply one message; True when it shows the publisher restarted (its numbering went back:
        the state starts over, and this batch waits for the replay where there is one)."""
        try:
            batch = decode_frames(frames)
        except FrameError as e:
            with self.lock:
                self.state.bad_frame(str(e))
            return False
        with self.lock:
            if live and batch.seq >= 0:
                restarted = 0 <= batch.seq < self._last_live  # one publisher's live numbers never go back
                if restarted:
                    self.state.publisher_restarted(self._last_live, batch.seq)
                self._last_live = max(batch.seq, self._last_live) if not restarted else batch.seq
                if restarted and self.endpoint.replay:
                    return True
            if 0 <= batch.seq <= self.state.last_seq:
                return False  # already seen (the replay overlaps the live stream)
            try:
                self.state.apply(batch)
            except Exception as e:  # a batch that decodes but cannot be followed: said, the stream goes on
                self.state.bad_frame(f"batch {batch.seq} could not be applied, skipped "
                                     f"({type(e).__name__}: {e})")
            self.received_at = time.time()
        return False

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=3)
        self._ctx.term()
