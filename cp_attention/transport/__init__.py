"""Transports: how one rank talks to the others of its group (process group, loopback, replay)."""

from .base import Pending, Transport
from .loopback import LoopbackGroup, LoopbackRank
from .mesh import CP_DIM, cp_group, is_device_mesh, mesh_group
from .process_group import ProcessGroupTransport, group_rank_and_size, transport_for

__all__ = ["Pending", "Transport", "LoopbackGroup", "LoopbackRank", "ProcessGroupTransport",
           "group_rank_and_size", "transport_for",
           "CP_DIM", "cp_group", "is_device_mesh", "mesh_group"]
