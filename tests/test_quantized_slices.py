"""A part of an FP8 or MXFP4 tensor reads only its values, blocks and scales, and is the
whole tensor's dequantization there bit for bit."""

from __future__ import annotations

import collections
import json

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from flaxlm.checkpoints import fp8, hf_files, mxfp4

FP8_BLOCK = (16, 12)
QUANTIZATION = dict(quant_method="fp8", fmt="e4m3", weight_block_size=list(FP8_BLOCK))


class CountingReader(hf_files.SafetensorsReader):
    """A `SafetensorsReader` that counts the elements each read returns, by tensor."""

    def __init__(self, path):
        super().__init__(path)
        self.elements = collections.Counter()

    def read(self, name, rows=None, box=None):
        array = super().read(name, rows, box)
        self.elements[name] += array.size
        return array


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    """A [3, 40, 60] FP8 weight (blocks cut short at both far edges) and its scales."""
    rng = np.random.default_rng(0)
    values = rng.normal(size=(3, 40, 60)).astype(ml_dtypes.float8_e4m3fn)
    scales = rng.uniform(0.5, 2, size=(3, 3, 5)).astype(np.float32)
    path = tmp_path_factory.mktemp("fp8")
    tensors = {
        "w": torch.from_numpy(values.view(np.uint8)).view(torch.float8_e4m3fn),
        "w_scale_inv": torch.from_numpy(scales),
    }
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({"quantization_config": QUANTIZATION}))
    return path


@pytest.fixture(scope="module")
def mxfp4_dir(tmp_path_factory):
    """Blocks [3, 10, 4, 16] and scales [3, 10, 4]: a tensor [3, 128, 10]."""
    rng = np.random.default_rng(1)
    path = tmp_path_factory.mktemp("mxfp4")
    tensors = {
        "w_blocks": torch.from_numpy(rng.integers(0, 256, (3, 10, 4, 16), dtype=np.uint8)),
        "w_scales": torch.from_numpy(rng.integers(120, 130, (3, 10, 4), dtype=np.uint8)),
    }
    save_file(tensors, str(path / "model.safetensors"))
    return path


# Boxes across block edges (16 x 12) and inside one block; the last one everything.
FP8_BOXES = [
    (slice(1, 3), slice(5, 21), slice(7, 50)),
    (slice(0, 1), slice(33, 40), slice(25, 35)),
    (slice(2, 3), slice(0, 40), slice(48, 60)),
    (slice(0, 3), slice(0, 40), slice(0, 60)),
]


@pytest.mark.parametrize("box", FP8_BOXES, ids=str)
def test_fp8_box_is_the_whole_dequantization_there_reading_its_blocks_only(fp8_dir, box):
    counting = CountingReader(fp8_dir)
    whole = fp8.dequantized(hf_files.SafetensorsReader(fp8_dir), fp8_dir).read("w")
    got = fp8.dequantized(counting, fp8_dir).read("w", None, box)
    np.testing.assert_array_equal(got, whole[box])
    assert counting.elements["w"] == got.size
    blocks = [box[0].stop - box[0].start] + [
        -(-s.stop // b) - s.start // b for s, b in zip(box[1:], FP8_BLOCK, strict=True)
    ]
    assert counting.elements["w_scale_inv"] == np.prod(blocks)


def test_fp8_box_of_a_fused_tensor_s_rows_counts_from_the_rows(fp8_dir):
    reader = fp8.DequantizedReader(hf_files.SafetensorsReader(fp8_dir), FP8_BLOCK)
    whole = reader.read("w")
    box = (slice(1, 2), slice(3, 11), slice(13, 59))
    np.testing.assert_array_equal(reader.read("w", (1, 3), box), whole[1:3][box])


# Boxes across group edges (32 values a group) and inside one group.
MXFP4_BOXES = [
    (slice(1, 3), slice(20, 100), slice(3, 8)),
    (slice(0, 1), slice(64, 96), slice(0, 10)),
    (slice(2, 3), slice(33, 40), slice(9, 10)),
]


@pytest.mark.parametrize("box", MXFP4_BOXES, ids=str)
def test_mxfp4_box_is_the_whole_dequantization_there_reading_its_groups_only(mxfp4_dir, box):
    counting = CountingReader(mxfp4_dir)
    whole = mxfp4.DequantizedReader(hf_files.SafetensorsReader(mxfp4_dir)).read("w")
    got = mxfp4.DequantizedReader(counting).read("w", None, box)
    np.testing.assert_array_equal(got.view(np.uint16), whole[box].view(np.uint16))
    experts, cols, rows = (s.stop - s.start for s in box)
    groups = -(-box[1].stop // 32) - box[1].start // 32
    assert counting.elements["w_scales"] == experts * rows * groups
    assert counting.elements["w_blocks"] == experts * rows * groups * 16
