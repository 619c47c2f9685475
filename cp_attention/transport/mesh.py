"""``torch.distributed.device_mesh.DeviceMesh`` wherever a CP ``group`` is taken.

A 1-D mesh stands for its one group. A mesh with a dim named ``"cp"`` (the 2-D ``("dp", "cp")`` mesh
of FSDP training) stands for its ``"cp"`` dim's group: this rank's context-parallel group. A 2-D mesh
without a ``"cp"`` (or ``"dp"``) dim is a two-level CP group (``cp_comm_type="a2a+p2p"``: a ring across
dim 0, all-to-all inside dim 1): it stands for all its ranks, whose CP rank is their row-major
flattened mesh rank, and :func:`mesh_levels` gives its two dims' groups. A loss that averages over the
whole mesh asks for :func:`mesh_group` instead.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

__all__ = ["CP_DIM", "DP_DIM", "is_device_mesh", "is_two_level", "cp_group", "mesh_group", "mesh_levels"]

CP_DIM = "cp"  # the mesh dim whose groups are the context-parallel groups
DP_DIM = "dp"  # a data-parallel dim: a 2-D mesh that has one is never a two-level CP group


def is_device_mesh(group: Any) -> bool:
    """Whether ``group`` is a ``DeviceMesh`` (without importing one where torch.distributed lacks it)."""
    if not dist.is_available():
        return False
    from torch.distributed.device_mesh import DeviceMesh

    return isinstance(group, DeviceMesh)


def cp_group(group: Any) -> Any:
    """The process group ``group`` stands for in a CP call: a 1-D mesh's group, a mesh's ``"cp"`` dim's
    group (this rank's), or ``group`` itself (a process group, ``None`` or a transport).

    A two-level mesh (see :func:`is_two_level`) stands for all its ranks (:func:`mesh_group`).

    Raises ``ValueError`` for a mesh of more than one dim without a ``"cp"`` dim that is not two-level.
    """
    if not is_device_mesh(group):
        return group
    names = group.mesh_dim_names or ()
    if CP_DIM in names:
        return group[CP_DIM].get_group() if group.ndim > 1 else group.get_group()
    if group.ndim == 1:
        return group.get_group()
    if is_two_level(group):
        return mesh_group(group)
    raise ValueError(f"a {group.ndim}-D DeviceMesh (dims {names or 'unnamed'}) was given as the context-parallel "
                     f"group, but it has no {CP_DIM!r} dim; name it: init_device_mesh(device_type, (dp, cp), "
                     f"mesh_dim_names=('dp', {CP_DIM!r})), or pass mesh[{CP_DIM!r}]; a 2-D mesh whose both dims "
                     "are context-parallel (cp_comm_type='a2a+p2p') must not name a dim 'dp'")


def is_two_level(group: Any) -> bool:
    """Whether ``group`` is a two-level CP mesh: 2-D, no ``"cp"`` nor ``"dp"`` dim.

    Raises ``ValueError`` for one whose ranks do not increase row-major (as ``init_device_mesh`` makes
    them): its CP ranks would not be its flattened mesh ranks.
    """
    if not is_device_mesh(group) or group.ndim != 2:
        return False
    names = group.mesh_dim_names or ()
    if CP_DIM in names or DP_DIM in names:
        return False
    ranks = group.mesh.flatten()
    if bool((ranks[1:] <= ranks[:-1]).any()):
        raise ValueError(f"a two-level context-parallel DeviceMesh needs ranks increasing row-major (CP rank = "
                         f"flattened mesh rank), got {group.mesh.tolist()}; build it with init_device_mesh")
    return True


def mesh_levels(group: Any) -> tuple[Any, Any] | None:
    """``(outer, inner)`` process groups of a two-level mesh (this rank's dim-0 and dim-1 groups), else None."""
    if not is_two_level(group):
        return None
    return group.get_group(0), group.get_group(1)


def mesh_group(group: Any) -> Any:
    """The process group over EVERY rank of a mesh (``group`` itself if it is not a mesh): what a loss
    averaged over dp x cp reduces over. A mesh over the whole world is the default group (``None``);
    any other mesh of more than one dim is flattened (``DeviceMesh._flatten``, cached by the mesh, so
    only its first call creates a group, and every rank of the world must make that call)."""
    if not is_device_mesh(group):
        return group
    if group.ndim == 1:
        return group.get_group()
    if group.size() == dist.get_world_size():
        return None
    return group._flatten().get_group()
