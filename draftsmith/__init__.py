"""draftsmith: train speculative-decoding drafters (EAGLE-3, DSpark-style) for a target LLM and ship them to vLLM / SGLang.

The installed package is one namespace. The repository keeps its folders at the top level and the build maps
them in (`pyproject.toml`, `[tool.setuptools.package-dir]`):

- `draftsmith.drafters`: model math (drafter architectures, losses, objectives, the draft vocabulary);
- `draftsmith.data`: conversations, chat templates, feature stores;
- `draftsmith.eval`: the exact verifier and decoding engine;
- `draftsmith.pipeline`: the stages (prepare, generate, collect, train, eval, export) and the CLI.
"""

__version__ = "0.1.0"
