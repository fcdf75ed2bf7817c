"""``k3train/hf/`` is a format translator below the trainer: none of its library modules imports
``k3train.trainer`` (the trainer's restore, export and import modules call into hf, not the
reverse). ``hf/commands.py`` is the CLI's and moves to ``k3train/commands/``."""
import ast
from pathlib import Path

import k3train.hf

LIBRARY = ["__init__.py", "export.py", "load.py", "names.py"]


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
    return out


def test_hf_library_modules_do_not_import_the_trainer():
    root = Path(k3train.hf.__file__).parent
    found = {name: sorted(m for m in _imports(root / name) if m.startswith("k3train.trainer")) for name in LIBRARY}
    assert found == {name: [] for name in LIBRARY}
    # the check can fail: the trainer's import module does import hf
    assert "k3train.hf.load" in _imports(root.parent / "trainer" / "hf_import.py")
