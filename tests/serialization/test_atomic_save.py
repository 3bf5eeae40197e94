"""A failed save never destroys a good file; paths that are not .pt2 files get clear errors."""

from __future__ import annotations

import os
import stat
import threading
import zipfile

import pytest
import torch

import branchyard
from branchyard.cli import main
from branchyard.errors import SerializationError


class AddK(torch.nn.Module):
    def __init__(self, k: float) -> None:
        super().__init__()
        self.k = torch.nn.Parameter(torch.tensor(k))

    def forward(self, x):
        return x + self.k


def _program(k: float = 1.0):
    return torch.export.export(AddK(k), (torch.zeros(2),))


@pytest.fixture()
def good_file(tmp_path):
    path = tmp_path / "model.pt2"
    branchyard.save(_program(1.0), path)
    return path


def _leftovers(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name != "model.pt2")


def _crash_mid_write(monkeypatch, exc=RuntimeError("disk on fire")):
    """torch.export.save writes half an archive, then fails."""
    real = torch.export.save

    def half(program, f, **kwargs):
        with open(f, "wb") as fh:
            fh.write(b"PK\x03\x04 half an archive")
        raise exc

    monkeypatch.setattr(torch.export, "save", half)
    return real


def test_crash_mid_write_leaves_the_old_file(good_file, monkeypatch):
    before = good_file.read_bytes()
    _crash_mid_write(monkeypatch)
    with pytest.raises(SerializationError, match=r"model\.pt2.*could not write.*disk on fire"):
        branchyard.save(_program(2.0), good_file)
    assert good_file.read_bytes() == before
    assert _leftovers(good_file.parent) == []
    monkeypatch.undo()
    torch.testing.assert_close(branchyard.load(good_file).module()(torch.zeros(2)), torch.ones(2))


def test_interrupt_mid_write_leaves_the_old_file(good_file, monkeypatch):
    before = good_file.read_bytes()
    _crash_mid_write(monkeypatch, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        branchyard.save(_program(2.0), good_file)
    assert good_file.read_bytes() == before
    assert _leftovers(good_file.parent) == []


def test_unsaveable_program_leaves_the_old_file(good_file):
    from torch._higher_order_ops import switch

    class Pick(torch.nn.Module):
        def forward(self, i, x):
            return switch(i, [lambda t: t + 1, lambda t: t - 1], (x,))

    ep = torch.export.export(Pick(), (torch.tensor(0), torch.zeros(2)))
    (sw,) = [n for n in ep.graph.nodes if n.target is torch.ops.higher_order.switch]
    sw.args = (sw.args[0], [], sw.args[2])  # zero branches
    before = good_file.read_bytes()
    with pytest.raises(SerializationError, match="zero branches"):
        branchyard.save(ep, good_file)
    assert good_file.read_bytes() == before
    assert _leftovers(good_file.parent) == []


def test_successful_save_replaces_and_keeps_permissions(good_file):
    os.chmod(good_file, 0o640)
    branchyard.save(_program(5.0), good_file)
    assert stat.S_IMODE(os.stat(good_file).st_mode) == 0o640
    torch.testing.assert_close(branchyard.load(good_file).module()(torch.zeros(2)), torch.full((2,), 5.0))
    assert _leftovers(good_file.parent) == []


def test_archive_layout_is_what_torch_writes(tmp_path):
    """The temporary file has the target's name, so the archive's root folder
    is the one torch.export.save gives."""
    ours, theirs = tmp_path / "a" / "net.pt2", tmp_path / "b" / "net.pt2"
    ours.parent.mkdir()
    theirs.parent.mkdir()
    ep = _program()
    branchyard.save(ep, ours)
    torch.export.save(ep, theirs)
    mine = {n for n in zipfile.ZipFile(ours).namelist() if "branchyard" not in n}
    assert mine == set(zipfile.ZipFile(theirs).namelist())


def test_concurrent_saves_leave_one_complete_file(tmp_path):
    path = tmp_path / "model.pt2"
    programs = [_program(float(k)) for k in range(4)]
    errors = []

    def save(ep):
        try:
            for _ in range(3):
                branchyard.save(ep, path)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=save, args=(ep,)) for ep in programs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    value = branchyard.load(path).module()(torch.zeros(2))[0].item()
    assert value in {0.0, 1.0, 2.0, 3.0}
    assert _leftovers(tmp_path) == []


# --- the CLI -------------------------------------------------------------------------


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("branchyard: error: ")
    return err[0]


def test_rewrite_in_place_that_fails_keeps_the_input(good_file, monkeypatch, capsys):
    before = good_file.read_bytes()
    _crash_mid_write(monkeypatch)
    assert main(["rewrite", str(good_file), "-o", str(good_file), "--passes", "switch_to_cond"]) == 1
    assert "disk on fire" in _one_line(capsys)
    assert good_file.read_bytes() == before


def test_rewrite_to_a_directory_is_a_clear_error(good_file, tmp_path, capsys):
    out = tmp_path / "outdir"
    out.mkdir()
    assert main(["rewrite", str(good_file), "-o", str(out), "--passes", "switch_to_cond"]) == 1
    line = _one_line(capsys)
    assert "directory" in line and "outdir" in line and "enforce fail" not in line


def test_save_to_a_directory_is_a_clear_error(tmp_path):
    with pytest.raises(SerializationError, match=r"is a directory"):
        branchyard.save(_program(), tmp_path)


def test_inspect_a_directory_says_so(tmp_path, capsys):
    assert main(["inspect", str(tmp_path)]) == 1
    line = _one_line(capsys)
    assert "is a directory" in line and "no such file" not in line


def test_a_zip_that_is_not_a_pt2_is_named(tmp_path, capsys):
    path = tmp_path / "photos.pt2"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("holiday/beach.jpg", b"\xff\xd8")
        z.writestr("holiday/notes.txt", b"sunny")
    with pytest.raises(SerializationError, match=r"photos\.pt2.*zip archive but not a \.pt2.*beach\.jpg"):
        branchyard.load(path)
    assert main(["inspect", str(path)]) == 1
    line = _one_line(capsys)
    assert "not a .pt2" in line and "Please check the warnings above" not in line


@pytest.mark.parametrize("content", [b"", b"not a zip at all", b"PK\x03\x04 truncated"])
def test_garbage_is_named(tmp_path, content):
    path = tmp_path / "junk.pt2"
    path.write_bytes(content)
    with pytest.raises(SerializationError, match=r"junk\.pt2.*not a readable \.pt2"):
        branchyard.load(path)


def test_deep_json_is_a_serialization_error(good_file, tmp_path):
    """A 100k-deep JSON document in place of the program."""
    src = zipfile.ZipFile(good_file)
    path = tmp_path / "deep.pt2"
    with zipfile.ZipFile(path, "w") as z:
        for info in src.infolist():
            data = src.read(info.filename)
            if info.filename.endswith("models/model.json"):
                data = b"[" * 100_000 + b"]" * 100_000
            z.writestr(info.filename, data)
    with pytest.raises(SerializationError, match=r"deep\.pt2.*model\.json is not valid JSON"):
        branchyard.load(path)
