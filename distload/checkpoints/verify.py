"""``python -m distload verify FOLDER``: every file of a pre-sharded checkpoint against its manifest."""

from __future__ import annotations

import hashlib

from distload.errors import CheckpointError
from distload.loading.manifest import MANIFEST_NAME, Manifest, read_manifest
from distload.loading.sources import Source, open_source


def verify_folder(folder: "str | Source") -> tuple[Manifest | None, list[str]]:
    """Check every file of the manifest (exists, size, a header that loads and names the manifest's
    tensors, SHA-256); ``distload verify`` on the command line.

    Works on a local folder and on an object-store prefix (objects are hashed from ranged reads).

    Args:
        folder: a pre-sharded checkpoint saved by distload.

    Returns:
        The manifest (None where there is none) and the problems found, one message each; no
        problems means every file matches.
    """
    src = open_source(folder)
    manifest = read_manifest(src)
    if manifest is None:
        return None, [f"{src.folder}: no {MANIFEST_NAME}: not a checkpoint saved by distload, or its save "
                      f"did not finish; nothing to verify against"]
    problems = []
    for entry in manifest.files:
        if not src.has_file(entry.name):
            problems.append(f"{entry.name} (rank {entry.rank}): missing")
            continue
        size = src.file_size(entry.name)
        if size != entry.size:
            problems.append(f"{entry.name} (rank {entry.rank}): {size} bytes, the manifest says {entry.size}")
            continue
        # OK must mean loadable: the header by the loader's own rules (every value, tensors back to
        # back, covering the data), and the tensors the manifest lists for the file.
        try:
            info = src.read_headers([src.path(entry.name)])[0]
        except CheckpointError as exc:
            problems.append(f"{entry.name} (rank {entry.rank}): its header does not load: {exc}")
            continue
        names = sorted(t.name for t in info.tensors)
        if entry.tensors and names != sorted(entry.tensors):
            extra, lacking = sorted(set(names) - set(entry.tensors)), sorted(set(entry.tensors) - set(names))
            problems.append(f"{entry.name} (rank {entry.rank}): its header names other tensors than the manifest "
                            f"(not in the manifest: {extra[:5]}; missing from the file: {lacking[:5]})")
            continue
        hasher = hashlib.sha256()
        for chunk in src.iter_chunks(entry.name):
            hasher.update(chunk)
        digest = hasher.hexdigest()
        if digest != entry.sha256:
            problems.append(f"{entry.name} (rank {entry.rank}): SHA-256 {digest[:16]}... differs from the "
                            f"manifest's {entry.sha256[:16]}...: the file was changed or corrupted")
    return manifest, problems
