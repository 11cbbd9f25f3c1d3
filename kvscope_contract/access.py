"""Who may talk to a KVScope socket (docs/security.md): loopback addresses, the tokens a server
requires, and the checks every server makes of a request's Origin and Host, so that a web page
open in a browser on the same machine can neither read an engine nor drive it.

No KVScope page talks to an engine: the dashboard's server does, as do Prometheus and the tools,
none of which sends an Origin. So an engine server (engine.serve, the replay server, the vLLM
plugin) refuses any request that carries one, and, with no token to guard it, any Host that names
no loopback address (a page whose own name was rebound to 127.0.0.1). The live views' lane is the
one socket a page opens: it takes only its own page's Origin."""
from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

# the environment (never argv, which `ps` shows to everyone): the token a server requires of its
# clients (KVSCOPE_TOKEN: control and viewing) and one that only views (events, /metrics, /tokenize)
TOKEN_ENV = "KVSCOPE_TOKEN"
VIEW_TOKEN_ENV = "KVSCOPE_VIEW_TOKEN"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def host_name(host: str) -> str:
    """`name:port`, `[::1]:port` or a bare name: the name, lower case, without brackets."""
    return (urlsplit(f"//{host}").hostname or "").lower()


def engine_refusal(origin: str | None, host: str | None, guarded: bool) -> str | None:
    """Why an engine server refuses a request (None: it does not). `guarded`: a token is required."""
    if origin is not None:
        return f"a web page ({origin}) may not talk to a KVScope server"
    if not guarded and host is not None and not is_loopback(host_name(host)):
        return f"Host {host} is not a loopback address, and this server has no token"
    return None


def lane_refusal(origin: str | None, host: str | None, loopback_only: bool) -> str | None:
    """Why the lane refuses a connection: it serves only the dashboard's own page, whose Origin
    names the host the lane was reached by (another port: Streamlit's)."""
    if origin is None or host is None:
        return "no Origin or Host: not the dashboard's page"
    if host_name(urlsplit(origin).netloc) != host_name(host):
        return f"a page of {origin} may not use this dashboard's lane"
    if loopback_only and not is_loopback(host_name(host)):
        return f"Host {host} is not a loopback address"
    return None
