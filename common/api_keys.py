"""Where an API key comes from: --api-key on the user's own command line, --api-key-file, or FLARE_API_KEY. Flare
hands a key to the processes it starts only through their environment: a command line is readable by every user of
the host (`ps`, /proc/PID/cmdline)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

API_KEY_ENV = "FLARE_API_KEY"


class ApiKeyError(Exception):
    pass


def add_api_key_flags(parser: argparse.ArgumentParser, purpose: str) -> None:
    parser.add_argument("--api-key", help=f"{purpose} (visible to other users in `ps`: prefer --api-key-file or "
                                          f"${API_KEY_ENV})")
    parser.add_argument("--api-key-file", type=Path, help="a file holding the API key (its first line)")


def api_key(args: argparse.Namespace) -> str | None:
    """--api-key, else --api-key-file's first line, else $FLARE_API_KEY; None when none is set."""
    if args.api_key:
        return args.api_key
    if args.api_key_file is not None:
        try:
            lines = args.api_key_file.read_text().splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise ApiKeyError(f"cannot read --api-key-file {args.api_key_file}: {exc}") from None
        if not lines or not lines[0].strip():
            raise ApiKeyError(f"--api-key-file {args.api_key_file} is empty")
        return lines[0].strip()
    return os.environ.get(API_KEY_ENV) or None


def key_environment(key: str | None, base: dict[str, str] | None = None) -> dict[str, str]:
    """A child's environment carrying `key` as FLARE_API_KEY (none: the variable is removed)."""
    env = dict(os.environ if base is None else base)
    env.pop(API_KEY_ENV, None)
    if key:
        env[API_KEY_ENV] = key
    return env
