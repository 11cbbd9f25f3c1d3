"""A ZMQ KV-event stream as vLLM's ZmqEventPublisher sends it (PUB batches and a ROUTER that
replays them), and the events it carries, for the KV-event tests with and without vLLM."""
from __future__ import annotations

import threading

import msgspec
import zmq

from kvscope_contract.ready import free_ports


pack = msgspec.msgpack.encode


def stored_map(hashes, parent=None, tokens=None, size=2, medium="GPU"):
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": tokens if tokens is not None else list(range(size * len(hashes))),
            "block_size": size, "lora_id": None, "medium": medium}


def frames(seq: int, events, ts: float = 1.0, topic: bytes = b"") -> list[bytes]:
    return [topic, seq.to_bytes(8, "big"), pack([ts, events, 0])]


class Publisher:
    """vLLM's ZmqEventPublisher on the wire: PUB [topic, seq, payload], and a ROUTER that
    replays buffered batches from a sequence number, then an end marker."""

    def __init__(self, topic: bytes = b"kv"):
        self.ctx = zmq.Context()
        self.pub, self.router = self.ctx.socket(zmq.PUB), self.ctx.socket(zmq.ROUTER)
        self.port, self.replay_port = free_ports(2)
        self.pub.bind(f"tcp://127.0.0.1:{self.port}")
        self.router.bind(f"tcp://127.0.0.1:{self.replay_port}")
        self.topic, self.buffer, self.stop = topic, [], threading.Event()
        self.thread = threading.Thread(target=self._serve_replay, daemon=True)
        self.thread.start()

    def send(self, seq: int, events, raw: list[bytes] | None = None) -> None:
        msg = raw or frames(seq, events, topic=self.topic)
        self.buffer.append(msg)
        self.pub.send_multipart(msg)

    def _serve_replay(self) -> None:
        while not self.stop.is_set():
            if self.router.poll(50):
                client, _, start = self.router.recv_multipart()
                for msg in self.buffer:
                    if int.from_bytes(msg[1], "big") >= int.from_bytes(start, "big"):
                        self.router.send_multipart([client, b"", *msg])
                self.router.send_multipart([client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.pub.close(0)
        self.router.close(0)
        self.ctx.term()
