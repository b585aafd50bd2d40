"""Our top-level `kernels` package must not be taken for Hugging Face's `kernels` package."""

import subprocess
import sys


def test_transformers_does_not_mistake_our_kernels_package():
    code = (
        "import sys, transformers\n"
        "from transformers.utils.import_utils import is_kernels_available\n"
        "assert not is_kernels_available(), 'transformers thinks our kernels/ is HF kernels'\n"
        "from transformers import AutoModelForCausalLM, LlamaConfig\n"
        "import transformers.integrations.hub_kernels\n"
        "assert 'kernels' not in sys.modules, 'transformers imported our kernels package'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
