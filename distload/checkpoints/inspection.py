"""``python -m distload inspect SOURCE``: what a checkpoint holds, from its headers alone."""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

from distload.loading.index import build_index
from distload.loading.layout import detect_layout
from distload.loading.sources import source_string, whole_checkpoint


def inspect_source(source: "str | os.PathLike[str]", pattern: str | None = None) -> dict[str, Any]:
    """Files, tensors, bytes, dtypes and the detected layout (whole, or sharded for N ranks), from
    the headers alone; ``distload inspect`` on the command line.

    Args:
        source: a local file or folder, or an object-store URI (headers by ranged reads).
        pattern: the shard file-name pattern to look for (default: the manifest's, else the
            default pattern).

    Returns:
        A JSON-ready dict: ``layout``, ``files``, ``num_tensors``, ``nbytes``, ``dtypes``,
        ``largest_tensor`` and ``tensors`` (each one's name, dtype, shape, bytes and file).
    """
    source = source_string(source)
    layout = detect_layout(source, pattern)
    src, manifest = layout.source, layout.manifest
    if layout.sharded:
        names = [f.name for f in manifest.files] if manifest else layout.shards.names()
        infos = src.read_headers([src.path(name) for name in names])
        ranks = sorted({f.rank for f in manifest.files}) if manifest else layout.shards.ranks
        kind = {"layout": "sharded", "saved_world_size": layout.saved_world_size,
                "ranks_found": ranks, "pattern": layout.pattern, "manifest": manifest is not None,
                "expert_parallel": manifest.expert_parallel if manifest else None}
        tensors = [t for info in infos for t in info.tensors]
    else:
        files, _ = whole_checkpoint(src)
        index = build_index(src.read_headers(files))
        infos = list(index.files)
        kind = {"layout": "whole", "manifest": False}
        tensors = index.tensors
    dtypes = Counter()
    dtype_bytes: Counter = Counter()
    for t in tensors:
        dtypes[t.dtype] += 1
        dtype_bytes[t.dtype] += t.nbytes
    return {
        "source": source, **kind,
        "files": [{"path": info.path, "size": info.size, "num_tensors": len(info.tensors),
                   "nbytes": info.nbytes, "metadata": info.metadata} for info in infos],
        "num_tensors": len(tensors),
        "nbytes": sum(t.nbytes for t in tensors),
        "dtypes": {code: {"num_tensors": dtypes[code], "nbytes": dtype_bytes[code]} for code in sorted(dtypes)},
        "largest_tensor": max(((t.name, t.nbytes) for t in tensors), key=lambda x: x[1], default=None),
        # Every tensor, in file order: its shape as torch holds it (what a load gives back).
        "tensors": [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "nbytes": t.nbytes,
                     "file": info.path} for info in infos for t in info.tensors],
    }


def summary_lines(info: dict[str, Any], tensors: bool = True) -> list[str]:
    """What ``distload inspect`` prints: the layout, totals by dtype, the files, then (unless
    ``tensors`` is False) every tensor's name, dtype and shape, one a line, by name."""
    if info["layout"] == "sharded":
        layout = (f"pre-sharded for {info['saved_world_size']} rank(s) (pattern {info['pattern']!r}, "
                  f"{'with' if info['manifest'] else 'without'} a distload manifest)")
        experts = info.get("expert_parallel")
        if experts:  # rank r = ep_rank * T + tp_rank: say so, as a load must match it
            layout += (f", tensor-parallel size {experts['tensor_parallel_size']} x expert-parallel size "
                       f"{experts['size']} ({experts['placement']} placement of {experts['num_experts']} experts)")
    else:
        layout = "whole (every rank needs every tensor)"
    lines = [f"{info['source']}: {layout}",
             f"  {len(info['files'])} file(s), {info['num_tensors']} tensors, {info['nbytes'] / 2**30:.3f} GiB"]
    for code, d in info["dtypes"].items():
        lines.append(f"  {code:8} {d['num_tensors']:6} tensors {d['nbytes'] / 2**30:10.3f} GiB")
    if info["largest_tensor"]:
        name, nbytes = info["largest_tensor"]
        lines.append(f"  largest tensor: {name} ({nbytes / 2**20:.1f} MiB)")
    for f in info["files"]:
        lines.append(f"  {f['path']}: {f['num_tensors']} tensors, {f['size']} bytes")
        if f["metadata"]:
            lines.append("    metadata: " + ", ".join(f"{k}={v}" for k, v in sorted(f["metadata"].items())))
    if tensors and info["tensors"]:
        width = max(len(t["name"]) for t in info["tensors"])
        lines.append(f"  tensors (name, dtype, shape), {len(info['tensors'])}:")
        several_files = len(info["files"]) > 1
        for t in sorted(info["tensors"], key=lambda t: t["name"]):  # by name: where a reader looks
            shape = "[" + ", ".join(map(str, t["shape"])) + "]"
            where = f"  {t['file'].rsplit('/', 1)[-1]}" if several_files else ""
            lines.append(f"    {t['name']:{width}}  {t['dtype']:8} {shape}{where}")
    return lines
