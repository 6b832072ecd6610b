"""ckpt's on-disk names have one owner (``ckpt._layout``); the layout issue's ckpt rules."""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

import pytest

from ckpt import _layout

CKPT = Path(__file__).resolve().parent.parent / "ckpt"
NAMES = {"manifest.json", "upload-status.json", "latest", ".lock", "data.bin"}
SPELLING = re.compile(r"step-$|step-\\d|step-\(|\.tmp-|\.del-|rank-\{|rank-$")


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        first = body[0] if isinstance(body, list) and body else None
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
            out.add(id(first.value))
    return out


def _fault_args(tree: ast.AST) -> set[int]:
    """Constants passed to ``_faults.*``: fault-point names, not file names."""
    out = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "_faults"
        ):
            out |= {id(a) for a in node.args}
    return out


def _spellings(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    skip = _docstrings(tree) | _fault_args(tree)
    found = []
    for node in ast.walk(tree):
        text = node.value if isinstance(node, ast.Constant) else None
        if (
            isinstance(text, str)
            and id(node) not in skip
            and (text in NAMES or SPELLING.search(text))
        ):
            found.append(f"{path.name}:{node.lineno}: {text!r}")
    return found


def test_only_layout_spells_on_disk_names() -> None:
    """Every ``step-N``, ``.tmp-``, ``.del-``, ``latest``, ``.lock``, manifest, status and data
    file name in ckpt is spelled in ``ckpt/_layout.py`` and nowhere else."""
    files = sorted(CKPT.rglob("*.py"))
    assert len(files) > 10
    found = [s for f in files if f.name != "_layout.py" for s in _spellings(f)]
    assert found == []


@pytest.mark.parametrize("step", [0, 1, 7, 10, 123456789])
def test_step_names_round_trip(step: int, tmp_path: Path) -> None:
    name = _layout.step_name(step)
    assert _layout.step_number(name) == step and _layout.is_step_name(name)
    assert _layout.step_dir(tmp_path, step) == tmp_path / name
    assert _layout.latest_step(_layout.latest_text(step)) == step
    assert _layout.step_id(name) == step


@pytest.mark.parametrize(
    "name", ["step-05", "step-", "step--1", "step-1\n", "step-\u0661", "step-1.tmp-1-ab", "Step-1"]
)
def test_step_number_is_canonical(name: str) -> None:
    assert _layout.step_number(name) is None and not _layout.is_step_name(name)


def test_dcp_step_id_keeps_its_looser_rule() -> None:
    """A DCP ``checkpoint_id`` ``DIR/step-05`` has always named step 5 (unchanged)."""
    assert _layout.step_id("step-05") == 5
    assert _layout.step_id("step-x") is None and _layout.step_id("step-") is None


def test_temporary_and_retired_names_are_recognised() -> None:
    base = _layout.step_name(3)
    for tmp in (_layout.tmp_name(base), _layout.tmp_name(base, "dcp"), _layout.tmp_name("latest")):
        assert _layout.LEFTOVER.match(tmp) and _layout.step_number(tmp) is None
    assert _layout.tmp_pid(_layout.tmp_name(base), base) == os.getpid()
    assert _layout.tmp_pid(_layout.tmp_name(base, "dcp"), base) is None
    retired = _layout.del_name(base)
    assert _layout.LEFTOVER.match(retired) and _layout.is_retired(retired, base)
    m = _layout.RETIRED.match(retired)
    assert m is not None and m.group(1) == base
    assert _layout.tmp_name(base) != _layout.tmp_name(base)  # random part
    assert not _layout.LEFTOVER.match(_layout.LATEST) and not _layout.LEFTOVER.match(base)


def _calls(path: Path, module: str, name: str) -> int:
    tree = ast.parse(path.read_text())
    return sum(
        isinstance(n, ast.Attribute)
        and n.attr == name
        and isinstance(n.value, ast.Name)
        and n.value.id == module
        for n in ast.walk(tree)
    )


@pytest.mark.parametrize("module", ["retention/retainer.py", "cli.py", "tiers/remote_retention.py"])
def test_one_retention_rule(module: str) -> None:
    """The manager (its ``ckpt.retention.retainer``), ``ckpt gc`` and the remote tier's
    ``keep_last_remote`` all decide through ``ckpt.retention.rules.plan``; none slices its own list
    of steps to keep."""
    assert _calls(CKPT / module, "rules", "plan") >= 1


def _format_dicts(path: Path) -> list[int]:
    """Lines of dict literals with a ``"format"`` key (hand-built manifest bodies)."""
    tree = ast.parse(path.read_text())
    return [
        n.lineno
        for n in ast.walk(tree)
        if isinstance(n, ast.Dict)
        and any(isinstance(k, ast.Constant) and k.value == "format" for k in n.keys)
    ]


def test_one_manifest_builder_and_one_chunked_writer() -> None:
    """Manifest bodies are built by ``format.new_manifest`` only, and dcp writes its data files
    through ``format.ChunkedWriter`` (no pwrite of its own)."""
    built = {f.name: _format_dicts(f) for f in sorted(CKPT.rglob("*.py"))}
    assert {k: v for k, v in built.items() if v} == {"manifest.py": built["manifest.py"]}
    assert len(built["manifest.py"]) == 1
    assert _calls(CKPT / "dcp.py", "os", "pwrite") == 0
    assert _calls(CKPT / "dcp.py", "fmt", "ChunkedWriter") == 1
    for module in ("saving/pipeline.py", "dcp.py", "simple.py"):
        assert _calls(CKPT / module, "fmt", "new_manifest") == 1


@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 4097, 3 * 4096 + 5])
def test_chunked_writer_agrees_with_write_file(size: int, tmp_path: Path) -> None:
    """Streamed in odd pieces, ``ChunkedWriter`` writes the bytes and record ``write_file`` does."""
    from ckpt import format as fmt

    data = os.urandom(size)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    want = fmt.write_file(tmp_path / "a" / "x.bin", memoryview(data), chunk_bytes=4096)
    out = fmt.ChunkedWriter(tmp_path / "b" / "x.bin", 4096)
    for lo in range(0, size, 1000):
        out.write(memoryview(data)[lo : lo + 1000])
    got = out.close()
    assert got == want and (tmp_path / "b" / "x.bin").read_bytes() == data
    fmt.verify_file(tmp_path / "b", got)


def test_new_manifest_round_trips(tmp_path: Path) -> None:
    from ckpt import format as fmt

    rec = fmt.write_file(tmp_path / _layout.DATA_FILE, memoryview(b""))
    tree = {"t": "dict", "items": []}
    for created in (None, 12.5):
        body = fmt.new_manifest(
            step=3, nbytes=0, tree=tree, entries=[], files=[rec], created=created
        )
        assert body["format"] == "ckpt" and body["version"] == fmt.FORMAT_VERSION
        assert ("created" in body) is (created is not None) and body["metadata"] == {}
        fmt.write_manifest(tmp_path, body)
        assert fmt.read_manifest(tmp_path) == body


def test_no_ckpt_module_reaches_into_a_manager() -> None:
    """Outside ``ckpt/manager.py`` no module touches a manager's private attributes
    (``manager._ensure_writer()`` in ``ckpt.dcp`` did): tests/test_layers.py rule 3 in spirit."""
    root = Path(__file__).resolve().parent.parent
    found = []
    for path in sorted(root.glob("ckpt/**/*.py")):
        if path.name == "manager.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and "manager" in ast.unparse(node.value)
            ):
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    assert found == []
