"""pnmix claims one top-level import name: the folders kernels/, tuner/, storage/ and api/ install as
pnmix.kernels, pnmix.tuner, pnmix.storage and pnmix.api (pyproject.toml), so another installed
package of a generic name (Hugging Face's `kernels`, any `api`) is never shadowed."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_only_the_pnmix_name_is_installed(tmp_path):
    """Outside the checkout, the subpackages import under pnmix and no generic name resolves to the
    checkout's folder of that name (`kernels` may be Hugging Face's package, installed beside pnmix,
    in a virtualenv that may itself sit inside the checkout)."""
    code = (
        "import importlib.util, pathlib, sys\n"
        "import pnmix.kernels, pnmix.tuner.search.space, pnmix.storage.orm, pnmix.api.app\n"
        "import pnmix.storage.migrations as m\n"
        f"root = pathlib.Path({str(ROOT)!r})\n"
        "assert m.ALEMBIC_DIR.joinpath('env.py').is_file(), m.ALEMBIC_DIR\n"
        "for name in ('kernels', 'tuner', 'storage', 'api'):\n"
        "    spec = importlib.util.find_spec(name)\n"
        "    assert spec is None or root / name not in pathlib.Path(spec.origin or '').parents, (name, spec)\n"
        "from transformers import AutoModelForCausalLM, LlamaConfig\n"
        "import transformers.integrations.hub_kernels\n"
        "mod = sys.modules.get('kernels')\n"
        "assert mod is None or root / 'kernels' not in pathlib.Path(mod.__file__ or '').parents, mod\n"
    )
    subprocess.run([sys.executable, "-P", "-c", code], check=True, timeout=120, cwd=tmp_path)


def test_the_storage_packages_lazy_names_are_its_public_names():
    """`pnmix.storage` lists its names three times (for mypy, for loading, `__all__`): every public
    name loads, and no list holds one the others lack."""
    import pnmix.storage as storage

    assert set(storage.__all__) == set(storage._LAZY)
    for name in storage.__all__:
        assert getattr(storage, name) is not None, name


def test_python_from_the_root_sees_the_installed_packages_not_the_folders():
    """With the repository root on sys.path (`python -c`, `python -m pytest` from the root) the
    folders kernels/, tuner/, storage/ and api/ stand aside (pnmix/shadow.py): `kernels` is Hugging
    Face's package where it is installed, the others are no importable name, and pnmix's own
    subpackages are the folders."""
    code = (
        "import importlib.metadata, pathlib\n"
        "import pnmix, pnmix.kernels\n"
        f"root = pathlib.Path({str(ROOT)!r})\n"
        "assert pathlib.Path(pnmix.kernels.__file__).parent == root / 'kernels', pnmix.kernels.__file__\n"
        "try:\n"
        "    importlib.metadata.distribution('kernels')  # Hugging Face's, which current transformers installs\n"
        "except importlib.metadata.PackageNotFoundError:\n"
        "    pass\n"
        "else:\n"
        "    import kernels\n"
        "    assert root / 'kernels' not in pathlib.Path(kernels.__file__).parents, kernels.__file__\n"
        "for name in ('tuner', 'storage', 'api'):\n"
        "    try:\n"
        "        mod = __import__(name)\n"
        "    except ModuleNotFoundError:\n"
        "        continue\n"
        "    assert root / name not in pathlib.Path(mod.__file__).parents, mod.__file__\n"
        "import transformers.integrations.hub_kernels\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                           "tests/test_errors.py"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and " passed" in done.stdout, (done.stdout[-2000:], done.stderr[-2000:])
