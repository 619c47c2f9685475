"""Containing a failure inside the ring (a kernel error, an out-of-memory) so that no rank hangs and
the group stays usable.

A rank whose compute raises at some ring step does not leave: it completes every exchange the ring
still posts (passing on what it holds, adding nothing), so no message is left half-sent. At the end
of the pass the ranks agree on a status in ceil(log2 N) rounds of tiny P2P exchanges (recursive
doubling: after round k each rank knows the status of the 2^k ranks before it), and every rank
raises: the failed one its own error, the others one naming it. The next call on the group is exact.

The agreement reads the status on the host, so it runs where that costs no device sync (gloo, and
the in-process loopback ring). On
NCCL a failure is contained on the failing rank only; its peers' next collective times out after the
process group's timeout (``trainer.dist_timeout_s``).
"""

from __future__ import annotations

import torch

from .._deprecated import warn_renamed
from ..checks.doubling import agree_by_doubling

__all__ = ["RingFault"]


class RingFault:
    """The failure state of one ring pass (forward or backward) on one rank."""

    def __init__(self, transport) -> None:
        self.transport = transport
        self.error: BaseException | None = None
        self._agree = transport.host_agreement

    @property
    def comm(self):
        """Deprecated (one release): :attr:`transport`."""
        warn_renamed("RingFault.comm", "RingFault.transport")
        return self.transport

    @property
    def ok(self) -> bool:
        return self.error is None

    def fail(self, error: BaseException) -> None:
        """This rank's compute raised: stop computing, keep exchanging."""
        if self.ok:
            self.error = error

    def contained(self) -> _Contained:
        """``with fault.contained(): ...``: an exception in the block is this rank's failure (see
        :meth:`fail`), not raised; the pass goes on exchanging and the frame raises it after the last
        exchange (:meth:`raise_if_failed`). Run only while :attr:`ok`."""
        return _Contained(self)

    def _failed_rank(self) -> int:
        """-1 if no rank of the group failed this pass, else the lowest group rank that did."""
        code = torch.tensor([self.transport.rank + 1 if self.error is not None else 0], dtype=torch.int64)
        # 0 means no failure; otherwise keep the lowest failed rank seen, so all ranks name the same.
        code = agree_by_doubling(self.transport, code, lambda a, b: torch.where((a == 0) | ((b > 0) & (b < a)), b, a))
        return int(code[0]) - 1

    def raise_if_failed(self, what: str) -> None:
        """After the pass's last exchange: raise this rank's error, or one saying which peer failed.
        Every rank of the group raises when any did (on gloo)."""
        failed = self._failed_rank() if self._agree else (self.transport.rank if self.error is not None else -1)
        if self.error is not None:
            raise self.error
        if failed >= 0:
            raise RuntimeError(
                f"ring attention {what} failed on rank {failed} of the group (see that rank's error); this rank "
                "finished its exchanges and raises too, so no rank goes on alone; the group is still usable")


class _Contained:
    """The context of :meth:`RingFault.contained`."""

    def __init__(self, fault: RingFault) -> None:
        self.fault = fault

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, error, trace) -> bool:
        if isinstance(error, Exception):  # contained: re-raised after the last exchange
            self.fault.fail(error)
            return True
        return False
