"""Mesh decimation behind ManiSkill's ``fast_render``, checked against exact geometry."""

from __future__ import annotations

import math

import numpy as np
import pytest

from rlinf_vla.envs.maniskill.meshes import simplify_mesh, vertex_normals, weld


def uv_sphere(radius: float, rings: int, segments: int) -> tuple[np.ndarray, np.ndarray]:
    """A closed sphere whose every triangle has its own three vertices (as flat-shaded mesh
    files store them): ``2 * segments * (rings - 1)`` triangles."""
    theta = np.linspace(0, math.pi, rings + 1)
    phi = np.linspace(0, 2 * math.pi, segments + 1)[:-1]
    grid = np.stack(
        [
            np.outer(np.sin(theta), np.cos(phi)),
            np.outer(np.sin(theta), np.sin(phi)),
            np.outer(np.cos(theta), np.ones_like(phi)),
        ],
        axis=-1,
    )
    points = np.concatenate([grid[:1, 0], grid[1:-1].reshape(-1, 3), grid[-1:, 0]])

    def index(r: int, s: int) -> int:  # point s of ring r (ring 0 and ring ``rings``: the poles)
        return 1 + (r - 1) * segments + s % segments

    faces = []
    for s in range(segments):
        faces.append((0, index(1, s), index(1, s + 1)))
        faces.append((len(points) - 1, index(rings - 1, s + 1), index(rings - 1, s)))
        for r in range(1, rings - 1):
            a, b = index(r, s), index(r, s + 1)
            c, d = index(r + 1, s), index(r + 1, s + 1)
            faces += [(a, c, b), (b, c, d)]
    v = points * radius
    f = np.asarray(faces)
    return v[f.reshape(-1)].astype(np.float32), np.arange(3 * len(f)).reshape(-1, 3)


def area(v: np.ndarray, f: np.ndarray) -> float:
    c = v[f].astype(np.float64)
    return float(np.linalg.norm(np.cross(c[:, 1] - c[:, 0], c[:, 2] - c[:, 0]), axis=1).sum() / 2)


def test_weld_joins_the_corners_of_a_flat_shaded_mesh() -> None:
    rings, segments = 20, 40
    v, f = uv_sphere(1.0, rings, segments)
    assert len(v) == 3 * len(f)
    welded_v, welded_f = weld(v, f)
    # A sphere of ``rings`` rings has (rings - 1) * segments + 2 distinct points.
    assert len(welded_v) == (rings - 1) * segments + 2
    assert len(welded_f) == len(f) == 2 * segments * (rings - 1)
    np.testing.assert_allclose(welded_v[welded_f], v[f], atol=1e-6)


def test_vertex_normals_of_a_sphere_point_outwards() -> None:
    v, f = weld(*uv_sphere(0.5, 30, 60))
    n = vertex_normals(v, f)
    np.testing.assert_allclose(np.linalg.norm(n, axis=1), 1.0, atol=1e-5)
    radial = v / np.linalg.norm(v, axis=1, keepdims=True)
    assert (np.sum(n * radial, axis=1) > 0.99).all()


def test_simplify_keeps_the_sphere_within_a_few_percent() -> None:
    pytest.importorskip("fast_simplification")
    radius = 0.3
    v, f = uv_sphere(radius, 80, 160)  # 25,280 triangles
    sv, sf, sn = simplify_mesh(v, f, target=800)
    assert 600 <= len(sf) <= 800
    assert sv.dtype == np.float32 and sf.dtype == np.uint32 and sn.shape == sv.shape
    # Still a sphere of the same radius and surface (4 pi r^2), closed, normals outwards.
    np.testing.assert_allclose(np.linalg.norm(sv, axis=1), radius, rtol=0.02)
    assert area(sv, sf) == pytest.approx(4 * math.pi * radius**2, rel=0.03)
    edges = np.sort(np.concatenate([sf[:, [0, 1]], sf[:, [1, 2]], sf[:, [2, 0]]]), axis=1)
    _, uses = np.unique(edges, axis=0, return_counts=True)
    assert (uses == 2).all()  # every edge shared by exactly two triangles: no holes
    assert (np.sum(sn * sv / radius, axis=1) > 0.95).all()
