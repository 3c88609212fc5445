"""The terminal dashboard (textual): `flare dashboard --engine ADDR`, and `flare run` on a terminal.

view.py derives what to show from telemetry snapshots, panes.py renders it, app.py is the textual app and its two
entry points, relay.py keeps the supervisor's children from writing over the screen. Nothing here imports textual
at package import, so the supervisor pays for it only when it shows the dashboard.
"""
