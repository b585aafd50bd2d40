"""The checkout's folders never stand in for installed packages of the same name.

`kernels/`, `tuner/`, `storage/` and `api/` are the subpackages `pnmix.kernels`, ... (pyproject.toml's
package mapping). A command run with the repository root on `sys.path` (`python -m pytest`, `python -c`,
a script in the root) would also find them as the top-level packages `kernels`, `tuner`, ... and shadow
whatever is installed under that name: current transformers imports Hugging Face's `kernels`. Each
folder's `__init__` calls `stand_aside` when it is imported under its bare name: the package installed
under that name is loaded in its place (the import system returns what `sys.modules` holds once the
module has run), or, with none installed, the import fails as it would outside the checkout.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys


def stand_aside(name: str, init_file: str) -> None:
    """Replaces the checkout's folder `name` (whose `__init__.py` is `init_file`) in `sys.modules` with
    the installed package of that name; ModuleNotFoundError when none is installed."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(init_file)))
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != root]
    spec = importlib.machinery.PathFinder.find_spec(name, path)
    if spec is None or spec.loader is None:
        raise ModuleNotFoundError(f"No module named {name!r} (the checkout's {name}/ is pnmix.{name})", name=name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
