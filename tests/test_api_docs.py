"""The documentation site (docs/conf.py: the guides and the API reference rendered from the docstrings) builds
with every warning an error: a broken link or cross-reference, a public name autodoc cannot import, a docstring
Sphinx cannot read."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

MISSING = [name for name in ("sphinx", "myst_parser") if importlib.util.find_spec(name) is None]


@pytest.mark.skipif(bool(MISSING), reason=f"the docs extra is not installed ({', '.join(MISSING)} missing): "
                                           "pip install -e \".[docs]\"")
def test_the_docs_build_with_warnings_as_errors(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", "-d", str(tmp_path / "doctrees"),
         str(ROOT / "docs"), str(tmp_path / "html")],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-5000:]
    reference = (tmp_path / "html" / "api" / "training.html").read_text(encoding="utf-8")
    assert 'id="moe_jax.training.make_train_step"' in reference   # rendered from the docstrings, not empty
    for page in ("parallelism", "training", "inference", "checkpoints", "multihost", "design", "benchmarks"):
        assert (tmp_path / "html" / f"{page}.html").exists(), page
    models = (tmp_path / "html" / "api" / "models.html").read_text(encoding="utf-8")
    for entry, options in entry_point_options().items():
        described = rendered_parameters(models, f"moe_jax.{entry}")
        missing = [option for option in options if not described.get(option)]
        assert not missing, f"{entry}: options without a rendered description: {missing}"


def entry_point_options() -> dict[str, list[str]]:
    """The keywords of the Auto entry points (the loader's and the model's) and of the model's constructor."""
    import inspect

    from moe_jax.causal_lm import MoeForCausalLM
    from moe_jax.pretrained import from_pretrained

    model_options = [name for name in inspect.signature(MoeForCausalLM.__init__).parameters
                     if name not in ("self", "config", "distributed_config")]
    loading = [name for name in inspect.signature(from_pretrained).parameters
               if name not in ("model_class", "model_kwargs")]
    return {"AutoModelForCausalLM.from_config": ["config", "distributed_config", *model_options],
            "AutoModelForCausalLM.from_pretrained": [*loading, *model_options],
            "causal_lm.MoeForCausalLM.__init__": ["config", "distributed_config", *model_options]}


def rendered_parameters(page: str, object_id: str) -> dict[str, str]:
    """Parameter name -> its description, as the built HTML `page` renders the "Parameters" list of `object_id`."""
    import html
    import re

    start = page.index(f'id="{object_id}"')
    end = page.find('id="moe_jax.', start + 1)
    section = page[start:end if end != -1 else len(page)]
    items = re.findall(r"<li><p><strong>(\w+)</strong>\s*\u2013\s*(.*?)</p>", section, re.S)
    return {name: html.unescape(re.sub(r"<[^>]+>", "", text)).strip() for name, text in items}


def test_the_auto_entry_points_document_every_option_on_one_line():
    """Every keyword of from_pretrained / from_config (the loader's and the model's) has its own line."""
    import inspect

    from moe_jax import AutoModelForCausalLM
    from moe_jax.causal_lm import MoeForCausalLM
    from moe_jax.pretrained import from_pretrained

    model_options = [name for name in inspect.signature(MoeForCausalLM.__init__).parameters
                     if name not in ("self", "config", "distributed_config")]
    loading = [name for name in inspect.signature(from_pretrained).parameters if name not in ("model_class",
                                                                                               "model_kwargs")]
    for method, options in ((AutoModelForCausalLM.from_config, ["config", "distributed_config", *model_options]),
                            (AutoModelForCausalLM.from_pretrained, [*loading, *model_options]),
                            (MoeForCausalLM.__init__, ["config", "distributed_config", *model_options])):
        lines = [line.strip() for line in inspect.getdoc(method).splitlines()]
        for option in options:
            assert sum(line.startswith(f"{option}: ") for line in lines) == 1, (method.__name__, option)
