"""Turn whatever the user hands over (a TrainingConfig, dict, YAML path, DictConfig, `key=value`
overrides) into one validated, typed `DictConfig`, with one clear sentence for each bad input."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Union

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from kiln.config import conflicts, redact, trl_packing
from kiln.config.hf import aliases, dialect
from kiln.config.hf import args as hf_args
from kiln.config.hf import deepspeed as hf_deepspeed
from kiln.config.hf import xla as hf_xla
from kiln.config.remote_dir import place_output_dir
from kiln.config.schema import TrainingConfig
from kiln.config.schema.strategy import StrategyConfig
from kiln.utils.errors import ConfigError

ConfigSource = Union[None, TrainingConfig, DictConfig, Mapping[str, Any], str, "os.PathLike[str]"]


def valid_keys() -> list[str]:
    """Every dotted key of the tree plus every accepted HF flat name (for suggestions)."""
    keys: list[str] = []

    def walk(obj: Any, prefix: str) -> None:
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(value):
                walk(value, f"{prefix}{f.name}.")
            else:
                keys.append(prefix + f.name)

    walk(TrainingConfig(), "")
    return keys + sorted(set(aliases.PATHS) | set(aliases.REWRITES))


def _set_path(tree: dict[str, Any], path: str, value: Any) -> None:
    parts = path.split(".")
    node = tree
    for part in parts[:-1]:
        nxt = node.setdefault(part, {})
        if not isinstance(nxt, dict):
            nxt = node[part] = {"name": nxt} if part in ("strategy", "precision", "optim", "scheduler") else {}
        node = nxt
    node[parts[-1]] = value


def _unknown(key: str) -> ConfigError:
    close = difflib.get_close_matches(key, valid_keys(), n=1, cutoff=0.6)
    if not close:
        leaf = key.rsplit(".", 1)[-1]
        close = [k for k in valid_keys() if k.rsplit(".", 1)[-1] == leaf][:1]
    hint = f" Did you mean {close[0]!r}?" if close else " Run `kiln fit --help` for the valid keys."
    return ConfigError(f"Unknown config key {key!r}.{hint}")


_EXAMPLES = {"strategy": "ddp", "precision": "bf16 or 16", "optim": "adamw_torch", "scheduler": "cosine"}
_STRATEGY_FIELDS = {f.name for f in dataclasses.fields(StrategyConfig)}


def normalise(raw: Mapping[str, Any]) -> dict[str, Any]:
    """Rewrite HF flat names and shorthand (`strategy: ddp`) into the nested tree layout."""
    tree: dict[str, Any] = {}
    aliased: dict[str, tuple[str, Any]] = {}  # path -> the HF name (and its value) that set it
    explicit = None  # the `strategy` entry that names one, as (key, value, name)
    picks: list[tuple[str, Any]] = []  # HF's arguments that pick a strategy (deepspeed, fsdp, ...) and their values
    groups = {f.name for f in dataclasses.fields(TrainingConfig)}
    for key, value in trl_packing.pair(raw).items():
        key = str(key)
        explicit = conflicts.explicit_strategy(key, value) or explicit
        if "." in key:  # a dotted key such as optim.lr from a dotlist
            head = key.split(".", 1)[0]
            if head not in groups:
                raise _unknown(key)
            _set_path(tree, key, value)
        elif key in groups and aliases.is_alias(key) and not isinstance(value, Mapping):
            _set_alias(tree, aliased, picks, key, value)  # HF's `activation_checkpointing: true`, not the section
        elif key in groups and isinstance(value, Mapping):
            for sub_key, sub_value in value.items():
                _set_path(tree, f"{key}.{sub_key}", sub_value)
        elif key == "precision" and _precision_word(value) is not None:  # `precision: 16` reads as an int
            _set_path(tree, "precision.name", _precision_word(value))
        elif key in ("strategy", "precision", "optim", "scheduler") and isinstance(value, str):
            _set_path(tree, f"{key}.name", value)
        elif key in ("strategy", "precision", "optim", "scheduler") and value is not None:
            raise ConfigError(
                f"Config key {key!r} takes a name (e.g. {_EXAMPLES[key]}) or a mapping with `name:`, got {value!r}."
            )
        elif key in groups:
            _set_path(tree, key, value)
        elif aliases.is_alias(key):
            _set_alias(tree, aliased, picks, key, value)
        else:
            raise _unknown(key)
    conflicts.settle_strategy(tree, explicit, picks)  # `strategy: ddp` with `deepspeed: ...` is refused
    # `strategy: {name: fsdp, sharding: full_shard}`: keys the StrategyConfig lacks are strategy options
    strat = tree.get("strategy")
    if isinstance(strat, dict):
        extra = {k: strat.pop(k) for k in list(strat) if k not in _STRATEGY_FIELDS}
        if extra:
            strat.setdefault("options", {}).update(extra)
    hf_xla.route_xla_fsdp(tree)  # HF's fsdp + fsdp_config.xla: true
    prec = tree.get("precision")
    if isinstance(prec, dict) and _precision_word(prec.get("name")) is not None:
        prec["name"] = _precision_word(prec["name"])
    # YAML 1.1 reads a bare `no` as False: `save.strategy=no` on the command line means "no".
    for group in ("eval", "save", "log"):
        node = tree.get(group)
        if isinstance(node, dict) and node.get("strategy") is False:
            node["strategy"] = "no"
    save = tree.get("save")
    if isinstance(save, dict) and "async" in save:  # `async` is a Python keyword, so the field is async_save
        spelled = save.pop("async")
        if "async_save" in save and save["async_save"] != spelled:  # neither may win silently
            raise ConfigError(
                f"save.async ({spelled!r}) and save.async_save ({save['async_save']!r}) are one setting given "
                "two values; keep one of them."
            )
        save["async_save"] = spelled
    if isinstance(tree.get("log", {}).get("report_to"), str):
        tree["log"]["report_to"] = [tree["log"]["report_to"]]
    return tree


def _set_alias(
    tree: dict[str, Any], aliased: dict[str, tuple[str, Any]], picks: list[tuple[str, Any]], key: str, value: Any
) -> None:
    """Rewrite the HF flat name `key` into the tree (`picks` collects the ones that choose a strategy)."""
    try:
        rewritten = aliases.rewrite(key, value)
        for path, v in rewritten.items():
            _check_conflict(tree, aliased, path, key, value, v)
            _set_path(tree, path, v)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if rewritten and key in conflicts.HF_STRATEGY_ARGS:
        picks.append((key, value))


def _precision_word(value: Any) -> Any:
    """The precision name YAML or the command line turned into a number or boolean (`16`, `32`,
    `no`), as the string the registry knows; None for anything else."""
    if value is False:
        return "no"
    if isinstance(value, int) and not isinstance(value, bool) or isinstance(value, float) and value.is_integer():
        return str(int(value))
    return None


def _check_conflict(
    tree: dict[str, Any], aliased: dict[str, tuple[str, Any]], path: str, key: str, value: Any, new: Any
) -> None:
    """Two HF names that set one key differently (`fp16: true` with `bf16: true`) are refused, as HF
    does, instead of the later one winning silently. A flat name over a nested key (`{**config,
    "learning_rate": x}` over `optim: {lr: ...}`) is an override and stays allowed."""
    if path not in aliased:
        aliased[path] = (key, value)
        return
    node: Any = tree
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            aliased[path] = (key, value)
            return
        node = node[part]
    if node != new:
        other, other_value = aliased[path]
        raise conflicts.different(other, other_value, key, value, path, node, new)
    aliased[path] = (key, value)


def _to_plain(source: ConfigSource) -> dict[str, Any]:
    if source is None:
        return {}
    if isinstance(source, TrainingConfig):
        return _resolved(OmegaConf.structured(source), "The TrainingConfig")
    if isinstance(source, DictConfig):
        return _resolved(source, "The config")
    if isinstance(source, Mapping):
        redact.remember(source)
        return dict(source)
    if hf_args.is_training_arguments(source):  # Trainer(model, args=TrainingArguments(...))
        return hf_args.training_arguments_to_dict(source)
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if not os.path.isfile(path):
            raise ConfigError(f"Config file {path!r} does not exist.")
        try:
            loaded = OmegaConf.load(path)
        except Exception as err:  # yaml syntax errors come in many types
            raise ConfigError(f"Config file {path!r} is not valid YAML: {err}") from None
        if not isinstance(loaded, DictConfig):
            raise ConfigError(f"Config file {path!r} must hold a mapping of keys to values.")
        return _resolved(loaded, f"Config file {path!r}")
    raise ConfigError(
        f"Config must be a TrainingConfig, transformers TrainingArguments, dict, DictConfig or YAML path, not {type(source).__name__}."
    )


def _resolved(tree: DictConfig, what: str) -> dict[str, Any]:
    """`tree` as plain containers with its interpolations resolved, remembering the environment values
    they read (saved configs and logged hyperparameters show `${oc.env:VAR}` instead: kiln.config.redact)."""
    redact.remember(OmegaConf.to_container(tree, resolve=False))
    try:
        return OmegaConf.to_container(tree, resolve=True)  # type: ignore[return-value]
    except OmegaConfBaseException as err:
        raise _unresolvable(err, what) from None


def _unresolvable(err: OmegaConfBaseException, what: str, key: str = "") -> ConfigError:
    """One sentence for an interpolation that cannot be resolved (an unset variable, above all)."""
    key = key or getattr(err, "full_key", None) or "?"
    first = str(err).splitlines()[0]
    missing = re.search(r"Environment variable '([^']+)' not found", first)
    if missing:
        name = missing.group(1)
        return ConfigError(
            f"{what} sets {key!r} from the environment variable {name}, which is not set: export {name}, or "
            f"give a default with ${{oc.env:{name},DEFAULT}}."
        )
    return ConfigError(f"{what} sets {key!r} to an interpolation that cannot be resolved ({first}).")


def parse_dotlist(overrides: Iterable[str]) -> dict[str, Any]:
    """`["learning_rate=1e-3", "train.max_steps=10"]` -> a dict, values parsed as YAML."""
    out: dict[str, Any] = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"Override {item!r} must look like key=value (e.g. learning_rate=1e-3).")
        key, _, text = item.partition("=")
        redact.remember(text)
        try:
            value = OmegaConf.from_dotlist([f"v={text}"])["v"] if text != "" else None
            out[key.strip()] = OmegaConf.to_container(value, resolve=True) if isinstance(value, DictConfig) else value
        except OmegaConfBaseException as err:
            raise _unresolvable(err, "An override", key.strip()) from None
    return out


def load_config(source: ConfigSource = None, overrides: Sequence[str] | Mapping[str, Any] = ()) -> DictConfig:
    """Build the validated config tree from `source`, then apply `overrides` on top. The tree is read-only
    (OmegaConf's flag): code reads it and never writes into it; a changed config is a new `load_config(old,
    overrides)`."""
    try:
        try:
            return _load(source, overrides)
        except OmegaConfBaseException as err:  # an interpolation of a mapping source, resolved while validating
            raise _translate(err) from None
    except ConfigError as err:  # a value read from the environment is named by its variable, never shown
        err.args = (redact.mask(str(err)),)
        raise


@functools.lru_cache(maxsize=1)
def _schema_tree() -> DictConfig:
    """The schema with its defaults as a tree, built once: OmegaConf.structured walks every dataclass (a
    third of a second per Trainer); OmegaConf.merge deep-copies its first argument, so this is never changed."""
    return OmegaConf.structured(TrainingConfig)


def _load(source: ConfigSource, overrides: Sequence[str] | Mapping[str, Any]) -> DictConfig:
    base = _schema_tree()
    plain = _to_plain(source)
    layers = [normalise(plain)]
    extra = overrides if isinstance(overrides, Mapping) else parse_dotlist(overrides)
    if extra:
        layers.append(normalise(extra))
    cfg: Any = base  # OmegaConf.merge returns any container: checked below
    for layer in layers:
        try:
            cfg = OmegaConf.merge(cfg, layer)
        except OmegaConfBaseException as err:
            raise _translate(err) from None
    assert isinstance(cfg, DictConfig)
    dialect.fill_defaults(cfg, hf=hf_args.is_training_arguments(source) or dialect.is_hf_dialect(plain))
    hf_deepspeed.adopt(cfg)  # kiln values at their defaults take the DeepSpeed config's numbers
    place_output_dir(cfg)  # output_dir: s3://...: a local staging folder, uploaded to the URL
    from kiln.config.validate import validate

    validate(cfg)
    OmegaConf.set_readonly(cfg, True)  # read from here on: what code derives from it is its own value
    return cfg


def _translate(err: OmegaConfBaseException) -> ConfigError:
    key = getattr(err, "full_key", None) or "?"
    msg = str(err).splitlines()[0]
    if "Key '" in msg and "not in" in msg:
        return _unknown(key)
    want = _field_type(key)
    value = getattr(err, "value", None)
    if want and value is not None:
        if key.startswith("save.storage_options"):  # credentials, perhaps
            return ConfigError(f"Config key {key!r} expects {want} (the value is not shown).")
        if names := redact.env_names(value):  # never print what came from the environment (a secret, perhaps)
            source = " and ".join(f"${{oc.env:{name}}}" for name in names)
            return ConfigError(
                f"Config key {key!r} expects {want}, but it is set from {source}, whose value is not one "
                "(the value is not shown)."
            )
        return ConfigError(f"Config key {key!r} expects {want}, got {value!r}.")
    return ConfigError(f"Config key {key!r}: {msg}")


def _field_type(key: str) -> str:
    """The declared type of a dotted key, as written in the schema ('int', 'Optional[float]')."""
    obj: Any = TrainingConfig()
    parts = key.split(".")
    for part in parts[:-1]:
        obj = getattr(obj, part, None)
        if obj is None:
            return ""
    for f in dataclasses.fields(obj) if dataclasses.is_dataclass(obj) else ():
        if f.name == parts[-1]:
            return str(f.type).replace("typing.", "")
    return ""
