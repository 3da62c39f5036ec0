"""Which checkpoint a starting shard restores: the manifests under the checkpoint directory,
parsed, checked and grouped into restore plans.

A starting shard ``i`` of ``M`` restores the newest (by the manifest time of the parts it reads) of

* complete checkpoints: every shard ``0..n-1`` of the writing job wrote its manifest, and
* this shard's own part of a checkpoint written by a job with the same shard count ``M``:
  with the same partition a shard's part holds every row it owns, so it is enough alone. This
  is what lets one shard restarted after SIGTERM or a crash (and shards on Kubernetes, whose
  volumes each hold one shard's parts) resume from their latest part even when the other
  shards did not write that id.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

from tether.server.checkpoints.checkpoint_files import CHECKSUM, FORMAT, ID_PATTERN, Manifest, RestorePlan, manifest_checksum

__all__ = ["choose_restore", "complete_checkpoints", "layout_drift", "list_manifests", "restore_candidates"]

log = logging.getLogger(__name__)

_PART = re.compile(r"shard-(\d+)-of-(\d+)\.manifest\.json")


def _parse_manifest(path: Path) -> Manifest | None:
    m = _PART.fullmatch(path.name)
    if m is None:
        return None
    try:
        doc = json.loads(path.read_text())
        if not isinstance(doc, dict):
            raise ValueError("not a JSON object")
        recorded, actual = doc.get("checksum"), manifest_checksum(doc)
        if recorded != actual:
            log.warning(
                "ignoring checkpoint manifest %s: checksum mismatch: it records %s, its contents have %s",
                path, recorded if recorded is not None else "no checksum", actual,
            )
            return None
        data_path = path.parent / str(doc["data"]["file"])
        data_checksum = str(doc["data"]["checksum"])
        if not data_checksum.startswith(f"{CHECKSUM}:"):
            raise ValueError(f"data checksum {data_checksum!r} is not {CHECKSUM}:<hex>")
        manifest = Manifest(
            id=str(doc["id"]),
            shard_index=int(doc["shard_index"]),
            num_shards=int(doc["num_shards"]),
            created=float(doc["created"]),
            path=path,
            data_path=data_path,
            data_bytes=int(doc["data"]["bytes"]),
            data_checksum=data_checksum,
        )
        ok = (
            doc.get("format") == FORMAT
            and manifest.id == path.parent.name
            and (manifest.shard_index, manifest.num_shards) == (int(m.group(1)), int(m.group(2)))
            and 0 <= manifest.shard_index < manifest.num_shards
            and data_path.parent == path.parent
            and data_path.stat().st_size == manifest.data_bytes
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("ignoring checkpoint manifest %s: %s", path, exc)
        return None
    if not ok:
        log.warning("ignoring checkpoint manifest %s: it does not match its folder, name or data file", path)
        return None
    return manifest


def list_manifests(root: Path) -> list[Manifest]:
    """Every valid manifest under ``root`` (a part whose data file is missing or short is left out)."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = []
    for folder in sorted(root.iterdir()):
        if not folder.is_dir() or not ID_PATTERN.fullmatch(folder.name):
            continue
        for path in sorted(folder.glob("shard-*-of-*.manifest.json")):
            manifest = _parse_manifest(path)
            if manifest is not None:
                out.append(manifest)
    return out


def restore_candidates(manifests: list[Manifest], shard_index: int, num_shards: int) -> list[RestorePlan]:
    groups: dict[tuple[str, int], dict[int, Manifest]] = {}
    for m in manifests:
        groups.setdefault((m.id, m.num_shards), {})[m.shard_index] = m
    plans = []
    for (ckpt_id, n), parts in groups.items():
        own = parts.get(shard_index) if n == num_shards else None
        if set(parts) == set(range(n)):
            # With the same partition the own part alone holds every row this shard owns, as they
            # were when this shard wrote it: that is how new it is, however late another shard
            # wrote its part (one stopped, or down and back, when the shards were asked). Read
            # onto another shard count, every part is: as new as the last of them.
            chosen = (own,) if own is not None else tuple(parts[j] for j in range(n))
            plans.append(RestorePlan(ckpt_id, chosen, True, max(p.created for p in chosen)))
        elif own is not None:
            plans.append(RestorePlan(ckpt_id, (own,), False, own.created))
    plans.sort(key=lambda p: (p.created, p.id), reverse=True)
    return plans


def complete_checkpoints(root: Path) -> list[RestorePlan]:
    """Checkpoints under ``root`` that every shard of their job wrote, newest first (what an
    export of the whole model reads)."""
    return restore_candidates(list_manifests(root), 0, 1)


def choose_restore(root: Path, shard_index: int, num_shards: int) -> RestorePlan | None:
    """The checkpoint shard ``shard_index`` of ``num_shards`` restores (see the module doc)."""
    plans = restore_candidates(list_manifests(root), shard_index, num_shards)
    return plans[0] if plans else None


def layout_drift(manifests: list[Manifest], plans: list[RestorePlan], root: Path, shard_index: int, num_shards: int) -> tuple[str, bool]:
    """What a shard restarted with another shard count than its newest checkpoint's would miss:
    ``(one line, refuse)``; ``("", False)`` when nothing.

    Parts written by an ``n``-shard job (``n`` != ``num_shards``) that are newer than the
    checkpoint this shard would restore, and that it cannot use (no complete set of them), hold
    state the shard would come back without. With no checkpoint to restore, or only an older one
    of its own shard count, that is config drift and the shard refuses (``refuse`` True): it
    would otherwise start empty, or older, and serve that. Restoring a complete checkpoint of
    another shard count onto this one is the way to change the shard count; newer parts it
    leaves out are only reported.
    """
    best = plans[0] if plans else None
    newer = [m for m in manifests if m.num_shards != num_shards and (best is None or m.created > best.created)]
    if not newer:
        return "", False
    newest = max(newer, key=lambda m: (m.created, m.id))
    have = sorted(m.shard_index for m in newer if (m.id, m.num_shards) == (newest.id, newest.num_shards))
    if best is None or best.parts[0].num_shards == num_shards:
        older = f"; its own newest, {best.id}, is older" if best is not None else ""
        return (
            f"shard {shard_index} of {num_shards}: the newest checkpoint under {root}, {newest.id}, was written by "
            f"{newest.num_shards} shards, not {num_shards}, and only part(s) {have} of its {newest.num_shards} are here{older}: "
            f"start the shard with --num-shards {newest.num_shards}, or, to restore it onto {num_shards} shards, put every part "
            f"of one checkpoint of that job in {root}"
        ), True
    left_out = ", ".join(sorted({f"{m.id} (shard {m.shard_index} of {m.num_shards})" for m in newer}))
    return (
        f"restoring {best.id}, written by {best.parts[0].num_shards} shards, onto {num_shards}: newer parts under {root} that "
        f"are not a complete checkpoint are left out, and the updates in them with them: {left_out}"
    ), False
