import ast
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.multiproc import run_multiprocess


def _allreduce_sum(rank, world_size):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    assert t.item() == world_size * (world_size + 1) / 2


def _fail_on_rank_one(rank, world_size):
    assert rank != 1, "rank one fails on purpose"


@pytest.mark.slow
def test_allreduce_over_gloo():
    run_multiprocess(_allreduce_sum, 2)


@pytest.mark.slow
def test_child_failure_reaches_parent():
    with pytest.raises(AssertionError, match="rank one fails on purpose"):
        run_multiprocess(_fail_on_rank_one, 2)


def _import_time_environment_reads(tree: ast.AST) -> list[int]:
    """Line numbers of ``os.environ`` / ``getenv`` uses that run when the module is imported:
    anywhere but inside a function body (decorators and default values run at import)."""
    found: list[int] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for part in [*node.decorator_list, *node.args.defaults, *node.args.kw_defaults]:
                if part is not None:
                    visit(part)
            return
        if isinstance(node, ast.Lambda):
            return
        if (isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "environb")) or \
                (isinstance(node, ast.Name) and node.id in ("environ", "getenv")):
            found.append(node.lineno)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def test_preloaded_packages_read_the_environment_only_when_called():
    """tests/multiproc.py's forkserver imports k3train (and moe, optim, pipeline) before a rank
    takes its test's environment: a module that read the environment at import would see the
    server's, not the test's. None does."""
    root = Path(__file__).resolve().parents[1]
    files = [p for pkg in ("k3train", "moe", "optim", "pipeline") for p in sorted((root / pkg).rglob("*.py"))]
    assert len(files) > 50
    offenders = {str(p.relative_to(root)): lines for p in files
                 if (lines := _import_time_environment_reads(ast.parse(p.read_text())))}
    assert offenders == {}, f"environment read at import time (file: lines): {offenders}"
    # The check sees what it looks for (a negative control).
    assert _import_time_environment_reads(ast.parse("import os\nMODE = os.environ.get('X')\n")) == [2]
    assert _import_time_environment_reads(ast.parse("import os\ndef f(m=os.getenv('X')):\n    pass\n")) == [2]
    assert _import_time_environment_reads(ast.parse("import os\ndef f():\n    return os.environ['X']\n")) == []
