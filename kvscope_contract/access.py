"""Who may talk to a KVScope socket: loopback addresses, and (docs/security.md) the checks every
server makes of a request's Origin and Host, so that a web page open in a browser on the same
machine can neither read an engine nor drive it."""
from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
