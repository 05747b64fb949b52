"""Cheaper CPU rendering of ManiSkill scenes: decimated copies of the dense visual meshes.

On a CPU (SAPIEN on Mesa's llvmpipe) a camera's cost is almost all vertex work: PickCube's scene
holds about 157,000 triangles, 106,000 of them in the Panda's links, and a 128 px image takes
40-70 ms whatever its size. Quadric decimation of each dense render body to about 2,000
triangles leaves a picture that differs from the full one by well under 1/255 on average (a
pixel of the arm's outline here and there) and renders about 2x faster (docs/envs.md,
"Throughput").

Only render bodies made entirely of untextured triangle meshes are replaced (a texture needs its
UV coordinates, which decimation does not carry); primitives, textured meshes (the floor) and
small bodies stay as they are.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

#: Triangles a render body keeps at most once decimated.
MAX_TRIANGLES = 2000

_TEXTURES = (
    "base_color_texture",
    "diffuse_texture",
    "normal_texture",
    "emission_texture",
    "roughness_texture",
    "metallic_texture",
    "transmission_texture",
)


def weld(
    vertices: np.ndarray, triangles: np.ndarray, tol: float = 1e-6
) -> tuple[np.ndarray, np.ndarray]:
    """Merge vertices closer than ``tol`` and drop the triangles that collapse.

    Mesh files store a vertex once per face corner where the normals differ (hard edges,
    flat shading); decimation needs the connected surface.
    """
    keys = np.round(np.asarray(vertices, dtype=np.float64) / tol).astype(np.int64)
    _, first, inverse = np.unique(keys, axis=0, return_index=True, return_inverse=True)
    faces = inverse.reshape(-1)[np.asarray(triangles, dtype=np.int64)]
    keep = (
        (faces[:, 0] != faces[:, 1]) & (faces[:, 1] != faces[:, 2]) & (faces[:, 0] != faces[:, 2])
    )
    return np.asarray(vertices, dtype=np.float32)[first], faces[keep]


def vertex_normals(vertices: np.ndarray, triangles: np.ndarray) -> np.ndarray:
    """Unit vertex normals: the area-weighted sum of the adjacent faces' normals."""
    v = vertices.astype(np.float64)
    corners = v[triangles]
    face = np.cross(corners[:, 1] - corners[:, 0], corners[:, 2] - corners[:, 0])
    normals = np.zeros_like(v)
    for k in range(3):
        np.add.at(normals, triangles[:, k], face)
    length = np.linalg.norm(normals, axis=1, keepdims=True)
    return (normals / np.maximum(length, 1e-12)).astype(np.float32)


def simplify_mesh(
    vertices: np.ndarray, triangles: np.ndarray, target: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Weld, then decimate to at most ``target`` triangles (quadric error metric).

    Returns float32 vertices ``[V, 3]``, uint32 triangles ``[T, 3]`` and float32 unit vertex
    normals ``[V, 3]`` (smooth shading over the welded surface).
    """
    try:
        import fast_simplification
    except ImportError as e:
        raise ImportError(
            "fast_render needs fast-simplification: pip install 'rlinf-vla[maniskill]'"
        ) from e
    v, f = weld(vertices, triangles)
    if len(f) > target:
        v, f = fast_simplification.simplify(v, f, target_count=max(int(target), 4))
    v = np.ascontiguousarray(v, dtype=np.float32)
    f = np.ascontiguousarray(f, dtype=np.uint32)
    return v, f, vertex_normals(v, f)


def _textured(material: Any) -> bool:
    return material is not None and any(getattr(material, t) is not None for t in _TEXTURES)


class SceneSimplifier:
    """Replaces the dense render bodies of a ManiSkill CPU scene by decimated copies.

    Call :meth:`apply` after every reset: tasks rebuild their scene when they reconfigure, and
    bodies already small enough are left alone, so a second call changes nothing. Decimated
    meshes are cached by content, so a rebuilt scene costs a lookup.
    """

    def __init__(self, max_triangles: int = MAX_TRIANGLES) -> None:
        self.max_triangles = max_triangles
        self._cache: dict[bytes, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def apply(self, scene: Any) -> None:
        """Decimate the dense render bodies of ``scene`` (a ManiSkill scene)."""
        import sapien

        for sub in scene.sub_scenes:
            for entity in sub.entities:
                body = entity.find_component_by_type(sapien.render.RenderBodyComponent)
                if body is not None:
                    self._apply_body(entity, body, sapien.render)

    def _apply_body(self, entity: Any, body: Any, render: Any) -> None:
        shapes = body.render_shapes
        if not all(isinstance(s, render.RenderShapeTriangleMesh) for s in shapes):
            return  # primitives: boxes, spheres, ...
        parts = [(shape, part, len(part.triangles)) for shape in shapes for part in shape.parts]
        n = sum(count for _, _, count in parts)
        if n <= self.max_triangles or any(_textured(part.material) for _, part, _ in parts):
            return
        new = render.RenderBodyComponent()
        new.name = body.name
        for shape, part, count in parts:
            target = max(count * self.max_triangles // n, 4)
            if count <= target:  # small already: kept as it is
                v, f = part.vertices, part.triangles
                normals, uvs = part.get_vertex_normal(), part.get_vertex_uv()
            else:
                v, f, normals = self._simplified(part, target)
                uvs = np.zeros((len(v), 2), np.float32)
            piece = render.RenderShapeTriangleMesh(v, f, normals, uvs, part.material)
            piece.local_pose = shape.local_pose
            piece.set_scale(shape.scale)
            piece.front_face = shape.front_face
            new.attach(piece)
        visibility = body.visibility
        render_id_off = body.is_render_id_disabled
        entity.remove_component(body)
        entity.add_component(new)
        new.visibility = visibility
        if render_id_off:
            new.disable_render_id()

    def _simplified(self, part: Any, target: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        vertices, triangles = part.vertices, part.triangles
        digest = hashlib.blake2b(digest_size=16)
        for array in (vertices, triangles, np.int64(target)):
            digest.update(np.ascontiguousarray(array).tobytes())
        key = digest.digest()
        if key not in self._cache:
            self._cache[key] = simplify_mesh(vertices, triangles, target)
        return self._cache[key]
