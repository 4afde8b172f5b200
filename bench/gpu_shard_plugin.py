"""pytest plugin of ``bench/gpu_cudagraph_trees.sh``: run one shard of a test file.

``GPU_SHARD=k/n`` keeps the collected tests whose position in collection order is ``k`` modulo ``n``
(round robin, so each shard gets a share of every test class) and deselects the rest; without the variable
nothing changes. Both modes run the same shards, so a test's neighbours are the same with and without the
package. Loaded with ``-p gpu_shard_plugin`` (the directory holding this file on ``PYTHONPATH``).
"""

from __future__ import annotations

import os
from typing import Any


def _shard() -> tuple[int, int] | None:
    spec = os.environ.get("GPU_SHARD", "")
    if not spec:
        return None
    k, n = (int(v) for v in spec.split("/"))
    if not 0 <= k < n:
        raise ValueError(f"GPU_SHARD={spec!r}: need 0 <= k < n")
    return k, n


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    shard = _shard()
    if shard is None:
        return
    k, n = shard
    keep = [it for i, it in enumerate(items) if i % n == k]
    drop = [it for i, it in enumerate(items) if i % n != k]
    if drop:
        config.hook.pytest_deselected(items=drop)
    items[:] = keep
