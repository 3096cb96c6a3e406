"""Emptying a tier's folder before its server starts (a tier that outlives vLLM's reset, or that its
server indexes at start)."""

from __future__ import annotations

from pathlib import Path


def empty_folder(path: Path) -> None:
    if path.is_dir():
        for child in path.iterdir():
            if child.is_dir() and not child.is_symlink():
                empty_folder(child)
                child.rmdir()
            else:
                child.unlink()
