"""Frozen models read tensor by tensor into the training dtype (trainer.weights): the same model as
``from_pretrained(torch_dtype=…)`` gives, without its whole fp32 copy."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import save_file

from xeonsd.trainer.weights import WeightsFileError, largest_tensor_bytes, load_frozen, read_safetensors


@pytest.mark.parametrize("subfolder", ["unet", "vae"])
def test_load_frozen_gives_what_from_pretrained_gives_in_bf16(tiny_model, subfolder):
    from diffusers import AutoencoderKL, UNet2DConditionModel

    cls = UNet2DConditionModel if subfolder == "unet" else AutoencoderKL
    ours = load_frozen(cls, str(tiny_model), subfolder, torch.bfloat16, None, None)
    theirs = cls.from_pretrained(tiny_model, subfolder=subfolder, torch_dtype=torch.bfloat16)
    a, b = ours.state_dict(), theirs.state_dict()
    assert a.keys() == b.keys()
    assert all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
    assert {p.dtype for p in ours.parameters()} == {torch.bfloat16} and not ours.training
    assert {**ours.config, "_name_or_path": str(ours.config._name_or_path)} == {
        **theirs.config,
        "_name_or_path": str(theirs.config._name_or_path),
    }


def test_read_safetensors_casts_floats_only_and_knows_the_largest_tensor(tmp_path):
    path = tmp_path / "w.safetensors"
    save_file({"w": torch.randn(3, 5), "n": torch.arange(4), "h": torch.randn(2, dtype=torch.float16)}, str(path))
    got = read_safetensors(path, torch.bfloat16)
    assert got["w"].dtype == torch.bfloat16 and torch.equal(got["n"], torch.arange(4))
    assert got["h"].dtype == torch.bfloat16 and got["w"].shape == (3, 5)
    assert largest_tensor_bytes([path]) == 3 * 5 * 4


def test_a_truncated_or_foreign_file_is_refused_naming_it(tmp_path):
    path = tmp_path / "w.safetensors"
    save_file({"w": torch.randn(64, 64)}, str(path))
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(WeightsFileError, match=r"w\.safetensors: the file ends inside tensor 'w'"):
        read_safetensors(path)
    other = tmp_path / "x.safetensors"
    header = json.dumps({"q": {"dtype": "F8_E9", "shape": [1], "data_offsets": [0, 1]}}).encode()
    other.write_bytes(struct.pack("<Q", len(header)) + header + b"\0")
    with pytest.raises(WeightsFileError, match="unsupported dtype 'F8_E9'"):
        read_safetensors(other)
    (tmp_path / "y.safetensors").write_bytes(b"not one")
    with pytest.raises(WeightsFileError, match="not a safetensors file"):
        read_safetensors(tmp_path / "y.safetensors")
