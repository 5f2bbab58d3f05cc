"""Device state of the sequences a native engine decodes together: one row per sample.

Rows are right-aligned: every row's cached tokens end at the last column, and a decode step appends one column
to all rows. A row that joins later is left-padded (masked) to the batch's width; columns that no live row uses
any more are trimmed off the left when rows leave. Every operation is a batched tensor op over all rows.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (keys, values), each [B, heads, L, head_dim]


def _pad_left(t: torch.Tensor, width: int, dim: int, value: float = 0) -> torch.Tensor:
    missing = width - t.shape[dim]
    if missing == 0:
        return t
    pad = [0, 0] * (t.dim() - 1 - dim) + [missing, 0]
    return F.pad(t, pad, value=value)


def _pad_right(t: torch.Tensor, width: int, value: float = 0) -> torch.Tensor:
    missing = width - t.shape[1]
    return t if missing == 0 else F.pad(t, [0, missing], value=value)


def _pad_top(t: torch.Tensor, steps: int, k: int, value: float) -> torch.Tensor:
    """[B, T, K] padded on the right of dims 1 and 2 to [B, steps, k]."""
    return F.pad(t, [0, k - t.shape[2], 0, steps - t.shape[1]], value=value)


@dataclass
class RowParams:
    """Per-row sampling parameters [B] (stop_ids [B, W], -1 = unused)."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    max_new: torch.Tensor
    stop_ids: torch.Tensor


@dataclass
class BatchState:
    kv: KV
    mask: torch.Tensor  # [B, L] 1 = cached token
    ids: torch.Tensor  # [B, L] token ids of the cached columns (rebuilding the cache needs them)
    next_tok: torch.Tensor  # [B] sampled, not yet in the cache
    pos: torch.Tensor  # [B] position id of next_tok
    params: RowParams
    out_tok: torch.Tensor  # [B, T] generated tokens
    out_lp: torch.Tensor  # [B, T] their logprobs
    out_ver: torch.Tensor  # [B, T] the weight version that produced each
    length: torch.Tensor  # [B] tokens generated so far
    cache_version: int  # weights the cached keys/values were computed with
    out_top_lp: torch.Tensor  # [B, T, K] logprobs of the K most likely tokens at each step (K: the batch's max ask)
    out_top_id: torch.Tensor  # [B, T, K] their token ids

    @property
    def alternatives(self) -> int:
        return int(self.out_top_lp.shape[2])

    @property
    def rows(self) -> int:
        return int(self.mask.shape[0])

    @property
    def width(self) -> int:
        return int(self.mask.shape[1])

    def check(self) -> None:
        b, w = self.mask.shape
        assert self.ids.shape == (b, w) and self.next_tok.shape == (b,) and self.pos.shape == (b,)
        assert self.out_tok.shape == self.out_lp.shape == self.out_ver.shape and self.out_tok.shape[0] == b
        assert self.out_top_lp.shape == self.out_top_id.shape and self.out_top_lp.shape[:2] == self.out_tok.shape
        assert all(k.shape[0] == b and k.shape[2] == w and v.shape == k.shape for k, v in self.kv)

    def select(self, index: torch.Tensor) -> BatchState:
        """Keep the given rows (in that order), then drop leading columns no kept row uses."""
        mask = self.mask.index_select(0, index)
        used = mask.any(dim=0)
        lead = int(used.to(torch.uint8).argmax()) if bool(used.any()) else self.width
        kv = [(k.index_select(0, index)[:, :, lead:], v.index_select(0, index)[:, :, lead:]) for k, v in self.kv]
        p = self.params
        return BatchState(
            kv=kv,
            mask=mask[:, lead:],
            ids=self.ids.index_select(0, index)[:, lead:],
            next_tok=self.next_tok.index_select(0, index),
            pos=self.pos.index_select(0, index),
            params=RowParams(*(getattr(p, f.name).index_select(0, index) for f in fields(p))),
            out_tok=self.out_tok.index_select(0, index),
            out_lp=self.out_lp.index_select(0, index),
            out_ver=self.out_ver.index_select(0, index),
            length=self.length.index_select(0, index),
            cache_version=self.cache_version,
            out_top_lp=self.out_top_lp.index_select(0, index),
            out_top_id=self.out_top_id.index_select(0, index),
        )

    @staticmethod
    def concat(a: BatchState, b: BatchState) -> BatchState:
        """Rows of ``a`` then rows of ``b``, right-aligned to the wider of the two."""
        w = max(a.width, b.width)
        t = max(a.out_tok.shape[1], b.out_tok.shape[1])
        s = max(a.params.stop_ids.shape[1], b.params.stop_ids.shape[1])
        k = max(a.alternatives, b.alternatives)
        kv = [
            (
                torch.cat([_pad_left(ka, w, 2), _pad_left(kb, w, 2)]),
                torch.cat([_pad_left(va, w, 2), _pad_left(vb, w, 2)]),
            )
            for (ka, va), (kb, vb) in zip(a.kv, b.kv, strict=True)
        ]
        pa, pb = a.params, b.params
        return BatchState(
            kv=kv,
            mask=torch.cat([_pad_left(a.mask, w, 1), _pad_left(b.mask, w, 1)]),
            ids=torch.cat([_pad_left(a.ids, w, 1), _pad_left(b.ids, w, 1)]),
            next_tok=torch.cat([a.next_tok, b.next_tok]),
            pos=torch.cat([a.pos, b.pos]),
            params=RowParams(
                temperature=torch.cat([pa.temperature, pb.temperature]),
                top_k=torch.cat([pa.top_k, pb.top_k]),
                top_p=torch.cat([pa.top_p, pb.top_p]),
                max_new=torch.cat([pa.max_new, pb.max_new]),
                stop_ids=torch.cat([_pad_right(pa.stop_ids, s, -1), _pad_right(pb.stop_ids, s, -1)]),
            ),
            out_tok=torch.cat([_pad_right(a.out_tok, t), _pad_right(b.out_tok, t)]),
            out_lp=torch.cat([_pad_right(a.out_lp, t), _pad_right(b.out_lp, t)]),
            out_ver=torch.cat([_pad_right(a.out_ver, t), _pad_right(b.out_ver, t)]),
            length=torch.cat([a.length, b.length]),
            cache_version=min(a.cache_version, b.cache_version),
            out_top_lp=torch.cat([_pad_top(x.out_top_lp, t, k, float("-inf")) for x in (a, b)]),
            out_top_id=torch.cat([_pad_top(x.out_top_id, t, k, -1) for x in (a, b)]),
        )

    def record(
        self, tok: torch.Tensor, lp: torch.Tensor, version: int, top: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> None:
        """Store each row's newly sampled token (and its step's alternatives) at its own output position."""
        rows = torch.arange(self.rows, device=tok.device)
        self.out_tok[rows, self.length] = tok
        self.out_lp[rows, self.length] = lp
        self.out_ver[rows, self.length] = version
        if top is not None and self.alternatives:
            self.out_top_lp[rows, self.length] = top[0]
            self.out_top_id[rows, self.length] = top[1]
        self.length += 1
        self.next_tok = tok

    def hit_stop(self) -> torch.Tensor:
        """[B] bool: the last sampled token is one of the row's stop ids."""
        return (self.next_tok.unsqueeze(1) == self.params.stop_ids).any(dim=1)
