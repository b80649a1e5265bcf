"""``load_quantized`` on a file that is missing, not a quantized model, or damaged: one clear
error naming the file, and nothing printed (torch.export logs a traceback before it raises)."""
from __future__ import annotations

import json
import os
import struct
import zipfile
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from xlaunch.kernels.quantize import load_quantized  # noqa: E402

pytestmark = pytest.mark.torch
META = {"format": 1, "mode": "fp32", "report": {"mode": "fp32", "requested": "fp32"}}


def saved(path: Path, meta: object = META) -> Path:
    """A tiny exported program, with our JSON beside it unless ``meta`` is None."""
    program = torch.export.export(torch.nn.Linear(3, 2).eval(), (torch.randn(2, 3),))
    extra = None if meta is None else {"xlaunch-quantize.json": meta if isinstance(meta, str) else json.dumps(meta)}
    torch.export.save(program, str(path), extra_files=extra)
    return path


def damaged_program(path: Path) -> Path:
    """``path`` with the program's JSON overwritten in place (the zip itself stays readable)."""
    data = bytearray(path.read_bytes())
    info = next(i for i in zipfile.ZipFile(path).infolist() if i.filename.endswith("models/model.json"))
    name_len, extra_len = struct.unpack("<HH", data[info.header_offset + 26:info.header_offset + 30])
    start = info.header_offset + 30 + name_len + extra_len
    data[start:start + info.compress_size] = b"{" * info.compress_size
    path.write_bytes(bytes(data))
    return path


def test_each_bad_file_is_one_clear_error_and_nothing_printed(tmp_path: Path,
                                                             capfd: pytest.CaptureFixture) -> None:
    good = saved(tmp_path / "good.pt2")
    loaded = load_quantized(str(good))   # the control: our JSON beside a program loads and runs
    assert loaded.mode == "fp32" and loaded(torch.randn(2, 3)).shape == (2, 2)
    (tmp_path / "garbage.pt2").write_bytes(os.urandom(4096))
    (tmp_path / "truncated.pt2").write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with zipfile.ZipFile(tmp_path / "other.zip", "w") as archive:
        archive.writestr("notes/readme.txt", "not a model")
    os.mkfifo(tmp_path / "fifo.pt2")   # no writer: must not hang
    cases = {
        "missing.pt2": (FileNotFoundError, "missing.pt2: no such file"),
        ".": (ValueError, "is a directory"),
        "fifo.pt2": (ValueError, "fifo.pt2 is not a regular file"),
        "garbage.pt2": (ValueError, "garbage.pt2 is corrupt or not a saved model: BadZipFile"),
        "truncated.pt2": (ValueError, "truncated.pt2 is corrupt or not a saved model"),
        "other.zip": (ValueError, "other.zip was not written by xlaunch quantize"),
        saved(tmp_path / "plain.pt2", None).name: (ValueError, "plain.pt2 was not written by xlaunch quantize"),
        saved(tmp_path / "badjson.pt2", "{mode").name: (ValueError, "badjson.pt2 is corrupt or not a saved model: "
                                                                    "xlaunch-quantize.json: JSONDecodeError"),
        saved(tmp_path / "future.pt2", {**META, "format": 99}).name: (ValueError, "has format 99"),
        damaged_program(saved(tmp_path / "damaged.pt2")).name: (ValueError, "damaged.pt2 is corrupt: torch.export "
                                                                             "cannot load it \\(JSONDecodeError"),
    }
    for name, (error, match) in cases.items():
        with pytest.raises(error, match=match) as raised:
            load_quantized(str(tmp_path / name))
        assert "\n" not in str(raised.value), name
        assert raised.value.__cause__ is None, name   # no chained torch traceback under it
    assert capfd.readouterr() == ("", "")
