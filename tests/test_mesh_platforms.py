"""TPU and GPU mesh paths, with fake devices carrying topology attributes (as t5x tests do)."""

import dataclasses
import itertools

import numpy as np
import pytest
from jax.experimental import mesh_utils

from flaxlm.partitioning import build_device_mesh, resolve_mesh_shape, split_dcn_shape


@dataclasses.dataclass(frozen=True)
class FakeDevice:
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


def tpu_torus(dims=(2, 2, 2), hosts=2, slices=1) -> list[FakeDevice]:
    devices = []
    chips = list(itertools.product(*(range(d) for d in reversed(dims))))
    for s in range(slices):
        for n, (z, y, x) in enumerate(chips):
            devices.append(
                FakeDevice(
                    id=s * len(chips) + n,
                    process_index=s * hosts + n * hosts // len(chips),
                    platform="tpu",
                    device_kind="TPU v4",
                    coords=(x, y, z),
                    slice_index=s,
                )
            )
    return devices


def _lines_along(mesh: np.ndarray, axis: int):
    moved = np.moveaxis(mesh, axis, -1)
    return moved.reshape(-1, moved.shape[-1])


def _each_device_once(mesh: np.ndarray, devices) -> None:
    assert sorted(d.id for d in mesh.flat) == sorted(d.id for d in devices)


@pytest.mark.parametrize("shape", [(1, 4, 2), (2, 2, 2), (1, -1, 2), (1, 8, 1)])
def test_gpu_two_hosts_tensor_axis_stays_inside_a_host(shape):
    devices = gpu_hosts(2, 4)
    mesh = build_device_mesh(resolve_mesh_shape(shape, 8), devices)
    _each_device_once(mesh, devices)
    for line in _lines_along(mesh, 2):
        assert len({d.process_index for d in line}) == 1


def test_gpu_data_axis_spanning_hosts_keeps_each_data_slice_on_one_host():
    devices = gpu_hosts(2, 4)
    mesh = build_device_mesh((2, 4, 1), devices)
    for data_index in range(2):
        assert len({d.process_index for d in mesh[data_index].flat}) == 1


def test_gpu_more_hosts_than_data_spreads_over_fsdp_not_tensor():
    devices = gpu_hosts(4, 2)
    mesh = build_device_mesh((2, 2, 2), devices)
    _each_device_once(mesh, devices)
    for line in _lines_along(mesh, 2):
        assert len({d.process_index for d in line}) == 1


def _neighbours(a: FakeDevice, b: FakeDevice, dims=(2, 2, 2)) -> bool:
    steps = [min((p - q) % d, (q - p) % d) for p, q, d in zip(a.coords, b.coords, dims)]
    return sorted(steps) == [0, 0, 1]


@pytest.mark.parametrize("shape", [(1, 4, 2), (2, 2, 2), (1, 8, 1)])
def test_tpu_single_slice_mesh_follows_the_physical_torus(shape):
    devices = tpu_torus()
    mesh = build_device_mesh(shape, devices)
    _each_device_once(mesh, devices)
    np.testing.assert_array_equal(
        np.vectorize(lambda d: d.id)(mesh),
        np.vectorize(lambda d: d.id)(mesh_utils.create_device_mesh(shape, devices)),
    )
    # An axis of size 2 maps onto one physical dimension: its pairs are torus neighbours.
    for axis, size in enumerate(shape):
        if size == 2:
            for a, b in _lines_along(mesh, axis):
                assert _neighbours(a, b), (axis, a.coords, b.coords)


def test_tpu_multi_slice_puts_slices_on_the_data_axis():
    devices = tpu_torus(dims=(2, 2, 1), hosts=1, slices=2)
    mesh = build_device_mesh((2, 2, 2), devices)
    _each_device_once(mesh, devices)
    for data_index in range(2):
        assert {d.slice_index for d in mesh[data_index].flat} == {data_index}
    for line in _lines_along(mesh, 2):
        assert len({d.slice_index for d in line}) == 1


def test_split_dcn_shape_fills_leading_axes_first():
    assert split_dcn_shape((2, 4, 1), 2) == (2, 1, 1)
    assert split_dcn_shape((1, 8, 2), 4) == (1, 4, 1)
    assert split_dcn_shape((2, 4, 2), 8) == (2, 4, 1)
    assert split_dcn_shape((1, 1, 8), 2) == (1, 1, 2)  # only tensor is left to span hosts
    with pytest.raises(ValueError, match="cannot be split over 3"):
        split_dcn_shape((2, 2, 2), 3)


def test_explicit_dcn_shape_that_does_not_divide_the_mesh_names_both():
    with pytest.raises(ValueError, match=r"dcn_mesh_shape \(3, 1, 1\).*\(2, 4, 1\)"):
        build_device_mesh((2, 4, 1), gpu_hosts(2, 4), dcn_mesh_shape=(3, 1, 1))
