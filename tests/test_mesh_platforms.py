"""TPU and GPU mesh paths, with fake devices carrying topology attributes (as t5x tests do).

`jax.sharding.Mesh` accepts these hashable fakes, so the Partitioner itself is built for them
where a test needs the Mesh (its data layout); the rest checks `build_device_mesh`'s array.
"""

import dataclasses
import itertools
import random

import numpy as np
import pytest
from jax.experimental import mesh_utils

from flaxlm.parallel.partitioning import (
    Partitioner,
    build_device_mesh,
    resolve_mesh_shape,
    split_dcn_shape,
)


@dataclasses.dataclass(frozen=True)
class FakeDevice:
    """What `mesh_utils` reads off a device."""

    id: int
    process_index: int
    platform: str
    device_kind: str
    coords: tuple[int, int, int] = (0, 0, 0)
    core_on_chip: int = 0
    slice_index: int = 0


def gpu_hosts(num_hosts: int, per_host: int) -> list[FakeDevice]:
    return [
        FakeDevice(id=h * per_host + i, process_index=h, platform="gpu", device_kind="NVIDIA H100")
        for h in range(num_hosts)
        for i in range(per_host)
    ]


def tpu_slices(dims, host_block, kind="TPU v4", slices=1) -> list[FakeDevice]:
    """`slices` tori of `dims` (x, y, z) chips; each host holds a `host_block` of chips.

    Listed as `jax.devices()` lists them: by process (slice-major), then z, y, x.
    """
    per_dim = [d // b for d, b in zip(dims, host_block)]
    hosts_per_slice = int(np.prod(per_dim))
    chips = []
    for s in range(slices):
        for z, y, x in itertools.product(*(range(d) for d in reversed(dims))):
            block = (x // host_block[0], y // host_block[1], z // host_block[2])
            host = block[0] + per_dim[0] * (block[1] + per_dim[1] * block[2])
            chips.append((s * hosts_per_slice + host, (z, y, x), s))
    chips.sort()
    return [
        FakeDevice(
            id=i,
            process_index=p,
            platform="tpu",
            device_kind=kind,
            coords=(x, y, z),
            slice_index=s,
        )
        for i, (p, (z, y, x), s) in enumerate(chips)
    ]


V4_16 = dict(dims=(2, 2, 2), host_block=(2, 2, 1))  # 8 chips, 2 hosts (one per z)
V4_32 = dict(dims=(2, 2, 4), host_block=(2, 2, 1))  # 16 chips, 4 hosts along z
V4_128 = dict(dims=(4, 4, 4), host_block=(2, 2, 1))  # 64 chips, 16 hosts


def _ids(mesh: np.ndarray) -> np.ndarray:
    return np.vectorize(lambda d: d.id)(mesh)


def _lines_along(mesh: np.ndarray, axis: int) -> np.ndarray:
    moved = np.moveaxis(mesh, axis, -1)
    return moved.reshape(-1, moved.shape[-1])


def _each_device_once(mesh: np.ndarray, devices) -> None:
    assert sorted(d.id for d in mesh.flat) == sorted(d.id for d in devices)


def _neighbours(a: FakeDevice, b: FakeDevice, dims) -> bool:
    """One step in one torus dimension, wraparound allowed."""
    steps = [min((p - q) % d, (q - p) % d) for p, q, d in zip(a.coords, b.coords, dims)]
    return sorted(steps) == [0, 0, 1]


def _pairs_along(mesh: np.ndarray, axis: int, wrap: bool = False):
    for line in _lines_along(mesh, axis):
        yield from zip(line[:-1], line[1:])
        if wrap and len(line) > 2:
            yield line[-1], line[0]


def _each_host_feeds_one_block_of_rows(mesh: np.ndarray) -> None:
    """Hosts hold contiguous rows of the batch, which is split over (data, fsdp)."""
    rows = mesh.reshape(mesh.shape[0] * mesh.shape[1], -1)
    held: dict[int, set[int]] = {}
    for r, row in enumerate(rows):
        for d in row:
            held.setdefault(d.process_index, set()).add(r)
    for host, rs in held.items():
        assert sorted(rs) == list(range(min(rs), max(rs) + 1)), (host, sorted(rs))


# ---------------------------------------------------------------------------------- GPU


@pytest.mark.parametrize("shape", [(1, 4, 2), (2, 2, 2), (1, -1, 2), (1, 8, 1), (2, 1, 4)])
def test_gpu_two_hosts_tensor_axis_stays_inside_a_host(shape):
    devices = gpu_hosts(2, 4)
    mesh = build_device_mesh(resolve_mesh_shape(shape, 8), devices)
    _each_device_once(mesh, devices)
    for line in _lines_along(mesh, 2):
        assert len({d.process_index for d in line}) == 1
    _each_host_feeds_one_block_of_rows(mesh)


def test_gpu_data_axis_spanning_hosts_keeps_each_data_slice_on_one_host():
    devices = gpu_hosts(2, 4)
    mesh = build_device_mesh((2, 4, 1), devices)
    _each_device_once(mesh, devices)
    for data_index in range(2):
        assert {d.process_index for d in mesh[data_index].flat} == {data_index}


def test_gpu_more_hosts_than_data_spreads_over_fsdp_not_tensor():
    devices = gpu_hosts(4, 2)
    mesh = build_device_mesh((2, 2, 2), devices)
    _each_device_once(mesh, devices)
    for line in _lines_along(mesh, 2):
        assert len({d.process_index for d in line}) == 1
    _each_host_feeds_one_block_of_rows(mesh)


def test_gpu_one_host_mesh_is_in_device_id_order_whatever_the_list_order():
    devices = gpu_hosts(1, 8)
    shuffled = random.Random(0).sample(devices, len(devices))
    mesh = build_device_mesh((1, 4, 2), shuffled)
    np.testing.assert_array_equal(_ids(mesh).ravel(), np.arange(8))


def test_gpu_partitioner_on_fake_devices_gives_each_host_half_the_batch():
    p = Partitioner(mesh_shape=(1, -1, 2), devices=gpu_hosts(2, 4))
    assert dict(p.mesh.shape) == {"data": 1, "fsdp": 4, "tensor": 2}
    layout = p.data_layout(16)
    assert (layout.per_host_batch_size, layout.num_shards, layout.shard_index) == (8, 2, 0)


# -------------------------------------------------------------------- TPU, one slice


@pytest.mark.parametrize("shape", [(2, 2, 2), (1, 2, 4), (2, 4, 1), (2, 1, 4)])
def test_tpu_single_slice_mesh_follows_the_physical_torus(shape):
    devices = tpu_slices(**V4_16)
    mesh = build_device_mesh(shape, devices)
    _each_device_once(mesh, devices)
    # Here the torus layout already keeps each host in one block, so it is used as is.
    np.testing.assert_array_equal(_ids(mesh), _ids(mesh_utils.create_device_mesh(shape, devices)))
    # An axis of size 2 lies along one physical dimension: its pairs are torus neighbours.
    for axis, size in enumerate(shape):
        if size == 2:
            for a, b in _pairs_along(mesh, axis):
                assert _neighbours(a, b, V4_16["dims"]), (axis, a.coords, b.coords)
    _each_host_feeds_one_block_of_rows(mesh)


def test_tpu_single_slice_axes_are_rings_of_physical_neighbours_with_wraparound():
    devices = tpu_slices(**V4_32)
    mesh = build_device_mesh((4, 2, 2), devices)
    _each_device_once(mesh, devices)
    np.testing.assert_array_equal(
        _ids(mesh), _ids(mesh_utils.create_device_mesh((4, 2, 2), devices))
    )
    for axis in range(3):
        for a, b in _pairs_along(mesh, axis, wrap=True):
            assert _neighbours(a, b, V4_32["dims"]), (axis, a.coords, b.coords)
    _each_host_feeds_one_block_of_rows(mesh)


def test_tpu_v5e_tray_innermost_axis_is_the_physical_ring():
    # "TPU v5 lite" has its own mesh_utils handler: the 8 chips of a 4x2 tray form a ring.
    devices = tpu_slices(dims=(4, 2, 1), host_block=(4, 2, 1), kind="TPU v5 lite")
    mesh = build_device_mesh((1, 8, 1), devices)
    np.testing.assert_array_equal(
        _ids(mesh), _ids(mesh_utils.create_device_mesh((1, 8, 1), devices))
    )
    for a, b in _pairs_along(mesh, 1, wrap=True):
        assert _neighbours(a, b, (4, 2, 1)), (a.coords, b.coords)


@pytest.mark.parametrize("shape", [(1, -1, 1), (1, 4, 2), (8, 1, 1), (4, 2, 1)])
def test_tpu_single_slice_over_two_hosts_gives_each_host_one_block_of_the_batch(shape):
    # Following the torus would interleave the two hosts along fsdp/data here, so that no host
    # could feed a contiguous range of the batch; the mesh is tiled by host instead.
    devices = tpu_slices(**V4_16)
    p = Partitioner(mesh_shape=shape, devices=devices)
    mesh = p.mesh.devices
    _each_device_once(mesh, devices)
    _each_host_feeds_one_block_of_rows(mesh)
    for a, b in _pairs_along(mesh, 2):
        assert _neighbours(a, b, V4_16["dims"])
    layout = p.data_layout(16)
    assert (layout.per_host_batch_size, layout.num_shards) == (8, 2)


@pytest.mark.parametrize(
    "slice_kw, shape",
    [
        (V4_128, (1, 32, 2)),  # tensor 2 splits a physical axis of 4
        (V4_128, (4, 8, 2)),
        (V4_128, (1, 16, 4)),
        (dict(dims=(4, 4, 1), host_block=(2, 2, 1), kind="TPU v5 lite"), (1, 8, 2)),
    ],
)
def test_tpu_single_slice_shapes_off_the_torus_axes_still_build(slice_kw, shape):
    devices = tpu_slices(**slice_kw)
    mesh = build_device_mesh(shape, devices)
    _each_device_once(mesh, devices)
    _each_host_feeds_one_block_of_rows(mesh)
    if shape[2] == 2:
        for a, b in _pairs_along(mesh, 2):
            assert _neighbours(a, b, slice_kw["dims"]), (a.coords, b.coords)


# ------------------------------------------------------------------ TPU, several slices


@pytest.mark.parametrize("shape", [(2, 2, 2), (2, 4, 1), (-1, 1, 4)])
def test_tpu_multi_slice_puts_slices_on_the_data_axis(shape):
    devices = tpu_slices(dims=(2, 2, 1), host_block=(2, 2, 1), slices=2)
    shape = resolve_mesh_shape(shape, 8)
    assert split_dcn_shape(shape, 2)[0] == 2
    mesh = build_device_mesh(shape, devices)
    _each_device_once(mesh, devices)
    for data_index in range(2):
        assert {d.slice_index for d in mesh[data_index].flat} == {data_index}
    for line in _lines_along(mesh, 2):
        assert len({d.slice_index for d in line}) == 1
    # Inside a slice the mesh is that slice's own torus mesh.
    for s in range(2):
        own = [d for d in devices if d.slice_index == s]
        expected = mesh_utils.create_device_mesh((1, *shape[1:]), own)
        np.testing.assert_array_equal(_ids(mesh[s : s + 1]), _ids(expected))


def test_tpu_multi_slice_without_a_data_axis_puts_slices_on_fsdp_not_tensor():
    devices = tpu_slices(dims=(2, 2, 1), host_block=(2, 2, 1), slices=2)
    mesh = build_device_mesh((1, 4, 2), devices)
    _each_device_once(mesh, devices)
    assert [{d.slice_index for d in mesh[0, i]} for i in range(4)] == [{0}, {0}, {1}, {1}]


@pytest.mark.parametrize("shape", [(2, 8, 1), (2, 4, 2), (1, 16, 1)])
def test_tpu_multi_slice_of_two_hosts_each_keeps_slices_and_hosts_in_blocks(shape):
    devices = tpu_slices(**V4_16, slices=2)  # 4 hosts, 2 per slice
    p = Partitioner(mesh_shape=shape, devices=devices)
    mesh = p.mesh.devices
    _each_device_once(mesh, devices)
    _each_host_feeds_one_block_of_rows(mesh)
    rows = mesh.reshape(shape[0] * shape[1], -1)
    half = len(rows) // 2
    assert {d.slice_index for d in rows[:half].flat} == {0}
    assert {d.slice_index for d in rows[half:].flat} == {1}
    for line in _lines_along(mesh, 2):
        assert len({d.slice_index for d in line}) == 1
    assert p.data_layout(32).num_shards == 4


# ------------------------------------------------------------------------- dcn shapes


@pytest.mark.parametrize(
    "mesh_shape, granules, expected",
    [
        ((2, 4, 1), 2, (2, 1, 1)),
        ((1, 8, 2), 4, (1, 4, 1)),
        ((2, 4, 2), 8, (2, 4, 1)),
        ((4, 2, 2), 2, (2, 1, 1)),
        ((6, 4, 1), 4, (2, 2, 1)),
        ((1, 1, 8), 2, (1, 1, 2)),  # only tensor is left to span hosts
        ((2, 2, 2), 1, (1, 1, 1)),
    ],
)
def test_split_dcn_shape_fills_leading_axes_first(mesh_shape, granules, expected):
    assert split_dcn_shape(mesh_shape, granules) == expected


def test_split_dcn_shape_that_cannot_split_names_shape_and_count():
    with pytest.raises(ValueError, match=r"\(2, 2, 2\) cannot be split over 3"):
        split_dcn_shape((2, 2, 2), 3)


def test_explicit_dcn_shape_that_does_not_divide_the_mesh_names_both():
    with pytest.raises(ValueError, match=r"dcn_mesh_shape \(3, 1, 1\).*\(2, 4, 1\)"):
        build_device_mesh((2, 4, 1), gpu_hosts(2, 4), dcn_mesh_shape=(3, 1, 1))
    with pytest.raises(ValueError, match=r"dcn_mesh_shape \(2, 1\).*\(2, 4, 1\)"):
        build_device_mesh((2, 4, 1), gpu_hosts(2, 4), dcn_mesh_shape=(2, 1))


def test_explicit_dcn_shape_that_divides_the_mesh_is_used():
    mesh = build_device_mesh((1, 8, 1), gpu_hosts(2, 4), dcn_mesh_shape=(1, 2, 1))
    assert [d.process_index for d in mesh.flat] == [0, 0, 0, 0, 1, 1, 1, 1]
