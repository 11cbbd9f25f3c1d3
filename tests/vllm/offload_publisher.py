"""Run by the vLLM virtualenv's Python (tests/vllm/test_offload_events.py): vLLM's own event classes
published by its own ZmqEventPublisher, as a vLLM with native CPU offloading (the OffloadingConnector)
sends them, which the CPU build of vLLM cannot run ("only supported on CUDA-alike and XPU GPUs").

    python offload_publisher.py PORT REPLAY_PORT

The device stores two blocks of a prompt with their tokens; the connector offloads both to the CPU
with its placeholder payload (no tokens, no parent, block size 0: its events are not
self-describing) and announces the second one again (a chunk overlapping a shared prefix
re-announces its shared hashes: consumers reference-count them); the device evicts both; the CPU
tier removes the second once. Prints `published N` and serves replays until stdin closes.
"""
import sys
import time

from vllm.distributed.kv_events import (MEDIUM_CPU, MEDIUM_GPU, BlockRemoved, BlockStored, KVEventBatch,
                                        ZmqEventPublisher)

H1, H2 = 0x1111_2222_3333_4444, 0x5555_6666_7777_8888


def offloaded(hashes: list[int]) -> BlockStored:
    """The connector's store without self-describing events (vLLM's OffloadingEventsTracker placeholder)."""
    return BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=[], block_size=0, lora_id=None,
                       medium=MEDIUM_CPU, lora_name=None, group_idx=0)


BATCHES = [
    [BlockStored(block_hashes=[H1, H2], parent_block_hash=None, token_ids=list(range(32)), block_size=16,
                 lora_id=None, medium=MEDIUM_GPU, lora_name=None, group_idx=0)],
    [offloaded([H1, H2])],
    [offloaded([H2])],
    [BlockRemoved(block_hashes=[H2, H1], medium=MEDIUM_GPU, group_idx=0)],
    [BlockRemoved(block_hashes=[H2], medium=MEDIUM_CPU, group_idx=0)],
]

if __name__ == "__main__":
    port, replay = sys.argv[1:3]
    pub = ZmqEventPublisher(0, endpoint=f"tcp://127.0.0.1:{port}", replay_endpoint=f"tcp://127.0.0.1:{replay}",
                            topic="kv")
    for events in BATCHES:
        pub.publish(KVEventBatch(ts=time.time(), events=events))
    time.sleep(0.5)  # the publisher's thread sends from its queue: every batch is in its replay buffer
    print(f"published {len(BATCHES)}", flush=True)
    sys.stdin.read()
    pub.shutdown()
