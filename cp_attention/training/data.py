"""Byte-level training data that needs no download: Python's bundled help texts, a local text or
JSONL file, or synthetic bytes. Tokens are bytes (vocabulary 256)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch

__all__ = ["load_bytes", "ByteBatches", "VOCAB_SIZE"]

VOCAB_SIZE = 256


def load_bytes(source: str, path: Optional[str] = None, text_key: str = "text", synthetic_len: int = 1 << 20,
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
        self.generator.set_state(state["generator"])
