"""Trained embeddings and dense parameters out of tether, for inference without shards.

``tether export`` writes a checkpoint of the whole job as ``model.safetensors`` plus
``manifest.json``: per table its sorted ids (``<table>.ids``, int64) and rows (``<table>.rows``,
float32 [n, dim]), and the dense parameters. Given the model (``--model``), every parameter is
its own tensor ``dense.<parameter name>`` with its shape (``"dense_layout": "parameters"``);
without it, the shards' one flat vector ``dense.dense`` as it travels on the wire
(``"dense_layout": "flat"``). ``load_export`` reads either; ``Export.load_into(model)`` puts it
into the same model class that was trained (its ``ShardedEmbeddingBag`` modules become
``RowLookupBag`` modules holding the rows, on the model's device, and its dense parameters get
their trained values), and ``Export.embedding_bag(table)`` gives one table as a module of its
own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from tether.worker.training.embedding import PSModel
from tether.worker.training.embedding_bag import ShardedEmbeddingBag

__all__ = ["EXPORT_FORMAT", "Export", "RowLookupBag", "load_export", "split_dense"]

EXPORT_FORMAT = "tether-export/2"
# /1 wrote the dense parameters only as the wire's flat vector; it is read as "flat".
READABLE_FORMATS = ("tether-export/1", EXPORT_FORMAT)
MANIFEST = "manifest.json"
WEIGHTS = "model.safetensors"
# ``dense_layout`` of a manifest: one tensor per parameter, or the flat vector PSModel declares.
PARAMETERS, FLAT = "parameters", "flat"


def split_dense(flat: torch.Tensor, model: nn.Module) -> dict[str, torch.Tensor]:
    """The flat dense vector ``PSModel`` declares, as one tensor per parameter of ``model``
    (the parameters' ``named_parameters`` order and shapes, as ``PSModel`` joined them).

    Raises:
        ValueError: the model's parameters hold another number of values than ``flat``.
    """
    params = dict(model.named_parameters())
    total = sum(p.numel() for p in params.values())
    if flat.dim() != 1 or flat.numel() != total:
        raise ValueError(
            f"the model has {total} dense parameter values in {len(params)} parameters, the flat dense vector "
            f"{flat.numel()} (shape {tuple(flat.shape)}): build the model the way it was trained"
        )
    # Copies, not views of ``flat``: safetensors refuses tensors that share memory.
    return {
        name: part.reshape(p.shape).clone()
        for (name, p), part in zip(params.items(), torch.split(flat, [p.numel() for p in params.values()]), strict=False)
    }


def _device_of(model: nn.Module) -> torch.device:
    """Where ``model`` keeps its tensors (its first parameter or buffer); the CPU if it has none."""
    for t in (*model.parameters(), *model.buffers()):
        return t.device
    return torch.device("cpu")


class RowLookupBag(nn.Module):
    """An embedding bag over an exported table: int64 ids of any value (narrower integer ids are
    widened), looked up among the table's ids; an id the table never held reads as a row of zeros.

    ``forward(ids)`` takes what ``ShardedEmbeddingBag`` takes ([B] or [B, L] ids, reduced with
    ``mode``); ``forward(ids, offsets, per_sample_weights)`` follows ``torch.nn.EmbeddingBag``
    (1-D ids, bags starting at ``offsets``). Ids equal to ``padding_id`` add nothing to a bag
    and do not count in a mean or a max, as in ``ShardedEmbeddingBag``. The module lives on the
    device of ``rows``, and ids must be there too.
    """

    ids: torch.Tensor
    weight: torch.Tensor

    def __init__(self, ids: torch.Tensor, rows: torch.Tensor, mode: str = "sum", padding_id: int | None = None) -> None:
        super().__init__()
        if mode not in ("sum", "mean", "max"):
            raise ValueError(f"mode must be sum, mean or max, got {mode!r}")
        if ids.dim() != 1 or rows.dim() != 2 or len(ids) != len(rows):
            raise ValueError(f"ids [n] and rows [n, dim] expected, got {tuple(ids.shape)} and {tuple(rows.shape)}")
        ids = ids.to(rows.device)
        order = torch.argsort(ids)
        self.mode = mode
        self.dim = rows.shape[1]
        self.padding_id = padding_id
        # Buffers, not parameters: a loaded model's parameters stay the dense ones it trained.
        self.register_buffer("ids", ids[order].to(torch.int64))
        # Row 0 is the zero row of unknown ids; with padding, a last zero row is the padding's
        # (embedding_bag's padding_idx leaves it out of sums, means and maxima).
        zero = rows.new_zeros(1, self.dim, dtype=torch.float32)
        self.register_buffer("weight", torch.cat([zero, rows[order].float(), *([zero] if padding_id is not None else [])]))

    def _index(self, ids: torch.Tensor) -> torch.Tensor:
        if len(self.ids) == 0:
            index = torch.zeros_like(ids)
        else:
            ids = ids.contiguous()
            pos = torch.searchsorted(self.ids, ids).clamp_(max=len(self.ids) - 1)
            index = torch.where(self.ids[pos] == ids, pos + 1, 0)
        if self.padding_id is not None:
            index = torch.where(ids == self.padding_id, len(self.weight) - 1, index)
        return index

    def forward(
        self, ids: torch.Tensor, offsets: torch.Tensor | None = None, per_sample_weights: torch.Tensor | None = None
    ) -> torch.Tensor:
        if ids.dtype != torch.int64:
            # Integer ids of any width are widened, as ShardedEmbeddingBag does; a float or
            # bool tensor is a mistake, not ids.
            if ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
                raise ValueError(f"ids must be integers, got {ids.dtype}")
            ids = ids.to(torch.int64)
        if offsets is not None and ids.dim() != 1:
            raise ValueError(f"ids with offsets must be 1-D, got shape {tuple(ids.shape)}")
        if ids.dim() not in (1, 2):
            raise ValueError(f"ids must be [B], [B, L] or [N] with offsets, got shape {tuple(ids.shape)}")
        index = self._index(ids.reshape(-1))
        if ids.dim() == 1 and offsets is None:
            if per_sample_weights is not None:
                raise ValueError("per_sample_weights need bags (offsets or [B, L] ids)")
            return self.weight[index]
        # The same call ShardedEmbeddingBag makes, so served bags equal trained ones bit for bit.
        if offsets is None:
            offsets = torch.arange(0, index.numel(), ids.shape[1], device=index.device)
            if per_sample_weights is not None:
                per_sample_weights = per_sample_weights.reshape(-1)
        padding_idx = len(self.weight) - 1 if self.padding_id is not None else None
        return F.embedding_bag(index, self.weight, offsets, mode=self.mode, per_sample_weights=per_sample_weights, padding_idx=padding_idx)


@dataclass(frozen=True)
class Export:
    """An exported model: tables (sorted ids and rows) and dense tensors (one per parameter,
    or the flat vector; ``dense_layout`` says which)."""

    tables: dict[str, tuple[torch.Tensor, torch.Tensor]]
    dense: dict[str, torch.Tensor]
    manifest: dict[str, object]

    @property
    def dense_layout(self) -> str:
        """``"parameters"`` (``dense`` maps parameter names to tensors of their shape) or
        ``"flat"`` (``dense["dense"]`` is every parameter's values, joined)."""
        return str(self.manifest.get("dense_layout", FLAT))

    def embedding_bag(
        self, table: str, mode: str = "sum", padding_id: int | None = None, device: torch.device | str | None = None
    ) -> RowLookupBag:
        """Table ``table`` as a module on ``device`` (default: the CPU).

        Raises:
            KeyError: no such table in the export.
        """
        if table not in self.tables:
            raise KeyError(f"table {table!r} is not in the export (tables: {sorted(self.tables)})")
        ids, rows = self.tables[table]
        return RowLookupBag(ids, rows.to(device or "cpu"), mode, padding_id)

    def load_into(self, model: nn.Module, dense: bool = True) -> nn.Module:
        """Give ``model`` (the class that was trained, built the same way) the exported values.

        Every dense parameter gets its value (by name and shape, or from the flat vector in
        ``named_parameters`` order); every ``ShardedEmbeddingBag`` is replaced by a
        ``RowLookupBag`` of its table, on the device the model is on. ``dense=False`` loads the
        tables only and leaves the model's dense parameters as they are: a sync job keeps its
        dense parameters on the workers, so load those from what a rank saved
        (``model.load_state_dict``) and the tables from the export.

        Raises:
            ValueError: the model's parameters or tables do not match the export.
        """
        if dense:
            values = self._dense_values(model)
            with torch.no_grad():
                for name, p in model.named_parameters():
                    p.copy_(values[name].to(p.device))
        device = _device_of(model)
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, ShardedEmbeddingBag):
                    if child.dim != self._dim(child.table):
                        raise ValueError(
                            f"table {child.table!r}: the model's rows are {child.dim} wide, the export's {self._dim(child.table)}"
                        )
                    setattr(parent, name, self.embedding_bag(child.table, child.mode, child.padding_id, device))
        return model

    def _dense_values(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The export's value of each of ``model``'s parameters, by name."""
        params = dict(model.named_parameters())
        if self.dense_layout == FLAT:
            if not params:
                return {}
            flat = self.dense.get(PSModel.FLAT)
            if flat is None:
                raise ValueError(
                    f"the model has {len(params)} dense parameters, the export none "
                    "(a sync job keeps its dense parameters on the workers, not on the shards: "
                    "load_into(model, dense=False) loads the tables only)"
                )
            return split_dense(flat, model)
        missing = [n for n in params if n not in self.dense]
        unexpected = [n for n in self.dense if n not in params]
        if missing or unexpected:
            raise ValueError(
                f"the model's dense parameters are not the export's: missing from the export {missing[:5]}"
                f"{' ...' if len(missing) > 5 else ''}, not in the model {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}"
            )
        for name, p in params.items():
            if self.dense[name].shape != p.shape:
                raise ValueError(f"dense parameter {name!r}: the model's is {tuple(p.shape)}, the export's {tuple(self.dense[name].shape)}")
        return self.dense

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
    path = Path(path)
    manifest = json.loads((path / MANIFEST).read_text())
    if manifest.get("format") not in READABLE_FORMATS:
        raise ValueError(
            f"{path / MANIFEST} is not a manifest this tether reads ({', '.join(READABLE_FORMATS)}), "
            f"its format is {manifest.get('format')!r}"
        )
    layout = manifest.setdefault("dense_layout", FLAT)
    if layout not in (PARAMETERS, FLAT):
        raise ValueError(f"{path / MANIFEST}: dense_layout must be {PARAMETERS!r} or {FLAT!r}, got {layout!r}")
    tensors = load_file(str(path / WEIGHTS))
    tables = {}
    for name, spec in manifest["tables"].items():
        ids, rows = tensors[f"{name}.ids"], tensors[f"{name}.rows"]
        if rows.shape != (spec["rows"], spec["dim"]) or ids.shape != (spec["rows"],):
            raise ValueError(f"table {name!r}: files hold {tuple(rows.shape)} rows, the manifest says ({spec['rows']}, {spec['dim']})")
        tables[name] = (ids, rows)
    dense = {name: tensors[f"dense.{name}"] for name in manifest["dense"]}
    for name, shape in manifest.get("dense_shapes", {}).items():
        if tuple(dense[name].shape) != tuple(shape):
            raise ValueError(f"dense {name!r}: files hold shape {tuple(dense[name].shape)}, the manifest says {tuple(shape)}")
    return Export(tables, dense, manifest)
