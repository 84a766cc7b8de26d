"""Small file helpers every layer may use (no rzero imports)."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any


def atomic_write_text(path: Path, text: str) -> None:
    """Write text so that a reader (or a crash) sees the old file or the new one, never a mix:
    a temporary file beside it, fsync, rename."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_toml(path: Path, error: type[Exception] = ValueError, what: str = "config file") -> dict[str, Any]:
    """A TOML file's tables; `error` names a missing file or bad TOML."""
    if not path.is_file():
        raise error(f"{what} {path} does not exist")
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as err:
        raise error(f"{path}: not valid TOML ({err})") from None
