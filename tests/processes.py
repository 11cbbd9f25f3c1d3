"""Processes seen from /proc, for the tests that check what dies with what."""
from __future__ import annotations

import os
import socket
import struct
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


def listening(pids: set[int]) -> list[tuple[str, int]]:
    """The (address, port) of every TCP socket these processes listen on, read from /proc as `ss
    -ltn` does: each one's socket inodes, looked up in /proc/net/tcp and tcp6 (state 0A: LISTEN)."""
    inodes = set()
    for pid in pids:
        try:
            for fd in (Path("/proc") / str(pid) / "fd").iterdir():
                try:
                    if (target := os.readlink(fd)).startswith("socket:["):
                        inodes.add(target[8:-1])
                except OSError:
                    pass
        except OSError:
            pass
    out = []
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in (Path("/proc/net") / table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:
                raw, port = fields[1].split(":")
                # the kernel prints each 32-bit word of the address in host (little-endian) order
                packed = b"".join(struct.pack("<I", int(raw[i:i + 8], 16)) for i in range(0, len(raw), 8))
                out.append((socket.inet_ntop(family, packed), int(port, 16)))
    return out
