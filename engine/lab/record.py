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
    events = lab.log.drain()
    with open(path, "wb") as f:
        for msg in [p.Hello(engine=ENGINE, config=lab.pool), start]:
            f.write(p.encode(msg) + b"\n")
        for _, batch in groupby(events, key=lambda e: e.step):
            batch = list(batch)
            for ev in batch:
                ev.t = round(ev.step * STEP_S, 3)
            f.write(p.encode(p.Events(events=batch)) + b"\n")
    return len(events)
