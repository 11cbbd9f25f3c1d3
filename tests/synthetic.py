"""The synthetic engine (engine/synthetic.py: the real engine core with random tokens for a
model) as the tests start it: in this process (torch is not imported), or as a server process."""
from __future__ import annotations

from app.link.launcher import ServerProcess
from engine.config import EngineConfig
from engine.synthetic import SyntheticEngine
from kvscope_contract import protocol as p


def synthetic_engine(blocks: int, live: int, fill: float = 0.0, **pool) -> SyntheticEngine:
    cfg = EngineConfig(model="synthetic", max_num_batched_tokens=2048, pool=p.PoolConfig(
        num_device_blocks=blocks, num_host_blocks=pool.pop("host", 1024), max_num_seqs=pool.pop("seqs", 64), **pool))
    engine = SyntheticEngine(cfg, live, prompt_tokens=256, max_tokens=64)
    engine.fill(fill)
    return engine


BS, BLOCKS = 16, 64


def synthetic_server(port: int = 0, step_delay_ms: float = 0) -> ServerProcess:
    """A synthetic engine server of BLOCKS blocks of BS tokens, idle until asked, once it listens
    (on `port`, or a free one), resting `step_delay_ms` after each step."""
    proc = ServerProcess("engine.synthetic",
                         ["--port", str(port), "--num-device-blocks", str(BLOCKS), "--num-host-blocks", "0",
                                             "--block-size", str(BS), "--live", "0", "--fill", "0", "--warm-steps", "0",
                                             "--step-delay-ms", str(step_delay_ms), "--max-num-seqs", "8"]).start()
    assert proc.wait_ready(120), "\n".join(proc.tail(30))
    return proc
