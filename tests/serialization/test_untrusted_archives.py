"""Loading a .pt2 never runs code from it unless the caller says it trusts the file.

One crafted archive per row of ``branchyard.serialization.CODE_PATHS``: each
carries a payload that, if torch ran it, would create a marker file (a
pickle whose ``__reduce__`` calls ``open(marker, "w")``, a sympy string or a
guard that does the same, or a recorder patched over a loader torch would
call). The tests assert that ``branchyard.load`` and ``branchyard inspect``
refuse the file with a SerializationError that names the entry and how to
opt in, and that no marker appeared.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

import branchyard
from branchyard.cli import main
from branchyard.errors import SerializationError
from branchyard.serialization import CODE_PATHS

CRAFTED: list[str] = []  # names of the crafted files built (the report counts them)


class Evil:
    """Unpickling this creates ``marker``: the stand-in for os.system."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _torch_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def rewrite(src: Path, dst: Path, edit=lambda name, data: data, add: dict[str, bytes] | None = None) -> Path:
    """Copy the .pt2 ``src`` to ``dst`` entry by entry; ``edit(name, data)``
    gets each entry's name below the archive root and returns new bytes or
    None to drop it; ``add`` adds entries (names below the root)."""
    with zipfile.ZipFile(src) as zin:
        root = zin.namelist()[0].split("/")[0]
        with zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zout:
            for info in zin.infolist():
                name = info.filename.split("/", 1)[1]
                new = edit(name, zin.read(info.filename))
                if new is not None:
                    zout.writestr(info.filename, new)
            for name, data in (add or {}).items():
                zout.writestr(f"{root}/{name}", data)
    CRAFTED.append(dst.name)
    return dst


def edit_json(entry: str, change):
    """An ``edit`` for :func:`rewrite` applying ``change(doc)`` to one JSON entry."""

    def edit(name, data):
        if name != entry:
            return data
        doc = json.loads(data)
        change(doc)
        return json.dumps(doc).encode()

    return edit


class WithWeightAndConstant(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))
        self.c = torch.tensor([10.0, 20.0, 30.0])  # a plain tensor attribute: a lifted constant

    def forward(self, x):
        return x * self.w + self.c + x.shape[0]


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("good") / "good.pt2"
    ep = torch.export.export(WithWeightAndConstant(), (torch.ones(3),))
    branchyard.save(ep, path)
    return path


@pytest.fixture(scope="module")
def dynamic(tmp_path_factory) -> Path:
    """A program with a symbolic size, so its JSON holds sympy expressions."""
    class M(torch.nn.Module):
        def forward(self, x):
            return x.reshape(-1) * x.shape[0]

    ep = torch.export.export(M(), (torch.ones(4),), dynamic_shapes={"x": {0: torch.export.Dim("b", min=2, max=64)}})
    path = tmp_path_factory.mktemp("dyn") / "dyn.pt2"
    branchyard.save(ep, path)
    return path


def _weights_config(doc):
    return doc["config"]


# --- one builder per CODE_PATHS row: (good archive, dst, marker) -> crafted path ------


def craft_sample_inputs(good, dynamic, dst, marker):
    return rewrite(good, dst, lambda n, d: _torch_bytes(((Evil(marker),), {})) if n == "data/sample_inputs/model.pt" else d)


def craft_weight_pickle(good, dynamic, dst, marker):
    files = {}

    def mark(doc):
        for meta in doc["config"].values():
            meta["use_pickle"] = True
            files[meta["path_name"]] = True

    out = rewrite(good, dst.with_suffix(".tmp.pt2"), edit_json("data/weights/model_weights_config.json", mark))
    return rewrite(out, dst, lambda n, d: _torch_bytes(Evil(marker)) if n.startswith("data/weights/weight_") else d)


def craft_weights_legacy(good, dynamic, dst, marker):
    return rewrite(good, dst, add={"data/weights/model.pt": _torch_bytes({"w": Evil(marker)})})


def craft_constant_pickle(good, dynamic, dst, marker):
    def mark(doc):
        for meta in doc["config"].values():
            meta["use_pickle"] = True

    out = rewrite(good, dst.with_suffix(".tmp.pt2"), edit_json("data/constants/model_constants_config.json", mark))
    return rewrite(out, dst, lambda n, d: _torch_bytes(Evil(marker)) if n.startswith("data/constants/tensor_") else d)


def craft_constants_legacy(good, dynamic, dst, marker):
    return rewrite(good, dst, add={"data/constants/model.pt": _torch_bytes({"c": Evil(marker)})})


def _object_constant(prefix):
    def craft(good, dynamic, dst, marker):
        def add_entry(doc):
            doc["config"]["obj"] = {"path_name": f"{prefix}0", "is_param": False, "use_pickle": True,
                                    "tensor_meta": None}

        out = rewrite(good, dst.with_suffix(".tmp.pt2"), edit_json("data/constants/model_constants_config.json", add_entry))
        return rewrite(out, dst, add={f"data/constants/{prefix}0": pickle.dumps(Evil(marker))})

    return craft


craft_custom_object = _object_constant("custom_obj_")
craft_opaque_object = _object_constant("opaque_obj_")


def craft_sym_expr(good, dynamic, dst, marker):
    def inject(doc):
        stack = [doc]
        while stack:
            obj = stack.pop()
            if isinstance(obj, dict):
                if "Symbol(" in str(obj.get("expr_str", "")):
                    obj["expr_str"] = f"(__import__('builtins').open({marker!r}, 'w').close() or {obj['expr_str']})"
                    return
                stack.extend(obj.values())
            elif isinstance(obj, list):
                stack.extend(obj)
        raise AssertionError("no symbolic expression to tamper with")

    return rewrite(dynamic, dst, edit_json("models/model.json", inject))


def craft_guards_code(good, dynamic, dst, marker):
    def inject(doc):
        doc["guards_code"] = [f"__import__('builtins').open({marker!r}, 'w') is not None"]

    return rewrite(good, dst, edit_json("models/model.json", inject))


def craft_aoti(good, dynamic, dst, marker):
    return rewrite(good, dst, add={"data/aotinductor/model/model.wrapper.so": b"\x7fELF not really",
                                   "data/aotinductor/model/model_metadata.json": b"{}"})


def craft_legacy_archive(good, dynamic, dst, marker):
    """The pre-2.7 layout: serialized_*.pt payloads next to the program JSON."""
    from torch._export.serde.schema import SCHEMA_VERSION

    with zipfile.ZipFile(good) as z:
        program = z.read(next(n for n in z.namelist() if n.endswith("models/model.json")))
    with zipfile.ZipFile(dst, "w") as z:
        z.writestr("version", ".".join(map(str, SCHEMA_VERSION)))
        z.writestr("serialized_exported_program.json", program)
        z.writestr("serialized_state_dict.pt", _torch_bytes({}))
        z.writestr("serialized_constants.pt", _torch_bytes({"c": Evil(marker)}))
        z.writestr("serialized_example_inputs.pt", _torch_bytes(((torch.ones(3),), {})))
    CRAFTED.append(dst.name)
    return dst


BUILDERS = {row.name: globals()[f"craft_{row.name}"] for row in CODE_PATHS}


class Recorder:
    """Stands in for a native loader torch would call; records the calls."""

    calls: list = []

    def __init__(self, *args, **kwargs):
        Recorder.calls.append(("init", args))
        raise RuntimeError("recorder")

    @staticmethod
    def load_metadata_from_package(*args):
        Recorder.calls.append(("load_metadata_from_package", args))
        raise RuntimeError("recorder")


@pytest.fixture()
def recorders(monkeypatch):
    """Native loaders torch would call on custom objects and AOTI libraries, recorded."""
    Recorder.calls = []
    monkeypatch.setattr(torch._C._aoti, "AOTIModelPackageLoader", Recorder)

    def pickle_load_obj(data):
        Recorder.calls.append(("_pickle_load_obj", len(data)))
        return pickle.loads(data)  # what a torchbind unpickler may do: run the payload

    monkeypatch.setattr(torch._C, "_pickle_load_obj", pickle_load_obj)
    return Recorder.calls


def test_every_code_path_has_a_crafted_archive():
    assert set(BUILDERS) == {row.name for row in CODE_PATHS}
    assert len(CODE_PATHS) >= 11


@pytest.mark.parametrize("row", CODE_PATHS, ids=lambda r: r.name)
def test_crafted_archive_runs_nothing_and_says_why(row, good, dynamic, tmp_path, recorders):
    marker = tmp_path / "marker"
    crafted = BUILDERS[row.name](good, dynamic, tmp_path / f"{row.name}.pt2", str(marker))
    try:
        program = branchyard.load(crafted)
    except SerializationError as exc:
        text = str(exc)
        assert f"{row.name}.pt2" in text
        assert "trusted=True" in text and "--trust" in text
        if row.name not in ("legacy_archive",):
            assert any(part in text for part in (row.entry.split(" ")[0].split("<")[0], "guard", "symbolic")), text
    else:
        # Only an AOTInductor library may be present and simply not read.
        assert row.name == "aoti"
        out = program.module()(torch.ones(3))
        torch.testing.assert_close(out, torch.tensor([14.0, 25.0, 36.0]))
    assert not marker.exists(), f"{row.name}: loading ran code from the file"
    assert recorders == [], f"{row.name}: loading called {recorders}"


def test_what_torch_export_load_does_with_the_same_files(good, dynamic, tmp_path, recorders):
    """The threat is real: plain torch.export.load runs the payloads of the
    unpickling rows (so the crafted files are not harmless by accident)."""
    ran = []
    for name in ("sample_inputs", "weight_pickle", "weights_legacy", "constant_pickle", "opaque_object",
                 "sym_expr", "guards_code"):
        marker = tmp_path / f"marker-{name}"
        crafted = BUILDERS[name](good, dynamic, tmp_path / f"torch-{name}.pt2", str(marker))
        try:
            torch.export.load(crafted).module()(torch.ones(3 if name != "sym_expr" else 4))
        except Exception:
            pass
        ran.append(marker.exists())
    assert all(ran), ran


def test_cli_inspect_refuses_in_one_line(good, dynamic, tmp_path, capsys):
    marker = tmp_path / "marker"
    crafted = craft_sample_inputs(good, dynamic, tmp_path / "sent-to-me.pt2", str(marker))
    assert main(["inspect", str(crafted)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("branchyard: error: ")
    assert "sent-to-me.pt2" in err[0] and "sample inputs" in err[0] and "--trust" in err[0]
    assert not marker.exists()


def test_cli_inspect_as_a_process_runs_nothing(good, dynamic, tmp_path):
    marker = tmp_path / "marker"
    crafted = craft_opaque_object(good, dynamic, tmp_path / "sent.pt2", str(marker))
    root = str(Path(branchyard.__file__).resolve().parents[1])
    done = subprocess.run([sys.executable, "-m", "branchyard", "inspect", str(crafted)], cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": root, "PYTHONWARNINGS": "ignore"},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert "opaque_obj_0" in done.stderr and "--trust" in done.stderr
    assert not marker.exists()


# --- a legitimate archive that needs pickle ------------------------------------------


@dataclasses.dataclass
class Point:
    x: torch.Tensor
    y: torch.Tensor


torch.export.register_dataclass(Point, serialized_type_name="branchyard_tests.Point")


class AddPoint(torch.nn.Module):
    def forward(self, p: Point):
        return p.x * 2 + p.y


@pytest.fixture(scope="module")
def needs_pickle(tmp_path_factory) -> Path:
    """A file torch.export.save writes for a dataclass input: its sample
    inputs pickle the dataclass, which weights_only=True does not allow."""
    path = tmp_path_factory.mktemp("legit") / "point.pt2"
    torch.export.save(torch.export.export(AddPoint(), (Point(torch.ones(2), torch.zeros(2)),)), path)
    return path


def test_legit_archive_that_needs_pickle_is_refused_by_default(needs_pickle):
    with pytest.raises(SerializationError, match=r"point\.pt2.*sample inputs.*Point.*trusted=True"):
        branchyard.load(needs_pickle)


def test_trusted_loads_a_legit_archive_that_needs_pickle(needs_pickle):
    program = branchyard.load(needs_pickle, trusted=True)
    assert isinstance(program.example_inputs[0][0], Point)
    out = program.module()(Point(torch.tensor([1.0, 2.0]), torch.tensor([10.0, 20.0])))
    torch.testing.assert_close(out, torch.tensor([12.0, 24.0]))


def test_cli_trust_flag_loads_it(needs_pickle, capsys):
    assert main(["inspect", str(needs_pickle)]) == 1
    assert "--trust" in capsys.readouterr().err
    assert main(["inspect", "--trust", str(needs_pickle)]) == 0
    assert "point.pt2" in capsys.readouterr().out


def test_safe_load_matches_torch_on_ordinary_files(good, dynamic):
    """The default reader gives what torch.export.load gives for files that
    need no trust: weights, constants, symbolic ranges, sample inputs."""
    for path, x in ((good, torch.ones(3)), (dynamic, torch.arange(5.0))):
        mine, theirs = branchyard.load(path), torch.export.load(path)
        assert mine.state_dict.keys() == theirs.state_dict.keys()
        assert mine.constants.keys() == theirs.constants.keys()
        assert str(mine.range_constraints) == str(theirs.range_constraints)
        torch.testing.assert_close(mine.example_inputs, theirs.example_inputs)
        torch.testing.assert_close(mine.module()(x), theirs.module()(x))
        assert [n.format_node() for n in mine.graph.nodes] == [n.format_node() for n in theirs.graph.nodes]


@pytest.mark.parametrize("text", [
    "Symbol('s0', positive=True, integer=True)",
    "Mul(Integer(3), Symbol('s77', positive=True, integer=True))",
    "Max(1, s0) + FloorDiv(s1, 2)",
    "Piecewise((1, s0 > 2), (0, True))",
    "-oo",
])
def test_plain_symbolic_expressions_pass(text):
    from branchyard.serialization.archive import check_sym_expr

    assert check_sym_expr(text) is None


@pytest.mark.parametrize("text", [
    "__import__('os').system('true')",
    "Symbol('x').__class__",
    "sympify('1')",
    "Poly('x + 1; import os')",
    "lambdify(x, y)",
    "open",
    "(lambda: 1)()",
    "[x for x in (1,)]",
])
def test_code_in_symbolic_expressions_is_refused(text):
    from branchyard.serialization.archive import check_sym_expr

    assert check_sym_expr(text) is not None


@pytest.mark.parametrize("text, ok", [
    ("L['x'].size()[0] <= 64", True),
    ("math.floor(L['x'].size()[0] / 2) == 3", True),
    ("torch.save(L['x'], 'f')", False),
    ("__import__('os')", False),
    ("L['x'] == 'a\"+open(1)+\"'", False),
    ("L['x'].__class__", False),
])
def test_guard_grammar(text, ok):
    from branchyard.serialization.archive import check_guard

    assert (check_guard(text) is None) == ok


def test_a_node_calling_a_python_function_is_refused(good, tmp_path):
    """A graph node whose target is ``torch.os.system`` (the deserializer
    resolves ``torch.*`` names with getattr) never reaches a caller: torch's
    verifier, which load runs, allows only operators."""
    marker = tmp_path / "marker"

    def change(doc):
        doc["verifiers"] = []
        node = next(n for n in doc["graph_module"]["graph"]["nodes"] if n["target"] == "torch.ops.aten.mul.Tensor")
        node["target"] = "torch.os.system"
        node["inputs"] = [{"name": "command", "arg": {"as_string": f"touch {marker}"}, "kind": 1}]

    crafted = rewrite(good, tmp_path / "system.pt2", edit_json("models/model.json", change))
    with pytest.raises(SerializationError, match=r"system\.pt2.*not an allowed operator"):
        branchyard.load(crafted).module()(torch.ones(3))
    assert not marker.exists()
