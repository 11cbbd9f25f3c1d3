"""Processes seen from /proc, for the tests that check what dies with what."""
from __future__ import annotations

from pathlib import Path


def children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d.name))
        except (OSError, IndexError, ValueError):
            pass
    return out


def descendants(pid: int) -> set[int]:
    """Every process below `pid`: its children, theirs, ..."""
    out, todo = set(), [pid]
    while todo:
        kids = children(todo.pop())
        out.update(kids)
        todo += kids
    return out


def alive(pid: int) -> bool:
    """Running: not gone, not a zombie nobody reaped (a container without an init)."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
