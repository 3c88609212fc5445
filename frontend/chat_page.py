"""The browser chat page (README "Chat"): static files from frontend/static/ served at `/` and `/static/`.

The page loads without an API key (server.py's guard leaves these paths open); its API calls carry the key the user
typed. The Content-Security-Policy keeps it to its own origin: no CDN, no script or connection anywhere else.
"""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

STATIC_DIR = Path(__file__).with_name("static")
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data: blob:; connect-src 'self'; "
                               "script-src 'self'; style-src 'self'; base-uri 'none'; form-action 'none'; "
                               "frame-ancestors 'none'",
    "Cache-Control": "no-cache",
}


async def index(_request: web.Request) -> web.FileResponse:
    return web.FileResponse(STATIC_DIR / "index.html", headers=PAGE_HEADERS)


def add_routes(app: web.Application) -> None:
    app.router.add_get("/", index)
    app.router.add_static("/static/", STATIC_DIR)
