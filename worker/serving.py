"""Trained embeddings and dense parameters out of tether, for inference without shards.

``tether export`` writes a checkpoint of the whole job as ``model.safetensors`` plus
``manifest.json``: per table its sorted ids (``<table>.ids``, int64) and rows (``<table>.rows``,
float32 [n, dim]), and every dense tensor flat (``dense.<name>``). ``load_export`` reads it;
``Export.load_into(model)`` puts it into the same model class that was trained (its
``ShardedEmbeddingBag`` modules become ``RowLookupBag`` modules holding the rows, its dense
parameters get their trained values), and ``Export.embedding_bag(table)`` gives one table as a
module of its own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from tether.worker.embedding import PSModel, ShardedEmbeddingBag, split_flat

__all__ = ["EXPORT_FORMAT", "Export", "RowLookupBag", "load_export"]

EXPORT_FORMAT = "tether-export/1"
MANIFEST = "manifest.json"
WEIGHTS = "model.safetensors"


class RowLookupBag(nn.Module):
    """An embedding bag over an exported table: int64 ids of any value, looked up among the
    table's ids; an id the table never held reads as a row of zeros.

    ``forward(ids)`` takes what ``ShardedEmbeddingBag`` takes ([B] or [B, L] ids, reduced with
    ``mode``); ``forward(ids, offsets, per_sample_weights)`` follows ``torch.nn.EmbeddingBag``
    (1-D ids, bags starting at ``offsets``).
    """

    ids: torch.Tensor
    weight: torch.Tensor

    def __init__(self, ids: torch.Tensor, rows: torch.Tensor, mode: str = "sum") -> None:
        super().__init__()
        if mode not in ("sum", "mean", "max"):
            raise ValueError(f"mode must be sum, mean or max, got {mode!r}")
        if ids.dim() != 1 or rows.dim() != 2 or len(ids) != len(rows):
            raise ValueError(f"ids [n] and rows [n, dim] expected, got {tuple(ids.shape)} and {tuple(rows.shape)}")
        order = torch.argsort(ids)
        self.mode = mode
        self.dim = rows.shape[1]
        # Buffers, not parameters: a loaded model's parameters stay the dense ones it trained.
        self.register_buffer("ids", ids[order].to(torch.int64))
        # Row 0 is the zero row of unknown ids.
        self.register_buffer("weight", torch.cat([rows.new_zeros(1, self.dim), rows[order].float()]))

    def _index(self, ids: torch.Tensor) -> torch.Tensor:
        if len(self.ids) == 0:
            return torch.zeros_like(ids)
        ids = ids.contiguous()
        pos = torch.searchsorted(self.ids, ids).clamp_(max=len(self.ids) - 1)
        return torch.where(self.ids[pos] == ids, pos + 1, 0)

    def forward(
        self, ids: torch.Tensor, offsets: torch.Tensor | None = None, per_sample_weights: torch.Tensor | None = None
    ) -> torch.Tensor:
        if ids.dtype != torch.int64:
            raise ValueError(f"ids must be int64, got {ids.dtype}")
        index = self._index(ids)
        if offsets is None and per_sample_weights is None:
            if ids.dim() == 1:
                return self.weight[index]
            rows = self.weight[index]
            if self.mode == "sum":
                return rows.sum(dim=-2)
            if self.mode == "mean":
                return rows.mean(dim=-2)
            return rows.max(dim=-2).values
        return F.embedding_bag(index, self.weight, offsets, mode=self.mode, per_sample_weights=per_sample_weights)


@dataclass(frozen=True)
class Export:
    """An exported model: tables (sorted ids and rows) and flat dense tensors."""

    tables: dict[str, tuple[torch.Tensor, torch.Tensor]]
    dense: dict[str, torch.Tensor]
    manifest: dict[str, object]

    def embedding_bag(self, table: str, mode: str = "sum") -> RowLookupBag:
        """Table ``table`` as a module.

        Raises:
            KeyError: no such table in the export.
        """
        if table not in self.tables:
            raise KeyError(f"table {table!r} is not in the export (tables: {sorted(self.tables)})")
        ids, rows = self.tables[table]
        return RowLookupBag(ids, rows, mode)

    def load_into(self, model: nn.Module) -> nn.Module:
        """Give ``model`` (the class that was trained, built the same way) the exported values.

        Dense parameters come from the flat tensor ``PSModel`` declared (its parameters in
        ``named_parameters`` order); every ``ShardedEmbeddingBag`` is replaced by a
        ``RowLookupBag`` of its table.

        Raises:
            ValueError: the model's parameters or tables do not match the export.
        """
        params = list(dict(model.named_parameters()).values())
        flat = self.dense.get(PSModel.FLAT)
        if params:
            total = sum(p.numel() for p in params)
            if flat is None or flat.numel() != total:
                got = "none" if flat is None else f"{flat.numel()} values"
                raise ValueError(f"the model has {total} dense parameter values, the export {got}")
            with torch.no_grad():
                for p, value in zip(params, split_flat(flat.to(params[0].device), params)):
                    p.copy_(value)
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, ShardedEmbeddingBag):
                    if child.dim != self._dim(child.table):
                        raise ValueError(f"table {child.table!r}: the model's rows are {child.dim} wide, the export's {self._dim(child.table)}")
                    setattr(parent, name, self.embedding_bag(child.table, child.mode))
        return model

    def _dim(self, table: str) -> int:
        if table not in self.tables:
            raise ValueError(f"table {table!r} of the model is not in the export (tables: {sorted(self.tables)})")
        return self.tables[table][1].shape[1]


def load_export(path: str | Path) -> Export:
    """Read what ``tether export`` wrote into ``path``.

    Raises:
        FileNotFoundError: no export there.
        ValueError: a manifest of another format, or files that disagree with it.
    """
    from safetensors.torch import load_file

    path = Path(path)
    manifest = json.loads((path / MANIFEST).read_text())
    if manifest.get("format") != EXPORT_FORMAT:
        raise ValueError(f"{path / MANIFEST} is not a {EXPORT_FORMAT} manifest (format {manifest.get('format')!r})")
    tensors = load_file(str(path / WEIGHTS))
    tables = {}
    for name, spec in manifest["tables"].items():
        ids, rows = tensors[f"{name}.ids"], tensors[f"{name}.rows"]
        if rows.shape != (spec["rows"], spec["dim"]) or ids.shape != (spec["rows"],):
            raise ValueError(f"table {name!r}: files hold {tuple(rows.shape)} rows, the manifest says ({spec['rows']}, {spec['dim']})")
        tables[name] = (ids, rows)
    dense = {name: tensors[f"dense.{name}"] for name in manifest["dense"]}
    return Export(tables, dense, manifest)
