"""The W&B API key file: read in-process only, checked before anything is planned or submitted.

Pure (no wandb import), so a dry run checks the key file as a launch does. Errors name the file, never
its content.
"""

from __future__ import annotations

import os
from pathlib import Path

from hp_tool.config import WandbConfig
from hp_tool.errors import ConfigError

KEY_FIX = ("put the API key on the first line of a file only you can read (chmod 600) and pass "
           "wandb.api_key_file=<path>; or set WANDB_MODE=offline to write runs locally")
OFFLINE_MODES = ("offline", "dryrun", "disabled")


def offline() -> bool:
    """True when WANDB_MODE asks for no server (then no API key is needed)."""
    return os.environ.get("WANDB_MODE", "").lower() in OFFLINE_MODES


def read_api_key(cfg: WandbConfig) -> str:
    """The first line of ``cfg.api_key_file``, stripped."""
    path = cfg.api_key_file
    if not path:
        raise ConfigError("wandb.api_key_file", path, "is not set and W&B needs an API key", KEY_FIX)
    try:
        lines = Path(path).expanduser().read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError("wandb.api_key_file", path, f"cannot be read ({type(exc).__name__})",
                          KEY_FIX) from None  # from None: keep file content out of tracebacks
    key = lines[0].strip() if lines else ""
    if not key:
        raise ConfigError("wandb.api_key_file", path, "is empty; the key goes on its first line", KEY_FIX)
    return key


def check_key_file(cfg: WandbConfig) -> None:
    """With W&B enabled and online, the key file exists and its first line is not empty."""
    if cfg.enable and not offline():
        read_api_key(cfg)
