"""``tether export``: a complete checkpoint (or a live cluster's state) as safetensors files.

The output is what ``tether.worker.serving.load_export`` reads: ``model.safetensors`` with
each table's sorted ids and rows and the dense parameters, and a ``manifest.json`` naming the
checkpoint, the tables (rows, dim, optimizer) and the dense tensors (values and shape of each).
The shards hold a model's dense parameters as one flat vector (how they travel on the wire);
given the model, the export splits it back into one tensor per parameter, named and shaped as
in ``model.named_parameters()``. Optimizer state is left out: serving needs the parameters only.
Both files are written whole or not at all, with the mode the umask gives a new file.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from tether.server.checkpoints.checkpoint_files import Manifest, RestorePlan, load_state
from tether.server.checkpoints.restore import complete_checkpoints, list_manifests
from tether.worker.serving import EXPORT_FORMAT, FLAT, MANIFEST, PARAMETERS, WEIGHTS, split_dense
from tether.worker.training.embedding import PSModel

__all__ = ["export_checkpoint", "load_model"]

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


def load_model(spec: str) -> nn.Module:
    """The model that ``spec`` builds: ``package.module:function`` or ``path/to/file.py:function``,
    a function of no arguments that returns the model built the way it was trained.

    Raises:
        ValueError: ``spec`` of another form, a module or file that does not import, no such
            function, or one that returns no ``torch.nn.Module``.
    """
    where, _, attr = spec.rpartition(":")
    if not where or not attr.isidentifier():
        raise ValueError(f"--model must be module:function or file.py:function, got {spec!r}")
    try:
        if where.endswith(".py"):
            path = Path(where).resolve()
            if not path.is_file():
                raise ValueError(f"--model {spec!r}: no file {where}")
            # As when the file runs as a script: its folder first on the path for its own imports.
            sys.path.insert(0, str(path.parent))
            loaded = importlib.util.spec_from_file_location(f"_tether_export_model_{path.stem}", path)
            if loaded is None or loaded.loader is None:
                raise ValueError(f"--model {spec!r}: {where} is not a Python file")
            module = importlib.util.module_from_spec(loaded)
            loaded.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except ImportError as exc:
        raise ValueError(f"--model {spec!r}: cannot import {where}: {exc}") from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ValueError(f"--model {spec!r}: {where} has no function {attr!r}")
    model = factory()
    if not isinstance(model, nn.Module):
        raise ValueError(f"--model {spec!r}: {attr}() returned {type(model).__name__}, not a torch.nn.Module")
    return model


def _umask() -> int:
    """The process's umask: Linux reports it without a change; elsewhere it is set and put back."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def _write(final: Path, write: Callable[[Path], object]) -> None:
    """``write`` a file beside ``final``, give it the mode a new file gets under the umask, and
    move it into place in one step (a reader sees the old file or the new one, whole)."""
    tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        # safetensors creates its file 0600 whatever the umask; an export is for the team to
        # serve, so it gets what the user's umask gives any new file (0644 under 022).
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)


def export_checkpoint(
    checkpoint_dir: str | Path, out: str | Path, ckpt_id: str | None = None, model: nn.Module | None = None
) -> dict[str, Any]:
    """Write checkpoint ``ckpt_id`` of ``checkpoint_dir`` (default: every shard's newest part)
    into the folder ``out``; returns the manifest written.

    Args:
        model: the model the job trained, built the same way (its values do not matter): the
            dense parameters are written one tensor per parameter, ``dense.<name>`` with its
            shape. Without it, they are written as the one flat vector the shards hold.

    Raises:
        ValueError: no complete checkpoint of that id, (without an id) a shard with no part, or
            a model whose parameters are not those the checkpoint holds.
        ChecksumMismatch: a checkpoint file whose bytes are not those its manifest records.
    """
    if ckpt_id is not None:
        plan = next((p for p in complete_checkpoints(Path(checkpoint_dir)) if p.id == ckpt_id), None)
        if plan is None:
            raise ValueError(
                f"no complete checkpoint {ckpt_id!r} under {checkpoint_dir} (every shard of the job must have written its part)"
            )
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
    joined: dict[str, torch.Tensor] = {}
    for name, parts in sorted(chunks.items()):
        parts.sort(key=lambda p: p[0])
        if [i for i, _ in parts] != list(range(len(parts))):
            raise ValueError(f"checkpoint {plan.id}: dense {name!r} has chunks {[i for i, _ in parts]}, not 0..{len(parts) - 1}")
        joined[name] = torch.cat([v.reshape(-1).float() for _, v in parts]).contiguous()
    layout = FLAT
    if model is not None:
        flat = joined.pop(PSModel.FLAT, None)
        if flat is None and any(True for _ in model.parameters()):
            raise ValueError(
                f"checkpoint {plan.id} holds no dense parameters ({PSModel.FLAT!r}) to name after the model's "
                "(a sync job keeps them on the workers, not on the shards)"
            )
        named = split_dense(flat, model) if flat is not None else {}
        clash = sorted(set(named) & set(joined))
        if clash:
            raise ValueError(f"checkpoint {plan.id}: dense tensors {clash} have the names of model parameters")
        joined = {**named, **joined}
        layout = PARAMETERS
    elif PSModel.FLAT in joined:
        log.warning(
            "dense parameters written as one flat vector dense.%s of %d values; for one tensor per parameter "
            "name, give the model (tether export --model MODULE:FUNCTION, or export_checkpoint(model=...))",
            PSModel.FLAT, joined[PSModel.FLAT].numel(),
        )
    tensors.update({f"dense.{name}": t for name, t in joined.items()})
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    metadata = {"format": EXPORT_FORMAT, "checkpoint": plan.id, "dense_layout": layout}
    _write(out / WEIGHTS, lambda path: save_file(tensors, str(path), metadata=metadata))
    manifest = {
        "format": EXPORT_FORMAT,
        "checkpoint": plan.id,
        "checkpoint_created": plan.created,
        "exported": time.time(),
        "tables": tables,
        "dense_layout": layout,
        "dense": {name: t.numel() for name, t in joined.items()},
        "dense_shapes": {name: list(t.shape) for name, t in joined.items()},
    }
    text = json.dumps(manifest, indent=2) + "\n"
    _write(out / MANIFEST, lambda path: path.write_text(text))
    log.info("exported checkpoint %s: %d table(s), %d dense tensor(s) -> %s", plan.id, len(tables), len(joined), out)
    return manifest
