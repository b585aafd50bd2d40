"""The package's top-level API: each public name is the object it stands for, and `import pnmix`
stays light (torch and transformers load only when a name that needs them is asked for)."""

import subprocess
import sys

import pytest

import pnmix
from pnmix import cache, config, errors, generation, layerwise, models, static

PUBLIC = {
    "LayerwiseConfig": lambda: layerwise.LayerwiseConfig,
    "load_config": lambda: layerwise.load_config,
    "PNMixCache": lambda: cache.PNMixCache,
    "PNMixConfig": lambda: config.PNMixConfig,
    "PNMixError": lambda: errors.PNMixError,
    "StaticGenerator": lambda: static.StaticGenerator,
    "generate": lambda: generation.generate,
    "load_model": lambda: models.load,
    "preset": lambda: config.preset,
}


def test_all_lists_the_public_names_and_dir_shows_them():
    assert sorted(pnmix.__all__) == sorted(PUBLIC)
    assert set(PUBLIC) <= set(dir(pnmix))


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_each_public_name_is_the_object_it_stands_for(name):
    assert getattr(pnmix, name) is PUBLIC[name]()


def test_from_import_and_unknown_names():
    from pnmix import PNMixCache, StaticGenerator, generate, load_model, preset  # noqa: F401

    with pytest.raises(AttributeError, match="no_such_name"):
        pnmix.no_such_name  # noqa: B018


def test_import_pnmix_does_not_import_torch_or_transformers():
    code = (
        "import sys\n"
        "import pnmix\n"
        "from pnmix import PNMixConfig, preset\n"
        "preset('pnmix-paper')\n"
        "heavy = sorted(m for m in ('torch', 'transformers') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
        "pnmix.PNMixCache\n"
        "assert 'torch' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-P", "-c", code], check=True, timeout=120)
