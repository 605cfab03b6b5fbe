"""Development shim: the package ``shardscope`` of *this checkout*.

Installed, ``shardscope`` is the namespace holding ``shardscope.core`` and ``shardscope.tui``
(pyproject.toml maps the folders core/ and tui/ to them). In a checkout the folders sit at the
root, and an editable install (``pip install -e .``) points at one checkout only: several
checkouts (git worktrees) sharing one virtualenv would all run the code of the one installed.
This regular package, found on ``sys.path`` before the editable install's finder (which
setuptools appends to ``sys.meta_path`` after the path-based finder), makes ``shardscope`` the
checkout root that holds this file, so ``shardscope.core`` is ``<root>/core`` and
``shardscope.tui`` is ``<root>/tui``.

tests/conftest.py puts its folder (tests/shim) first on ``sys.path`` and on ``PYTHONPATH``, so
the tests, ``python -m shardscope.tui.cli`` subprocesses, torchrun workers and
``torch.multiprocessing`` spawn children (which unpickle ``shardscope.core...`` functions) all
import this checkout. bench/ and screenshots/ scripts do the same. By hand, from a checkout:
``PYTHONPATH=tests/shim python -m shardscope.tui.cli ...``. It is never installed (the wheel
holds core/ and tui/ only).
"""

from pathlib import Path

#: the checkout's root: shardscope.core -> <root>/core, shardscope.tui -> <root>/tui
__path__ = [str(Path(__file__).resolve().parents[3])]
