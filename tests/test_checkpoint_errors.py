"""Bad checkpoints: format sniffing on real files of each kind, pickle refused without unpickling, and a
one-line UserError for every broken safetensors file or model directory. docs/errors.md lists each
message."""

from __future__ import annotations

import json
import pickle
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from kdistill.errors import UserError
from kdistill.models.hf_io import load_model, read_safetensors_header, sniff_format
from tests.tiny import make_tiny_model


def one_line_error(fn, *args, **kwargs) -> str:
    with pytest.raises(UserError) as info:
        fn(*args, **kwargs)
    msg = str(info.value)
    assert "\n" not in msg and msg
    return msg


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("models"), family="qwen2", tied=True)


@pytest.fixture
def model_dir(tiny_dir, tmp_path) -> Path:
    """A fresh copy of a good tiny model directory, free to break."""
    return Path(shutil.copytree(tiny_dir, tmp_path / "m"))


def write_gguf(path: Path) -> None:
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.ones((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_apr(path: Path) -> None:
    meta = json.dumps({"model_type": "llama"}).encode()
    path.write_bytes(b"APR\0" + struct.pack("<I", len(meta)) + meta + struct.pack("<I", 0) + b"\0" * 4)


class Boom:
    """Unpickling this creates the marker file: proof of whether anything was unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


# -- sniffing real files ----------------------------------------------------------------------------


def test_sniff_real_files_of_each_kind(tmp_path, tiny_dir):
    # names deliberately lie: the format comes from the bytes
    write_gguf(tmp_path / "model.safetensors.gguf-really")
    write_apr(tmp_path / "weights.bin")
    torch.save({"w": torch.ones(2)}, tmp_path / "a.gguf")
    (tmp_path / "b.apr").write_bytes(pickle.dumps({"w": [1.0, 2.0]}))
    shutil.copyfile(tiny_dir / "model.safetensors", tmp_path / "c.pt")
    (tmp_path / "d.safetensors").write_bytes(b"hello, not a model at all")
    assert sniff_format(tmp_path / "model.safetensors.gguf-really") == "gguf"
    assert sniff_format(tmp_path / "weights.bin") == "apr"
    assert sniff_format(tmp_path / "a.gguf") == "torch-zip"
    assert sniff_format(tmp_path / "b.apr") == "pickle"
    assert sniff_format(tmp_path / "c.pt") == "safetensors"
    assert sniff_format(tmp_path / "d.safetensors") == "unknown"
    (tmp_path / "empty").write_bytes(b"")
    assert sniff_format(tmp_path / "empty") == "unknown"


def test_sniff_missing_file_is_one_line(tmp_path):
    assert "cannot read" in one_line_error(sniff_format, tmp_path / "nope")


@pytest.mark.parametrize("name", ["pytorch_model.bin", "model.safetensors"])
def test_pickle_is_refused_and_never_unpickled(model_dir, tmp_path, name):
    marker = tmp_path / "UNPICKLED"
    (model_dir / "model.safetensors").unlink()
    (model_dir / name).write_bytes(pickle.dumps(Boom(marker)))
    msg = one_line_error(load_model, model_dir)
    assert f"{model_dir / name}: is a Python pickle checkpoint; refused: kdistill never unpickles" in msg
    assert not marker.exists()


def test_torch_zip_is_refused_and_never_unpickled(model_dir, tmp_path):
    marker = tmp_path / "UNPICKLED"
    (model_dir / "model.safetensors").unlink()
    torch.save({"x": Boom(marker)}, model_dir / "pytorch_model.bin")
    assert not marker.exists()
    msg = one_line_error(load_model, model_dir)
    assert "is a PyTorch zip (torch.save) pickle checkpoint; refused: kdistill never unpickles" in msg
    assert not marker.exists()


def test_gguf_gets_conversion_advice(model_dir):
    (model_dir / "model.safetensors").unlink()
    write_gguf(model_dir / "model-q8_0.gguf")
    msg = one_line_error(load_model, model_dir)
    assert "is a GGUF (llama.cpp) file" in msg and "gguf_file=" in msg and "safetensors" in msg


def test_apr_gets_conversion_advice(model_dir):
    (model_dir / "model.safetensors").unlink()
    write_apr(model_dir / "model.apr")
    msg = one_line_error(load_model, model_dir)
    assert "is an aprender APR model" in msg and "apr export" in msg


def test_gguf_passed_as_file(tmp_path):
    write_gguf(tmp_path / "m.gguf")
    assert "is a GGUF (llama.cpp) file" in one_line_error(load_model, tmp_path / "m.gguf")


def test_no_weights_at_all(model_dir):
    (model_dir / "model.safetensors").unlink()
    assert "no model.safetensors or model.safetensors.index.json" in one_line_error(load_model, model_dir)


# -- broken safetensors files -----------------------------------------------------------------------


def test_truncated_safetensors(model_dir):
    f = model_dir / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    msg = one_line_error(load_model, model_dir)
    assert msg.startswith(f"{f}: tensor '") and "past the end of the data" in msg and "truncated file" in msg


def test_file_shorter_than_length_field(tmp_path):
    f = tmp_path / "x.safetensors"
    f.write_bytes(b"\x10\x00\x00")
    assert one_line_error(read_safetensors_header, f) == (
        f"{f}: truncated safetensors file (3 bytes; expected an 8-byte header length first)"
    )


def test_header_length_past_end_of_file(tmp_path):
    f = tmp_path / "x.safetensors"
    f.write_bytes(struct.pack("<Q", 1 << 40) + b'{"a": 1}')
    assert one_line_error(read_safetensors_header, f) == (
        f"{f}: safetensors header length 1099511627776 runs past the end of the file (16 bytes): "
        "the file is truncated or not safetensors"
    )


def test_corrupt_header_json(model_dir):
    f = model_dir / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[8 + 5 : 8 + 9] = b"\x00}{]"
    f.write_bytes(bytes(data))
    msg = one_line_error(load_model, model_dir)
    assert msg == f"{f}: corrupt safetensors header (not valid JSON: Invalid control character at byte 13)"


def test_header_not_an_object(tmp_path):
    f = tmp_path / "x.safetensors"
    f.write_bytes(struct.pack("<Q", 2) + b"[]")
    assert "expected a JSON object, got list" in one_line_error(read_safetensors_header, f)


@pytest.mark.parametrize("dtype,st", [(torch.int8, "I8"), (torch.float64, "F64")])
def test_unsupported_dtype(tmp_path, dtype, st):
    f = tmp_path / "x.safetensors"
    save_file({"w": torch.zeros(3, 2, dtype=dtype)}, f)
    assert one_line_error(read_safetensors_header, f) == (
        f"{f}: tensor 'w': dtype {st} is not supported (supported: F32, F16, BF16)"
    )


def test_unsupported_dtype_in_model(model_dir):
    f = model_dir / "model.safetensors"
    t = load_file(f)
    t["model.norm.weight"] = t["model.norm.weight"].double()
    save_file(t, f)
    msg = one_line_error(load_model, model_dir)
    assert msg == f"{f}: tensor 'model.norm.weight': dtype F64 is not supported (supported: F32, F16, BF16)"


def test_offsets_disagree_with_shape(tmp_path):
    f = tmp_path / "x.safetensors"
    header = json.dumps({"w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 20]}}).encode()
    f.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 24)
    assert "bad data_offsets [0, 20]: 20 bytes, but shape [2, 3] in F32 needs 24" in one_line_error(
        read_safetensors_header, f
    )


def test_overlapping_tensors(tmp_path):
    f = tmp_path / "x.safetensors"
    header = json.dumps(
        {
            "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
            "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
        }
    ).encode()
    f.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 12)
    assert "tensors 'a' and 'b' overlap" in one_line_error(read_safetensors_header, f)


def test_bad_shape_field(tmp_path):
    f = tmp_path / "x.safetensors"
    header = json.dumps({"w": {"dtype": "F32", "shape": [2, -1], "data_offsets": [0, 0]}}).encode()
    f.write_bytes(struct.pack("<Q", len(header)) + header)
    assert "header field 'shape' is [2, -1], expected a list of non-negative ints" in one_line_error(
        read_safetensors_header, f
    )


# -- model directories that disagree with config.json -----------------------------------------------


def test_missing_tensor(model_dir):
    f = model_dir / "model.safetensors"
    t = load_file(f)
    del t["model.layers.1.self_attn.k_proj.bias"]
    save_file(t, f)
    assert one_line_error(load_model, model_dir) == (
        f"{f}: missing tensor 'model.layers.1.self_attn.k_proj.bias' (expected by {model_dir / 'config.json'})"
    )


def test_unexpected_tensor(model_dir):
    f = model_dir / "model.safetensors"
    t = load_file(f)
    t["model.layers.0.mlp.extra_proj.weight"] = torch.zeros(2, 2)
    save_file(t, f)
    assert one_line_error(load_model, model_dir) == (
        f"{f}: unexpected tensor 'model.layers.0.mlp.extra_proj.weight' (not part of a qwen2 model with the "
        f"shapes in {model_dir / 'config.json'})"
    )


def test_shape_disagrees_with_config(model_dir):
    cfg_path = model_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["intermediate_size"] = 48
    cfg_path.write_text(json.dumps(cfg))
    assert one_line_error(load_model, model_dir) == (
        f"{model_dir / 'model.safetensors'}: tensor 'model.layers.0.mlp.gate_proj.weight' has shape [64, 32], "
        f"expected [48, 32] from {cfg_path}"
    )


def test_unknown_architecture(model_dir):
    cfg_path = model_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["model_type"] = "gpt2"
    cfg["architectures"] = ["GPT2LMHeadModel"]
    cfg_path.write_text(json.dumps(cfg))
    assert one_line_error(load_model, model_dir) == (
        f"{cfg_path}: architecture 'gpt2' is not supported (supported model_type: llama, qwen2, qwen3)"
    )


def test_missing_config(model_dir):
    (model_dir / "config.json").unlink()
    assert "no such file (expected a Hugging Face config.json)" in one_line_error(load_model, model_dir)


def test_not_a_directory(tmp_path):
    assert "not a directory" in one_line_error(load_model, tmp_path / "nowhere")


# -- sharded index --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sharded_dir(tmp_path_factory) -> Path:
    return make_tiny_model(
        tmp_path_factory.mktemp("sharded"), family="llama", tied=False, max_shard_size="20KB"
    )


def _edit_index(d: Path, fn) -> Path:
    p = d / "model.safetensors.index.json"
    idx = json.loads(p.read_text())
    fn(idx["weight_map"])
    p.write_text(json.dumps(idx))
    return p


def test_index_naming_a_file_outside_the_directory(sharded_dir, tmp_path):
    d = Path(shutil.copytree(sharded_dir, tmp_path / "s"))
    shutil.copyfile(d / "model-00001-of-00007.safetensors", tmp_path / "evil.safetensors")
    p = _edit_index(d, lambda wm: wm.__setitem__("model.norm.weight", "../evil.safetensors"))
    assert one_line_error(load_model, d) == (
        f"{p}: weight_map['model.norm.weight'] is '../evil.safetensors', expected a file name inside {d}"
    )


def test_index_naming_a_missing_shard(sharded_dir, tmp_path):
    d = Path(shutil.copytree(sharded_dir, tmp_path / "s"))
    (d / "model-00002-of-00007.safetensors").unlink()
    msg = one_line_error(load_model, d)
    assert "names model-00002-of-00007.safetensors, which does not exist" in msg


def test_index_pointing_at_wrong_shard(sharded_dir, tmp_path):
    d = Path(shutil.copytree(sharded_dir, tmp_path / "s"))
    wrong = "model-00001-of-00007.safetensors"
    name = next(
        n
        for n, f in json.loads((d / "model.safetensors.index.json").read_text())["weight_map"].items()
        if f != wrong
    )
    p = _edit_index(d, lambda wm: wm.__setitem__(name, wrong))
    assert (
        one_line_error(load_model, d)
        == f"{p}: weight_map says tensor {name!r} is in {wrong}, but that file lacks it"
    )
