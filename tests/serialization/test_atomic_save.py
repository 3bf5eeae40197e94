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
        if isinstance(f, (str, os.PathLike)):
            with open(f, "wb") as fh:
                fh.write(b"PK\x03\x04 half an archive")
        else:
            f.write(b"PK\x03\x04 half an archive")
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
    """The archive is written in memory first, as torch.export.save writes a
    buffer: the records of a direct write under torch's root folder for buffers."""
    ours, theirs = tmp_path / "a" / "net.pt2", tmp_path / "b" / "net.pt2"
    ours.parent.mkdir()
    theirs.parent.mkdir()
    ep = _program()
    branchyard.save(ep, ours)
    torch.export.save(ep, theirs)
    mine = {n.split("/", 1)[1] for n in zipfile.ZipFile(ours).namelist() if "branchyard" not in n}
    assert mine == {n.split("/", 1)[1] for n in zipfile.ZipFile(theirs).namelist()}
    assert torch.export.load(ours).module()(torch.zeros(2)).tolist() == [1.0, 1.0]


_FULL_DISK = """
import resource, signal, sys, torch, branchyard
from branchyard.errors import SerializationError
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as on a full disk
ep = torch.export.export(torch.nn.Linear(256, 256), (torch.zeros(2, 256),))
resource.setrlimit(resource.RLIMIT_FSIZE, (40_000, 40_000))
try:
    branchyard.save(ep, sys.argv[1])
except SerializationError as exc:
    print("caught:", exc)
print("still running")
"""


def test_a_save_that_the_file_system_fails_raises_and_the_process_goes_on(good_file):
    """torch's archive writer aborts the process when a write fails (a full disk)."""
    import subprocess
    import sys

    before = good_file.read_bytes()
    done = subprocess.run([sys.executable, "-c", _FULL_DISK, str(good_file)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "caught: file" in done.stdout and "could not write the program" in done.stdout, done.stdout
    assert "still running" in done.stdout
    assert good_file.read_bytes() == before
    assert _leftovers(good_file.parent) == []


def test_a_write_protected_file_is_not_replaced(good_file, monkeypatch):
    from branchyard.serialization import archive

    before = good_file.read_bytes()
    os.chmod(good_file, 0o444)
    if os.geteuid() == 0:  # root may write any file: ask as a user would
        real = os.access
        monkeypatch.setattr(archive.os, "access", lambda p, mode: False if mode == os.W_OK else real(p, mode))
    with pytest.raises(SerializationError, match="write-protected"):
        branchyard.save(_program(2.0), good_file)
    assert good_file.read_bytes() == before


def test_a_file_name_that_is_not_utf8_saves_and_loads(tmp_path):
    name = os.fsdecode(b"caf\xe9.pt2")
    path = tmp_path / name
    branchyard.save(_program(3.0), path)
    assert os.fsencode(os.listdir(tmp_path)[0]) == b"caf\xe9.pt2"
    torch.testing.assert_close(branchyard.load(path).module()(torch.zeros(2)), torch.full((2,), 3.0))


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


# --- what is at the target: links, devices, FIFOs, folders, long names -----------------


def test_a_symlink_is_written_through_and_stays_a_link(good_file, tmp_path):
    """As a direct write would: the link's target gets the new program."""
    link = tmp_path / "link.pt2"
    link.symlink_to(good_file)
    branchyard.save(_program(5.0), link)
    assert link.is_symlink() and os.readlink(link) == str(good_file)
    torch.testing.assert_close(branchyard.load(good_file).module()(torch.zeros(2)), torch.full((2,), 5.0))
    assert _leftovers(tmp_path) == ["link.pt2"]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_fifo_is_neither_replaced_by_a_save_nor_read_as_a_program(tmp_path, capsys):
    fifo = tmp_path / "pipe.pt2"
    os.mkfifo(fifo)
    with pytest.raises(SerializationError, match=r"pipe\.pt2.*not a regular file \(a FIFO\)"):
        branchyard.save(_program(), fifo)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    with pytest.raises(SerializationError, match=r"pipe\.pt2.*not a regular file"):
        branchyard.load(fifo)
    assert main(["example", "expert-dispatch", "--size", "2", "-o", str(fifo)]) == 1
    assert "not a regular file" in _one_line(capsys) and stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert [p.name for p in tmp_path.iterdir()] == ["pipe.pt2"]


@pytest.mark.skipif(not os.path.exists("/dev/null"), reason="needs /dev/null")
def test_a_device_behind_a_link_is_not_replaced(tmp_path):
    link = tmp_path / "null.pt2"
    link.symlink_to("/dev/null")
    with pytest.raises(SerializationError, match=r"null\.pt2.*not a regular file \(a character device\)"):
        branchyard.save(_program(), link)
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


def test_a_path_ending_in_a_separator_is_a_folder_not_a_file(tmp_path):
    with pytest.raises(SerializationError, match=r"names a folder"):
        branchyard.save(_program(), str(tmp_path / "newdir") + os.sep)
    assert list(tmp_path.iterdir()) == []


def test_a_long_file_name_that_the_folder_takes_is_saved(tmp_path):
    """The temporary folder's name must not be longer than the target's."""
    path = tmp_path / ("a" * (255 - len(".pt2")) + ".pt2")
    branchyard.save(_program(3.0), path)
    torch.testing.assert_close(branchyard.load(path).module()(torch.zeros(2)), torch.full((2,), 3.0))
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


@pytest.mark.parametrize("exc", [KeyError("k"), AttributeError("a"), ImportError("i"), OverflowError("o")])
def test_any_error_in_the_writer_is_a_serialization_error_and_keeps_the_file(good_file, monkeypatch, exc):
    before = good_file.read_bytes()
    _crash_mid_write(monkeypatch, exc)
    with pytest.raises(SerializationError, match=r"model\.pt2.*could not write"):
        branchyard.save(_program(2.0), good_file)
    assert good_file.read_bytes() == before and _leftovers(good_file.parent) == []


def test_a_flipped_byte_in_a_weight_is_refused(good_file, tmp_path):
    """torch's reader does not check the zip's CRCs; the safe reader does."""
    src = zipfile.ZipFile(good_file)
    (weight,) = [i for i in src.infolist() if "/data/weights/weight_" in i.filename]
    raw = bytearray(good_file.read_bytes())
    h = weight.header_offset  # the local header: name and extra-field lengths at 26 and 28, then the bytes
    at = h + 30 + int.from_bytes(raw[h + 26:h + 28], "little") + int.from_bytes(raw[h + 28:h + 30], "little")
    raw[at] ^= 0x40
    path = tmp_path / "flipped.pt2"
    path.write_bytes(bytes(raw))
    with pytest.raises(SerializationError, match=r"flipped\.pt2.*weight_0.*damaged.*CRC"):
        branchyard.load(path)
    torch.testing.assert_close(branchyard.load(good_file).module()(torch.zeros(2)), torch.ones(2))


@pytest.mark.skipif(os.geteuid() == 0 if hasattr(os, "geteuid") else True, reason="root reads any file")
def test_an_unreadable_file_says_permission_denied(good_file):
    good_file.chmod(0)
    with pytest.raises(SerializationError, match="permission denied"):
        branchyard.load(good_file)
