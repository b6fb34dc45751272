"""A checkpoint's manifest: every file it holds with its size (and a sha256 of the small ones), written
last, checked before loading, so a truncated or damaged checkpoint is named by its file before any rank
reads it.

Sizes catch truncation (a full disk, a copy cut short); the hash catches damage in files up to
``HASHED_BYTES`` (DCP's ``.metadata``, the loop state, dataloader positions). Large tensor shards are not
hashed: reading terabytes at every load would cost more than it saves.
"""

from __future__ import annotations

import hashlib
import json
import os

MANIFEST_FILE = "manifest.json"
HASHED_BYTES = 64 * 1024 * 1024


class ManifestMismatch(ValueError):
    """A file of the checkpoint is missing or differs from what was written; one line naming it."""


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _files(root: str) -> list[str]:
    out = []
    for folder, _, names in os.walk(root):
        out += [os.path.relpath(os.path.join(folder, n), root) for n in names if n != MANIFEST_FILE]
    return sorted(out)


def write_manifest(root: str) -> None:
    """List every file under ``root`` in ``root/manifest.json`` (call once everything is written)."""
    entries = {}
    for rel in _files(root):
        path = os.path.join(root, rel)
        size = os.path.getsize(path)
        entries[rel] = {"size": size, "sha256": _sha256(path) if size <= HASHED_BYTES else None}
    with open(os.path.join(root, MANIFEST_FILE), "w") as f:
        json.dump({"files": entries}, f, indent=1)


def check_manifest(root: str) -> None:
    """Raise ``ManifestMismatch`` naming the first file that is missing, has another size or other contents.

    A checkpoint written before manifests existed (no ``manifest.json``) passes."""
    path = os.path.join(root, MANIFEST_FILE)
    if not os.path.exists(path):
        return
    try:
        with open(path) as f:
            entries = json.load(f)["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ManifestMismatch(f"{path}: unreadable ({type(e).__name__})") from None
    for rel, entry in sorted(entries.items()):
        file = os.path.join(root, rel)
        if not os.path.isfile(file):
            raise ManifestMismatch(f"{file}: missing")
        size = os.path.getsize(file)
        if size != entry["size"]:
            raise ManifestMismatch(f"{file}: {size} bytes, {entry['size']} were written")
        if entry.get("sha256") and _sha256(file) != entry["sha256"]:
            raise ManifestMismatch(f"{file}: contents differ from what was written")
