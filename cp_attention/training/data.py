"""Byte-level training data that needs no download: Python's bundled help texts, a local text or
JSONL file, or synthetic bytes. Tokens are bytes (vocabulary 256).

Unpacked, training draws random windows of the whole corpus (:class:`ByteBatches`). Packed
(``data.packing=true``), the corpus is a list of documents (:func:`load_documents`) concatenated
into rows whose ``position_ids`` restart at 0 at every document (:class:`PackedBatches`), so the
attention never crosses a document boundary."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

__all__ = ["load_bytes", "load_documents", "ByteBatches", "PackedBatches", "VOCAB_SIZE"]

VOCAB_SIZE = 256


def load_bytes(source: str, path: str | None = None, text_key: str = "text", synthetic_len: int = 1 << 20,
               seed: int = 0) -> torch.Tensor:
    """The whole corpus as a 1-D LongTensor of byte values.

    ``source``: ``builtin`` (``pydoc_data.topics``), ``text`` (file at ``path``), ``jsonl`` (field
    ``text_key`` of each line of ``path``) or ``synthetic`` (a repeating random pattern, learnable).
    Raises ``ValueError`` for an unknown source and ``FileNotFoundError`` for a missing file.
    """
    if source == "builtin":
        from pydoc_data.topics import topics

        raw = "\n".join(topics.values()).encode("utf-8")
    elif source in ("text", "jsonl"):
        if not path or not Path(path).is_file():
            raise FileNotFoundError(f"data.source={source} needs data.path to name an existing file, got {path!r}")
        if source == "text":
            raw = Path(path).read_bytes()
        else:
            lines = Path(path).read_text(encoding="utf-8").splitlines()
            raw = "\n".join(json.loads(line)[text_key] for line in lines if line.strip()).encode("utf-8")
    elif source == "synthetic":
        pattern = torch.randint(0, VOCAB_SIZE, (97,), generator=torch.Generator().manual_seed(seed))
        return pattern.repeat(synthetic_len // 97 + 1)[:synthetic_len].long()
    else:
        raise ValueError(f"unknown data.source {source!r}; expected builtin, text, jsonl or synthetic")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()


class ByteBatches:
    """Random windows of ``seq_len`` bytes, drawn identically on every rank from a seeded generator.

    Its position in the stream is the generator state, saved with :meth:`state_dict`, so a resumed
    run sees exactly the batches it would have seen.
    """

    def __init__(self, data: torch.Tensor, seq_len: int, seed: int) -> None:
        if data.numel() <= seq_len:
            raise ValueError(f"the corpus has {data.numel()} tokens, fewer than seq_len={seq_len}; "
                             "use a larger data set or a shorter trainer.seq_len")
        self.data, self.seq_len = data, seq_len
        self.generator = torch.Generator().manual_seed(seed)

    def next(self, batch: int) -> torch.Tensor:
        """The next ``[batch, seq_len]`` token batch."""
        starts = torch.randint(0, self.data.numel() - self.seq_len, (batch,), generator=self.generator)
        return torch.stack([self.data[s: s + self.seq_len] for s in starts.tolist()])

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        if "generator" not in state:
            raise ValueError("this data state is not from an unpacked run (data.packing=false); resume with the "
                             "data.packing setting the checkpoint was trained with")
        self.generator.set_state(state["generator"])


_PARAGRAPH = re.compile(r"\n(?:[ \t\r\f\v]*\n)+")  # one or more blank (or whitespace-only) lines


def load_documents(source: str, path: str | None = None, text_key: str = "text") -> list[torch.Tensor]:
    """The corpus as a list of documents, each a non-empty 1-D LongTensor of byte values.

    ``builtin``: one document per help topic of ``pydoc_data.topics``; ``jsonl``: one per line
    (field ``text_key``); ``text``: one per paragraph, paragraphs being separated by blank lines.
    Empty (or whitespace-only) documents are dropped. ``synthetic`` has no documents: ``ValueError``, as for an unknown
    source; ``FileNotFoundError`` for a missing file.
    """
    if source == "builtin":
        from pydoc_data.topics import topics

        texts = list(topics.values())
    elif source in ("text", "jsonl"):
        if not path or not Path(path).is_file():
            raise FileNotFoundError(f"data.source={source} needs data.path to name an existing file, got {path!r}")
        if source == "text":
            texts = _PARAGRAPH.split(Path(path).read_text(encoding="utf-8"))
        else:
            lines = Path(path).read_text(encoding="utf-8").splitlines()
            texts = [json.loads(line)[text_key] for line in lines if line.strip()]
    elif source == "synthetic":
        raise ValueError("data.source=synthetic has no documents to pack; use data.packing=false with it, or a "
                         "builtin, text or jsonl source")
    else:
        raise ValueError(f"unknown data.source {source!r}; expected builtin, text, jsonl or synthetic")
    docs = [torch.frombuffer(bytearray(t.encode("utf-8")), dtype=torch.uint8).long() for t in texts if t.strip()]
    if not docs:
        raise ValueError(f"data.source={source} holds no non-empty document")
    return docs


class PackedBatches:
    """Rows of exactly ``seq_len`` tokens packed from whole documents, identical on every rank.

    Every epoch visits all documents once, in an order shuffled from ``seed`` and the epoch number,
    and concatenates them greedily: a document that does not fit in what is left of a row continues
    at the start of the next row, its piece there a document of its own (positions restart at 0).
    No token is dropped and no padding is added; a row can hold pieces of several epochs.

    The position in the stream is ``(epoch, document, offset)``, saved with :meth:`state_dict`, so a
    resumed run sees exactly the batches it would have seen.
    """

    def __init__(self, documents: list[torch.Tensor], seq_len: int, seed: int) -> None:
        if not documents or any(d.dim() != 1 or d.numel() == 0 for d in documents):
            raise ValueError("PackedBatches needs a non-empty list of non-empty 1-D documents")
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        self.documents, self.seq_len, self.seed = documents, seq_len, seed
        self.epoch, self.doc, self.offset = 0, 0, 0
        self._order_epoch = -1
        self._order: list[int] | None = None

    def order(self, epoch: int) -> list[int]:
        """The documents' order in ``epoch``: a permutation drawn from ``(seed, epoch)`` alone."""
        if self._order is None or epoch != self._order_epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._order, self._order_epoch = torch.randperm(len(self.documents), generator=g).tolist(), epoch
        return self._order

    def _row(self) -> tuple[torch.Tensor, torch.Tensor]:
        ids, pos, left = [], [], self.seq_len
        while left:
            doc = self.documents[self.order(self.epoch)[self.doc]]
            take = min(left, doc.numel() - self.offset)
            ids.append(doc[self.offset: self.offset + take])
            pos.append(torch.arange(take))
            left -= take
            self.offset += take
            if self.offset == doc.numel():
                self.doc, self.offset = self.doc + 1, 0
                if self.doc == len(self.documents):
                    self.epoch, self.doc = self.epoch + 1, 0
        return torch.cat(ids), torch.cat(pos)

    def next(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The next ``(input_ids, position_ids)``, both ``[batch, seq_len]``; ``position_ids`` count
        0, 1, 2, ... within each document (or piece of one) and restart at 0 at the next."""
        rows = [self._row() for _ in range(batch)]
        return torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])

    def state_dict(self) -> dict:
        return {"packed": {"epoch": self.epoch, "doc": self.doc, "offset": self.offset, "seed": self.seed,
                           "documents": len(self.documents), "seq_len": self.seq_len}}

    def load_state_dict(self, state: dict) -> None:
        if "packed" not in state:
            raise ValueError("this data state is not from a packed run (data.packing=true); resume with the "
                             "data.packing setting the checkpoint was trained with")
        st = state["packed"]
        if st["documents"] != len(self.documents):
            raise ValueError(f"the checkpoint was packed from {st['documents']} documents, this data source has "
                             f"{len(self.documents)}; resume on the same data")
        self.epoch, self.doc, self.offset, self.seed = st["epoch"], st["doc"], st["offset"], st["seed"]
        self._order_epoch, self._order = -1, None
