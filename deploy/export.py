"""``tether export``: a complete checkpoint (or a live cluster's state) as safetensors files.

The output is what ``tether.worker.serving.load_export`` reads: ``model.safetensors`` with
each table's sorted ids and rows and each dense tensor (its chunks joined in order), and a
``manifest.json`` naming the checkpoint, the tables (rows, dim, optimizer) and the dense
tensors. Optimizer state is left out: serving needs the parameters only.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import torch

from tether.server.checkpoint_files import Manifest, RestorePlan, load_state
from tether.server.restore import complete_checkpoints, list_manifests
from tether.worker.serving import EXPORT_FORMAT, MANIFEST, WEIGHTS

__all__ = ["export_checkpoint"]

log = logging.getLogger(__name__)


def _newest_parts(checkpoint_dir: Path) -> RestorePlan | None:
    """Every shard's newest part, of the shard count of the newest part written.

    Shards name the checkpoint they write at shutdown each on its own, so the job's final
    state is rarely one complete checkpoint id; a shard's part holds every row it owns, so the
    newest part of each shard together are the whole model as the shards last saved it.
    """
    manifests = sorted(list_manifests(checkpoint_dir), key=lambda m: (m.created, m.id), reverse=True)
    if not manifests:
        return None
    n = manifests[0].num_shards
    newest: dict[int, Manifest] = {}
    for m in manifests:
        if m.num_shards == n:
            newest.setdefault(m.shard_index, m)
    if set(newest) != set(range(n)):
        return None
    parts = tuple(newest[i] for i in range(n))
    ids = sorted({p.id for p in parts})
    return RestorePlan("+".join(ids), parts, True, max(p.created for p in parts))


def export_checkpoint(checkpoint_dir: str | Path, out: str | Path, ckpt_id: str | None = None) -> dict[str, Any]:
    """Write checkpoint ``ckpt_id`` of ``checkpoint_dir`` (default: every shard's newest part)
    into the folder ``out``; returns the manifest written.

    Raises:
        ValueError: no complete checkpoint of that id, or (without an id) a shard with no part.
        ChecksumMismatch: a checkpoint file whose bytes are not those its manifest records.
    """
    from safetensors.torch import save_file

    if ckpt_id is not None:
        plan = next((p for p in complete_checkpoints(Path(checkpoint_dir)) if p.id == ckpt_id), None)
        if plan is None:
            raise ValueError(f"no complete checkpoint {ckpt_id!r} under {checkpoint_dir} (every shard of the job must have written its part)")
    else:
        plan = _newest_parts(Path(checkpoint_dir))
        if plan is None:
            raise ValueError(f"no complete checkpoint under {checkpoint_dir} (every shard of the job must have written a part)")
    state = load_state(plan, 0, 1)  # one "shard" of one: every row and chunk
    tensors: dict[str, torch.Tensor] = {}
    tables = {}
    for t in state.tables:
        tensors[f"{t.config.name}.ids"] = torch.from_numpy(t.ids.astype("int64", copy=True))
        tensors[f"{t.config.name}.rows"] = t.weights.float().contiguous().clone()
        tables[t.config.name] = {"rows": len(t.ids), "dim": t.config.dim, "optimizer": t.config.optimizer.name}
    chunks: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for d in state.dense:
        chunks.setdefault(d.name, []).append((d.index, d.value))
    dense = {}
    for name, parts in sorted(chunks.items()):
        parts.sort(key=lambda p: p[0])
        if [i for i, _ in parts] != list(range(len(parts))):
            raise ValueError(f"checkpoint {plan.id}: dense {name!r} has chunks {[i for i, _ in parts]}, not 0..{len(parts) - 1}")
        tensors[f"dense.{name}"] = torch.cat([v.reshape(-1).float() for _, v in parts]).contiguous()
        dense[name] = tensors[f"dense.{name}"].numel()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / WEIGHTS), metadata={"format": EXPORT_FORMAT, "checkpoint": plan.id})
    manifest = {
        "format": EXPORT_FORMAT,
        "checkpoint": plan.id,
        "checkpoint_created": plan.created,
        "exported": time.time(),
        "tables": tables,
        "dense": dense,
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    log.info("exported checkpoint %s: %d table(s), %d dense tensor(s) -> %s", plan.id, len(tables), len(dense), out)
    return manifest
