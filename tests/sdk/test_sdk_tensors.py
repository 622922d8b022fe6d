"""torpor.tensors: safetensors files as views of memory the platform filled.

The header parser runs against files written by the `safetensors` package itself (its NumPy
writer), and against damaged headers; with PyTorch (the GPU machine has it), the aligned writer,
the views over a file's bytes and `assign` into a model built on the meta device.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file
from torpor.errors import DataError
from torpor.tensors import ALIGN, header_length, parse_header


def file_bytes(path: Path) -> bytes:
    return path.read_bytes()


def crafted(header: dict[str, object], data: bytes = b"", pad_to: int = 8) -> bytes:
    text = json.dumps(header).encode()
    text += b" " * (-(8 + len(text)) % pad_to)
    return struct.pack("<Q", len(text)) + text + data


def test_entries_of_a_file_written_by_safetensors_point_at_its_arrays(tmp_path: Path) -> None:
    arrays = {
        "w": np.arange(12, dtype=np.float32).reshape(3, 4),
        "n": np.array([7, 8, 9], dtype=np.int64),
        "h": np.arange(5, dtype=np.float16),
        "flag": np.array([True, False]),
        "scalar": np.array(3.5, dtype=np.float64),
        "empty": np.zeros((0, 4), dtype=np.float32),
    }
    save_file(arrays, str(tmp_path / "m.safetensors"), metadata={"model": "x"})
    data = file_bytes(tmp_path / "m.safetensors")
    entries, metadata = parse_header(data, len(data))
    assert metadata == {"model": "x"}
    assert {e.name for e in entries} == set(arrays)
    for e in entries:
        a = arrays[e.name]
        assert e.shape == a.shape
        got = np.frombuffer(data[e.start : e.end], dtype=a.dtype).reshape(a.shape)
        assert np.array_equal(got, a), e.name
    # Only the header is needed, not the data.
    n = header_length(data[:8], len(data))
    assert parse_header(data[: 8 + n], len(data))[0] == entries


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (b"\x01\x02", "is not a safetensors file"),
        (struct.pack("<Q", 1 << 40) + b"{}", "does not fit in its"),
        (struct.pack("<Q", 4) + b"nope", "is not JSON"),
        (struct.pack("<Q", 2) + b"[]", "not a JSON object"),
        (crafted({"t": {"dtype": "F32", "shape": [2]}}), "no dtype, shape and data_offsets"),
        (crafted({"t": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}, b"\0" * 8), "cannot view"),
        (crafted({"t": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8), "damaged or not safetensors"),
        (crafted({"t": {"dtype": "F32", "shape": [3], "data_offsets": [0, 16]}}, b"\0" * 16), "damaged or not safetensors"),
        (crafted({"t": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 0]}}), "damaged or not safetensors"),
        (
            crafted({"u": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}, "t": {"dtype": "F32", "shape": [1], "data_offsets": [2, 6]}}, b"\0" * 6),
            "not a multiple of its 4-byte F32 elements",
        ),
        (crafted({"__metadata__": [1]}), "__metadata__ is not a JSON object"),
    ],
)
def test_a_damaged_header_is_one_error_naming_what_is_wrong(data: bytes, says: str) -> None:
    with pytest.raises(DataError) as e:
        parse_header(data, len(data), "torpor.load_tensors('w')")
    assert says in str(e.value)
    assert str(e.value).startswith("torpor.load_tensors('w')")
    assert "\n" not in str(e.value)


def test_a_header_cut_short_is_refused() -> None:
    data = crafted({"t": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}, b"\0")
    with pytest.raises(DataError, match="bytes given of a"):
        parse_header(data[:12], len(data))


# With PyTorch: the writer, the views and assign.


def test_the_aligned_writer_is_read_by_safetensors_and_aligns_every_tensor_it_can(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file
    from torpor.tensors import save, views

    g = torch.Generator().manual_seed(0)
    tensors = {
        "conv.weight": torch.randn(64, 3, 7, 7, generator=g),  # 37 632 bytes: 147 × 256
        "bn.num_batches_tracked": torch.tensor(5),  # 8 bytes
        "bn.weight": torch.randn(64, generator=g),
        "half": torch.randn(3, generator=g).half(),  # 6 bytes
        "byte": torch.tensor([1, 2, 3], dtype=torch.uint8),
        "bf": torch.randn(128, generator=g).bfloat16(),
    }
    path = tmp_path / "w.safetensors"
    save(tensors, str(path), {"model": "m"})
    back = load_file(str(path))
    assert set(back) == set(tensors)
    for k, t in tensors.items():
        assert torch.equal(back[k], t), k
    data = path.read_bytes()
    entries, metadata = parse_header(data, len(data))
    assert metadata == {"model": "m"}
    for e in entries:
        size = e.end - e.start
        if size % ALIGN == 0:
            assert e.start % ALIGN == 0, e
    blob = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    got, _ = views(blob)
    for k, t in tensors.items():
        assert torch.equal(got[k], t), k
        assert got[k].untyped_storage().data_ptr() == blob.untyped_storage().data_ptr()  # a view, no copy


def test_assign_makes_the_views_the_model_parameters_and_buffers(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from torpor.tensors import assign, save, views

    def build() -> object:
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 8))

    torch.manual_seed(0)
    ref = build().eval()
    state = ref.state_dict()  # BatchNorm's running stats and its int64 counter included
    path = tmp_path / "m.safetensors"
    save(state, str(path))
    blob = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8)
    tensors, _ = views(blob)
    with torch.device("meta"):
        model = build()
    assign(model, tensors)
    model.eval()
    x = torch.randn(4, 8)
    assert torch.equal(model(x), ref(x))
    assert all(not p.requires_grad for p in model.parameters())
    assert model[0].weight.untyped_storage().data_ptr() == blob.untyped_storage().data_ptr()


def test_assign_refuses_what_does_not_fit_and_changes_nothing(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from torpor.tensors import assign

    with torch.device("meta"):
        model = torch.nn.Linear(4, 2)
    with pytest.raises(DataError, match=r"missing \['bias'\]"):
        assign(model, {"weight": torch.zeros(2, 4)})
    with pytest.raises(DataError, match="mismatched"):
        assign(model, {"weight": torch.zeros(4, 2), "bias": torch.zeros(2)})
    with pytest.raises(DataError, match=r"unused \['extra'\]"):
        assign(model, {"weight": torch.zeros(2, 4), "bias": torch.zeros(2), "extra": torch.zeros(1)})
    assert model.weight.device.type == "meta"
    # Tied names: one tensor under two names through aliases.
    with torch.device("meta"):
        tied = torch.nn.ModuleDict({"a": torch.nn.Linear(2, 2, bias=False), "b": torch.nn.Linear(2, 2, bias=False)})
    tied["b"].weight = tied["a"].weight
    w = torch.ones(2, 2)
    assign(tied, {"a.weight": w}, aliases={"b.weight": "a.weight"})
    assert tied["a"].weight is tied["b"].weight
