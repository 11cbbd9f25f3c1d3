"""A lab run as a recording (the format of `engine.serve.server --record`), so the dashboard can replay
it: every event of a step-by-step run, paced at `STEP_S` seconds a step."""
from __future__ import annotations

from itertools import groupby
from pathlib import Path

from kvscope_contract import protocol as p
from kvscope_contract.lab import LabConfig
from engine.lab.sim import Lab
from engine.lab.workload import Workload

STEP_S = 0.05
ENGINE = p.EngineInfo(model="lab (outputs replayed, no model)", device="cpu", dtype="none", num_layers=0,
                      num_kv_heads=0, head_dim=0)


def record(config: LabConfig, workload: Workload, path: Path) -> int:
    """Run `workload` under `config` step by step and write it to `path`; returns the events written."""
    lab = Lab(config, workload, keep_events=True)
    start = lab.snapshot()
    lab.run(fast=False)
    return write(path, lab.pool, start, lab.log.drain())


def write(path: Path, config: p.PoolConfig, start: p.Snapshot, events: list[p.AnyEvent]) -> int:
    """A lab's `start` snapshot and `events` as a recording at `path`, a frame a step, each step
    `STEP_S` seconds after the last; returns the events written."""
    with open(path, "wb") as f:
        for msg in [p.Hello(engine=ENGINE, config=config), start]:
            f.write(p.encode(msg) + b"\n")
        for _, batch in groupby(events, key=lambda e: e.step):
            batch = list(batch)
            for ev in batch:
                ev.t = round(ev.step * STEP_S, 3)
            f.write(p.encode(p.Events(events=batch)) + b"\n")
    return len(events)
