"""Loading base models (halludetect/lm/hf_models.py): the layers asked for are checked against the
config before any weights load, and a missing model or a 4-bit preset without CUDA is a clear error."""

import pytest
import torch

from halludetect.config import ModelPreset
from halludetect.lm.hf_models import ModelError, check_layers, load_config, load_model


def test_layer_check_before_weights(tiny_model_dir):
    config = load_config(ModelPreset(path=str(tiny_model_dir)))
    assert check_layers("all", config) == [0, 1, 2, 3]
    with pytest.raises(ModelError, match=r"\[7\] out of range: this model has layers 0..3"):
        check_layers([1, 7], config)


def test_missing_model_and_4bit_without_cuda(tmp_path):
    with pytest.raises(ModelError, match="does not exist"):
        load_config(ModelPreset(path=str(tmp_path / "nope")))
    if not torch.cuda.is_available():
        with pytest.raises(ModelError, match="needs a CUDA GPU"):
            load_model(ModelPreset(path=str(tmp_path), quantization={"bits": 4}))
