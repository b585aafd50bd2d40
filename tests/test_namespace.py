"""pnmix claims one top-level import name: the folders kernels/, tuner/, storage/ and api/ install as
pnmix.kernels, pnmix.tuner, pnmix.storage and pnmix.api (pyproject.toml), so another installed
package of a generic name (Hugging Face's `kernels`, any `api`) is never shadowed."""

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
        "import pnmix.kernels, pnmix.tuner.space, pnmix.storage.orm, pnmix.api.app, pnmix.storage.migrations as m\n"
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
