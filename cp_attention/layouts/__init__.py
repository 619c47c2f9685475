"""Layouts: which rank holds which token (index maps, packed documents, the registry, gather)."""

from .balanced import BalancedLayout, Piece, place_documents, placement_picture
from .base import Layout
from .builtin import ContiguousLayout, InterleavedLayout, ZigzagLayout
from .documents import (
                        CuSeqlens,
                        check_cu_seqlens,
                        cu_seqlens_from_lengths,
                        cu_seqlens_from_position_ids,
                        cu_seqlens_tuple,
                        document_ids,
                        document_position_ids,
                        longest_document,
                        pad_cu_seqlens,
                        zigzag_chunks,
)
from .registry import LAYOUT_NAMES, get_layout, layout_names, layout_schedule, register_layout

__all__ = ["Layout", "ContiguousLayout", "InterleavedLayout", "ZigzagLayout", "BalancedLayout", "Piece",
           "place_documents", "placement_picture", "CuSeqlens", "check_cu_seqlens", "cu_seqlens_from_lengths",
           "cu_seqlens_from_position_ids", "cu_seqlens_tuple", "document_ids", "document_position_ids",
           "longest_document", "pad_cu_seqlens", "zigzag_chunks", "LAYOUT_NAMES", "get_layout", "layout_names",
           "layout_schedule", "register_layout"]
