"""What every strategy's autograd Function does around its blocks: fold attention sinks into the final
out/LSE, their gradient, and a gradient on the LSE turned into one extra value channel."""

from __future__ import annotations

import torch

__all__ = ["fold_sinks", "sinks_grad", "with_lse_grad"]


def fold_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor | None, acc: torch.dtype
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """``out [B, n, H, Dv]`` and ``lse [B, H, n]`` with one extra logit per head ``sinks [H]`` in every
    denominator (a key with a zero value); unchanged when ``sinks`` is None. Merged once, at the end,
    so the kernels' backward sees the final probabilities through the final LSE."""
    if sinks is None:
        return out, lse
    with_sink = torch.logaddexp(lse, sinks.to(acc)[None, :, None])
    out = out * torch.exp(lse - with_sink).transpose(1, 2).unsqueeze(-1)
    return out, with_sink


def sinks_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, dlse: torch.Tensor | None,
               sinks: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """``[H]``: the gradient of the sinks from these rows' ``dout``/``out [B, n, H, Dv]``, ``lse [B, H, n]``
    (with the sinks) and ``dlse`` (None: zero). d lse/d sink = p_sink = exp(sink - lse) and
    d out/d sink = -p_sink * out, so per head dsink = sum over batch and rows of
    p_sink * (dlse - rowsum(dout * out))."""
    delta = (dout.to(acc) * out.to(acc)).sum(-1).transpose(1, 2)  # [B, H, n]
    if dlse is not None:
        delta = delta - dlse.to(acc)
    p_sink = torch.exp(sinks.to(acc)[None, :, None] - lse)
    return -(p_sink * delta).sum((0, 2)).to(sinks.dtype)


def with_lse_grad(out: torch.Tensor, dout: torch.Tensor, dlse: torch.Tensor, v: torch.Tensor,
                  *more_v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``(out, dout, v, *more_v)`` with one extra channel that carries a gradient on the LSE.

    It adds dlse * p to every score's gradient, i.e. the kernels' rowsum D = rowsum(dout * out) becomes
    D - dlse. One extra channel does it for any kernel, exactly: out gets a column of ones, dout a
    column of -dlse, every value tensor (``v`` and ``more_v``, other shards of it) a column of zeros, so
    dout @ v^T, hence every dP, is unchanged; drop the extra dv column afterwards.
    """
    out = torch.cat([out, out.new_ones(*out.shape[:-1], 1)], dim=-1)
    dout = torch.cat([dout, (-dlse).transpose(1, 2).unsqueeze(-1).to(dout.dtype)], dim=-1)
    zero_col = lambda t: torch.cat([t, t.new_zeros(*t.shape[:-1], 1)], dim=-1)  # noqa: E731
    return (out, dout, zero_col(v), *(zero_col(t) for t in more_v))
