"""The front door: one module per ``k3train`` command, each with ``HELP`` (its line in
``k3train --help``), ``add_arguments(parser)`` and ``run(args) -> int``; the module docstring is
the command's ``--help`` description. ``k3train/cli.py`` lists them in one table.

Command modules import only argparse-level helpers at module level, so ``k3train --help`` and
argument errors never import torch; each ``run`` imports the library it drives."""
