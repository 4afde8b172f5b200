"""Paths of the machine that ran the matrix never reach the document: each known prefix becomes a label."""

from __future__ import annotations

import os
import re
import sys
import tempfile
from pathlib import Path

from . import ROOT


class Scrubber:
    """Replaces registered path prefixes by labels (``<repo>``, ``<venv>``, ...), then any absolute path left."""

    def __init__(self) -> None:
        self.pairs: list[tuple[str, str]] = []
        self.add(str(ROOT), "<repo>")
        self.add(sys.base_prefix, "<python>")
        self.add(sys.prefix, "<python>")
        self.add(tempfile.gettempdir(), "<tmp>")
        self.add(str(Path.home()), "~")

    def add(self, path: str, label: str) -> None:
        path = str(path).rstrip("/")
        if len(path) <= 1 or (path, label) in self.pairs:
            return
        self.pairs.append((path, label))
        try:
            real = os.path.realpath(path)
            if real != path and (real, label) not in self.pairs:
                self.pairs.append((real, label))
        except OSError:
            pass
        self.pairs.sort(key=lambda p: -len(p[0]))  # longest (most specific) first

    def __call__(self, text: str) -> str:
        for path, label in self.pairs:
            text = text.replace(path, label)
        # Anything absolute that is left: keep what follows site-packages / the stdlib, drop the rest.
        text = re.sub(r"(?<![\w.<>~])/(?:[^\s\"':,()]+/)*site-packages/", "<site-packages>/", text)
        text = re.sub(r"(?<![\w.<>~])/(?:[^\s\"':,()]+/)*lib/python3\.\d+/", "<stdlib>/", text)
        text = re.sub(r"(?<![\w.<>~])/(?:[A-Za-z0-9_.@+-]+/){2,}", "<path>/", text)
        return text


SCRUB = Scrubber()
