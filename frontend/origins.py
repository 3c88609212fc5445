"""Which Host names and browser origins a frontend serves (docs/design.md, Trust boundaries).

Any web page can send a request to a server on 127.0.0.1 (a `text/plain` POST needs no preflight), and with DNS
rebinding (a name of the page's that resolves to 127.0.0.1) read the reply. So, as Ollama does: bound to loopback,
a frontend serves only loopback Host names (a rebinding page's requests carry its own name); and a request from a
browser page of another origin (its Origin header) is refused unless that page is on loopback too or
`--allowed-origins` names its origin; allowed pages get CORS preflights answered and replies that carry
Access-Control-Allow-Origin. The chat page is served from the frontend itself, so its requests are same-origin.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from urllib.parse import urlsplit

from aiohttp import web

from common.errors import Forbidden

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
PREFLIGHT_MAX_AGE = "600"


def is_loopback(host: str) -> bool:
    """A host name or address (no port, no brackets) that only reaches this machine."""
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_name(host_header: str) -> str:
    """The name in a Host header, without its port and an IPv6 address's brackets."""
    if host_header.startswith("["):
        return host_header[1:host_header.find("]")] if "]" in host_header else host_header
    return host_header.rsplit(":", 1)[0] if host_header.count(":") == 1 else host_header


@dataclass(frozen=True)
class OriginPolicy:
    loopback_only: bool  # the frontend listens on a loopback address
    allowed: frozenset[str] = frozenset()  # --allowed-origins: "scheme://host[:port]" each, or "*"

    @classmethod
    def for_listener(cls, host: str, allowed_origins: str) -> OriginPolicy:
        allowed = frozenset(o.strip().rstrip("/").lower() for o in allowed_origins.split(",") if o.strip())
        return cls(is_loopback(host), allowed)

    def check_host(self, request: web.Request) -> None:
        host = request.headers.get("Host")
        if self.loopback_only and host is not None and not is_loopback(host_name(host)):
            raise Forbidden(f"this server listens on loopback and serves only loopback host names (localhost, "
                            f"127.0.0.1, [::1]), not {host[:80]!r}", "listen on another --host to serve other names")

    def cross_origin(self, request: web.Request) -> str | None:
        """The request's Origin when a browser sends it from a page not served by this server, else None."""
        origin = request.headers.get("Origin")
        own = f"{request.scheme}://{request.headers.get('Host', '')}"
        return None if origin is None or origin.lower() == own.lower() else origin

    def allows(self, origin: str) -> bool:
        """Pages on this machine (loopback hosts, any port) and those --allowed-origins names."""
        host = urlsplit(origin).hostname
        return (host is not None and is_loopback(host)) or "*" in self.allowed \
            or origin.rstrip("/").lower() in self.allowed

    def check_origin(self, request: web.Request) -> None:
        origin = self.cross_origin(request)
        if origin is not None and not self.allows(origin):
            raise Forbidden(f"requests from the web page origin {origin[:80]!r} are not allowed",
                            "name it in --allowed-origins to let that page use this server")

    def preflight(self, request: web.Request) -> web.Response:
        """The answer to an allowed origin's CORS preflight (OPTIONS): what it may send."""
        self.check_origin(request)
        headers = {"Access-Control-Allow-Methods": "GET, POST, DELETE, OPTIONS",
                   "Access-Control-Max-Age": PREFLIGHT_MAX_AGE}
        if "Access-Control-Request-Headers" in request.headers:
            headers["Access-Control-Allow-Headers"] = request.headers["Access-Control-Request-Headers"]
        return web.Response(status=204, headers=headers)

    async def add_cors_headers(self, request: web.Request, response: web.StreamResponse) -> None:
        """on_response_prepare: an allowed page of another origin may read the reply (streams too: this runs before
        the headers go out)."""
        origin = self.cross_origin(request)
        if origin is not None and self.allows(origin):
            response.headers["Access-Control-Allow-Origin"] = origin
            response.headers["Vary"] = "Origin"
