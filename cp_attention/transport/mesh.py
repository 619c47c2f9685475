"""``torch.distributed.device_mesh.DeviceMesh`` wherever a CP ``group`` is taken.

A 1-D mesh stands for its one group. A mesh with a dim named ``"cp"`` (the 2-D ``("dp", "cp")`` mesh
of FSDP training) stands for its ``"cp"`` dim's group: this rank's context-parallel group. A loss
that averages over the whole mesh asks for :func:`mesh_group` instead.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

__all__ = ["CP_DIM", "is_device_mesh", "cp_group", "mesh_group"]

CP_DIM = "cp"  # the mesh dim whose groups are the context-parallel groups


def is_device_mesh(group: Any) -> bool:
    """Whether ``group`` is a ``DeviceMesh`` (without importing one where torch.distributed lacks it)."""
    if not dist.is_available():
        return False
    from torch.distributed.device_mesh import DeviceMesh

    return isinstance(group, DeviceMesh)


def cp_group(group: Any) -> Any:
    """The process group ``group`` stands for in a CP call: a 1-D mesh's group, a mesh's ``"cp"`` dim's
    group (this rank's), or ``group`` itself (a process group, ``None`` or a transport).

    Raises ``ValueError`` for a mesh of more than one dim without a ``"cp"`` dim.
    """
    if not is_device_mesh(group):
        return group
    names = group.mesh_dim_names or ()
    if CP_DIM in names:
        return group[CP_DIM].get_group() if group.ndim > 1 else group.get_group()
    if group.ndim == 1:
        return group.get_group()
    raise ValueError(f"a {group.ndim}-D DeviceMesh (dims {names or 'unnamed'}) was given as the context-parallel "
                     f"group, but it has no {CP_DIM!r} dim; name it: init_device_mesh(device_type, (dp, cp), "
                     f"mesh_dim_names=('dp', {CP_DIM!r})), or pass mesh[{CP_DIM!r}]")


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
