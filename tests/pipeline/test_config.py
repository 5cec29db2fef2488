"""Config loading: YAML + dotted overrides, and errors that name the key and what is allowed."""

from pathlib import Path

import pytest
import yaml

from draftsmith.pipeline.config import ConfigError, RunConfig, load_config, save_config

REPO = Path(__file__).resolve().parents[2]


def test_every_shipped_recipe_loads():
    recipes = sorted((REPO / "configs").glob("*.yaml"))
    assert recipes, "configs/ has no recipe"
    for path in recipes:
        cfg = load_config(path)
        assert cfg.name == yaml.safe_load(path.read_text()).get("name", path.stem)


def test_overrides_are_typed_and_nested(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("model: {target: smollm2-135m-instruct}\ngenerate: {temperature: 0.0}\n")
    cfg = load_config(
        path,
        [
            "generate.temperature=0.7",
            "generate.synth.min_chars=5",
            "data.sources=[{builtin: mtbench}]",
            "collect.aux_layer_ids=[1,2,3]",
        ],
    )
    assert cfg.generate.temperature == 0.7
    assert cfg.generate.synth.min_chars == 5
    assert cfg.data.sources[0].builtin == "mtbench"
    assert cfg.collect.aux_layer_ids == [1, 2, 3]
    assert cfg.name == "r"  # defaults to the file stem
    assert cfg.run_path == Path("runs/r")


@pytest.mark.parametrize(
    "override, needles",
    [
        ("generate.temprature=1", ["generate.temprature", "temperature", "top_p"]),  # typo: allowed keys listed
        ("generate.temperature=hot", ["generate.temperature", "valid number", "'hot'"]),
        ("generate.temperature=-1", ["generate.temperature", "greater than or equal to 0"]),
        ("data.overlong=drop", ["data.overlong", "'truncate' or 'skip'"]),
        ("data.sources=[{builtin: mtbench, path: x.jsonl}]", ["data.sources.0", "exactly one of builtin / path / hf"]),
        ("data.sources=[{builtn: mtbench}]", ["data.sources.0.builtn", "builtin", "domain_field"]),
        ("bogus.key=1", ["'bogus'", "allowed here", "generate"]),
        ("model.dtype=fp8", ["model.dtype", "bfloat16"]),
        # engines concatenate aux layers in ascending layer order: another order would permute fc's columns silently
        ("collect.aux_layer_ids=[27,2,15]", ["collect.aux_layer_ids", "strictly ascending", "[2, 15, 27]"]),
        ("train.dspark.aux_layer_ids=[3,3]", ["train.dspark.aux_layer_ids", "strictly ascending"]),
    ],
)
def test_errors_name_the_key_and_what_is_allowed(override, needles):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    msg = str(info.value)
    for needle in needles:
        assert needle in msg, f"{needle!r} missing from: {msg}"


def test_malformed_overrides_and_files(tmp_path):
    with pytest.raises(ConfigError, match="key.path=value"):
        load_config(None, ["generate.temperature"])
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(bad)
    bad.write_text("generate: {temperature: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_saved_config_round_trips(tmp_path):
    cfg = load_config(
        None,
        [
            "generate.temperature=0.5",
            "data.sources=[{path: a.jsonl, schema: conversations}]",
            "train.drafters=[eagle3, dspark]",
            "train.dspark.block_size=4",
        ],
    )
    save_config(cfg, tmp_path / "config.yaml")
    again = load_config(tmp_path / "config.yaml")
    assert again.dump() == cfg.dump()
    assert again.data.sources[0].schema_ == "conversations"


def test_every_field_is_documented():
    def walk(model, prefix=""):
        for name, field in model.model_fields.items():
            assert field.description, f"{prefix}{name} has no docstring"
            ann = field.annotation
            for sub in [ann, *getattr(ann, "__args__", ())]:
                if isinstance(sub, type) and hasattr(sub, "model_fields"):
                    walk(sub, f"{prefix}{name}.")

    walk(RunConfig)
    from draftsmith.pipeline.families import FAMILIES

    for name, family in FAMILIES.items():  # the sections `train.<family>`, typed by the registry
        walk(family.settings, f"train.{name}.")


@pytest.mark.parametrize("override, key", [("train.lr=-1", "train.lr"), ("eval.temperatures=[x]", "eval.temperatures")])
def test_a_bad_value_is_explained_by_its_fields_description(override, key):
    """The error cites what the field is for (the first sentence of its docstring), for list items too."""
    from draftsmith.pipeline.config import RunConfig

    section, name = key.split(".")
    description = RunConfig.model_fields[section].annotation.model_fields[name].description
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert f"({key}: {description.split('. ')[0].rstrip('.')}" in " ".join(str(info.value).split())


def test_family_sections_are_typed_and_flat_eagle3_keys_still_read(caplog):
    """Each family's settings are its section `train.<family>`; the EAGLE-3 keys that were once flat under train.*
    are read as train.eagle3.* with a warning, and refused when both spellings are set."""
    from draftsmith.pipeline.families.dspark import DSparkSettings
    from draftsmith.pipeline.families.eagle3 import Eagle3Settings

    cfg = load_config(
        None, ["train.drafters=[eagle3, dspark]", "train.eagle3.ttt_steps=3", "train.dspark.num_layers=2"]
    )
    assert isinstance(cfg.train.section("eagle3"), Eagle3Settings) and cfg.train.section("eagle3").ttt_steps == 3
    assert isinstance(cfg.train.section("dspark"), DSparkSettings) and cfg.train.section("dspark").num_layers == 2
    assert cfg.train.section("eagle3").num_layers == 1  # each family its own defaults
    with caplog.at_level("WARNING"):
        old = load_config(None, ["train.ttt_steps=3", "train.num_layers=2"])
    assert old.train.section("eagle3").ttt_steps == 3 and old.train.section("eagle3").num_layers == 2
    assert "train.ttt_steps is deprecated: write train.eagle3.ttt_steps" in caplog.text
    with pytest.raises(ConfigError, match="train.ttt_steps and train.eagle3.ttt_steps are both set"):
        load_config(None, ["train.ttt_steps=3", "train.eagle3.ttt_steps=4"])
    with pytest.raises(ConfigError, match="unknown families"):
        load_config(None, ["train.drafters=[medusa]"])
