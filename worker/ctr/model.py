"""The default CTR model: DLRM-style embedding bags for categorical features, an MLP for the
dense ones, pairwise dot-product interactions, and a top MLP."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from tether.protos.codec import int64_ids, is_id_dtype

__all__ = ["CTRModel", "LocalHashEmbedding"]


class LocalHashEmbedding(nn.Module):
    """In-process embedding over an unbounded id space: ``ids % num_buckets`` into one table.

    The no-parameter-server baseline; collisions make it slightly weaker than exact rows.

    Args:
        dim: width of a row.
        num_buckets: rows in the table.
        sparse: sparse gradients (an optimizer step touches only the batch's rows; use
            Adagrad, SGD or ``SparseAdam`` for them, since ``Adam`` rejects sparse gradients).
    """

    def __init__(self, dim: int, num_buckets: int = 1 << 18, sparse: bool = True) -> None:
        super().__init__()
        if dim < 1 or num_buckets < 1:
            raise ValueError(f"dim and num_buckets must be >= 1, got {dim!r}, {num_buckets!r}")
        self.num_buckets = num_buckets
        self.table = nn.Embedding(num_buckets, dim, sparse=sparse)
        nn.init.uniform_(self.table.weight, -0.05, 0.05)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows [B, dim] for integer ids [B] (any value, bucketed by ``ids mod num_buckets``)."""
        return self.table(torch.remainder(ids, self.num_buckets))


def _mlp(sizes: Sequence[int], last_activation: bool) -> nn.Sequential:
    """Linear layers through ``sizes`` with ReLUs between (and after the last if asked)."""
    layers: list[nn.Module] = []
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2 or last_activation:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class CTRModel(nn.Module):
    """DLRM-style click-through-rate model; ``forward(dense, sparse)`` returns logits [B].

    Args:
        num_dense: dense features per sample.
        num_sparse: categorical fields; field ``j`` uses embedding table ``cat_j``.
        embedding_dim: width of every embedding row.
        bottom_mlp: hidden sizes of the dense-feature MLP (its output is ``embedding_dim``).
        top_mlp: hidden sizes of the MLP over the interactions.
        embedding_factory: ``(table_name, dim) -> module`` mapping int64 ids [B] to [B, dim];
            by default a ``LocalHashEmbedding`` (tether passes one whose rows live on shards).
    """

    _pairs: torch.Tensor  # upper-triangle (i, j) pairs of the interaction, a buffer

    def __init__(
        self,
        num_dense: int,
        num_sparse: int,
        embedding_dim: int = 16,
        bottom_mlp: Sequence[int] = (64,),
        top_mlp: Sequence[int] = (64, 32),
        embedding_factory: Callable[[str, int], nn.Module] | None = None,
    ) -> None:
        super().__init__()
        if num_dense < 1 or num_sparse < 1 or embedding_dim < 1:
            raise ValueError(f"num_dense, num_sparse and embedding_dim must be >= 1, got {num_dense!r}, {num_sparse!r}, {embedding_dim!r}")
        for name, sizes in (("bottom_mlp", bottom_mlp), ("top_mlp", top_mlp)):
            if any(int(h) < 1 for h in sizes):
                raise ValueError(f"{name} sizes must be >= 1, got {tuple(sizes)!r}")
        factory = embedding_factory or (lambda name, dim: LocalHashEmbedding(dim))
        self.num_dense = num_dense
        self.num_sparse = num_sparse
        self.embedding_dim = embedding_dim
        self.embeddings = nn.ModuleList([factory(name, embedding_dim) for name in self.table_names()])
        self.bottom = _mlp([num_dense, *bottom_mlp, embedding_dim], last_activation=True)
        n = num_sparse + 1
        # A buffer so that it follows the model to its device; not state, so not saved.
        self.register_buffer("_pairs", torch.triu_indices(n, n, offset=1), persistent=False)
        self.top = _mlp([embedding_dim + n * (n - 1) // 2, *top_mlp, 1], last_activation=False)
        # ``(sparse [B, num_sparse]) -> [B, num_sparse, embedding_dim] or None``: looks every
        # field up at once (``PSModel`` sets it when the embeddings' rows live on shards);
        # None, or a None answer, means one lookup per field through ``embeddings``.
        self.fused_lookup: Callable[[torch.Tensor], torch.Tensor | None] | None = None

    def table_names(self) -> list[str]:
        """Names of the embedding tables, one per categorical field."""
        return [f"cat_{j}" for j in range(self.num_sparse)]

    def dense_parameters(self) -> list[nn.Parameter]:
        """Parameters of the MLPs (not of the embeddings), for an optimizer of their own."""
        return [*self.bottom.parameters(), *self.top.parameters()]

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        """Click logits [B] for dense features [B, num_dense] and ids [B, num_sparse] (any int64
        value; narrower integer dtypes are widened).

        Raises:
            ValueError: inputs of the wrong shape or dtype, or an embedding of the wrong shape.
        """
        if dense.dim() != 2 or dense.shape[1] != self.num_dense:
            raise ValueError(f"dense must be [B, {self.num_dense}], got {tuple(dense.shape)}")
        if not is_id_dtype(sparse.dtype):
            raise ValueError(f"sparse must be integer ids [{dense.shape[0]}, {self.num_sparse}], got {sparse.dtype}")
        if sparse.shape != (dense.shape[0], self.num_sparse):
            raise ValueError(f"sparse must be int64 [{dense.shape[0]}, {self.num_sparse}], got {sparse.dtype} {tuple(sparse.shape)}")
        # Ids of any integer width are the same ids (int32 or uint8 columns are common).
        sparse = int64_ids(sparse, "sparse")
        x = self.bottom(dense)
        fused = self.fused_lookup(sparse) if self.fused_lookup is not None else None
        if fused is not None:
            if fused.shape != (*sparse.shape, self.embedding_dim):
                raise ValueError(f"fused lookup returned {tuple(fused.shape)}, expected {(*sparse.shape, self.embedding_dim)}")
            vectors = torch.cat([x.unsqueeze(1), fused], dim=1)
        else:
            embedded = [emb(sparse[:, j]) for j, emb in enumerate(self.embeddings)]
            for j, e in enumerate(embedded):
                if e.shape != x.shape:
                    raise ValueError(f"table cat_{j} returned {tuple(e.shape)}, expected {tuple(x.shape)}")
            vectors = torch.stack([x, *embedded], dim=1)
        dots = torch.bmm(vectors, vectors.transpose(1, 2))
        i, j = self._pairs
        return self.top(torch.cat([x, dots[:, i, j]], dim=1)).squeeze(1)
