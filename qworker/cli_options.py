"""Command-line options generated from the config dataclasses, as vLLM's `EngineArgs.add_cli_args`
does: a field's name, type, default and help text (`field(metadata={"help": ...})`) live in the
dataclass only, and every command that takes engine or worker settings gets its options from here.

    @app.command()
    @engine_options()                       # --model, --block-size, ... -> engine_config
    @worker_options()                       # --max-backlog, ...         -> settings
    def worker(queue: str | None = None, *, engine_config: EngineConfig, settings: WorkerSettings):
        ...

The decorator removes the keyword-only parameter `into` from the command's signature, puts one
typer option per field in its place (typer reads the signature through `__signature__`), and calls
the command with the built dataclass. Mapping of field types:

    int, float, str        --block-size 16
    bool                   --enable-chunked-prefill/--no-enable-chunked-prefill
    an Enum                a choice of its values: --scheduling-policy [fcfs|priority]
    X | None               an optional option; not given: the field's default (None)
    default_factory        not given: the factory runs (WorkerSettings.name, .log_payloads)
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import types
import typing
from collections.abc import Callable, Collection
from enum import Enum
from typing import Annotated, Any, TypeVar

import typer

from qworker.config import EngineConfig
from qworker.worker.settings import WorkerSettings

F = TypeVar("F", bound=Callable[..., Any])

# Fields that get no option, per dataclass, each with the reason. None today: the worker's name is
# set per process by supervisors and tests, and operators tune the intervals (a slow Redis, a long
# lease), so every field of EngineConfig and WorkerSettings is a `qworker worker` option.
EXCLUDED_FIELDS: dict[type, dict[str, str]] = {EngineConfig: {}, WorkerSettings: {}}

SCALAR_TYPES = (int, float, str, bool)


@dataclasses.dataclass(frozen=True)
class ConfigOption:
    """One dataclass field as a command-line option."""

    field_name: str
    # The field's type with `| None` removed: int, float, str, bool or an Enum subclass.
    value_type: type
    is_optional: bool
    # The field's default; None when it has a default_factory instead.
    default: Any
    has_factory: bool
    help: str

    @property
    def flag(self) -> str:
        return option_flag(self.field_name)

    @property
    def decls(self) -> str:
        """The option's declaration: `--x/--no-x` for a bool, else `--x`."""
        return f"{self.flag}/--no-{self.flag[2:]}" if self.value_type is bool else self.flag


def option_flag(field_name: str) -> str:
    """`max_num_seqs` -> `--max-num-seqs`."""
    return "--" + field_name.replace("_", "-")


def _unwrap_optional(annotation: Any) -> tuple[Any, bool]:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return annotation, False


def config_option_list(
    cls: type, *, only: Collection[str] | None = None, exclude: Collection[str] = ()
) -> list[ConfigOption]:
    """The options of dataclass `cls`, in field order, less EXCLUDED_FIELDS and `exclude`; with
    `only`, just those fields."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    fields = [f for f in dataclasses.fields(cls) if f.init]
    names = {f.name for f in fields}
    unknown = (set(only or ()) | set(exclude)) - names
    if unknown:
        raise ValueError(f"{cls.__name__} has no fields {sorted(unknown)}")
    skipped = set(EXCLUDED_FIELDS.get(cls, {})) | set(exclude)
    hints = typing.get_type_hints(cls)
    options = []
    for f in fields:
        if f.name in skipped or (only is not None and f.name not in only):
            continue
        value_type, is_optional = _unwrap_optional(hints[f.name])
        if not (
            value_type in SCALAR_TYPES or (isinstance(value_type, type) and issubclass(value_type, Enum))
        ):
            raise TypeError(
                f"{cls.__name__}.{f.name}: no command-line form for {hints[f.name]!r}; "
                "exclude it (EXCLUDED_FIELDS, with the reason) or give it a scalar or Enum type"
            )
        help_text = f.metadata.get("help")
        if not help_text:
            raise TypeError(f"{cls.__name__}.{f.name} has no help text: field(metadata={{'help': ...}})")
        has_factory = f.default_factory is not dataclasses.MISSING
        if f.default is dataclasses.MISSING and not has_factory:
            raise TypeError(f"{cls.__name__}.{f.name} has no default; generated options need one")
        options.append(
            ConfigOption(
                field_name=f.name,
                value_type=value_type,
                is_optional=is_optional,
                default=None if has_factory else f.default,
                has_factory=has_factory,
                help=help_text,
            )
        )
    return options


def format_default(value: Any) -> str:
    """A default as the help text and the README show it: none, true, fcfs, 0.5, 16."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Enum):
        return str(value.value)
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _parameter(option: ConfigOption, as_overrides: bool, panel: str | None) -> inspect.Parameter:
    if as_overrides or option.has_factory:
        # Not given: None, so that the dataclass (or the caller's own default) decides.
        annotation: Any = option.value_type | None
        default = None
        show_default: bool | str = (
            False if option.has_factory or option.default is None else format_default(option.default)
        )
    else:
        annotation = option.value_type | None if option.is_optional else option.value_type
        default = option.default.value if isinstance(option.default, Enum) else option.default
        show_default = option.default is not None
    info = typer.Option(option.decls, help=option.help, show_default=show_default, rich_help_panel=panel)
    return inspect.Parameter(
        option.field_name,
        inspect.Parameter.KEYWORD_ONLY,
        default=default,
        annotation=Annotated[annotation, info],
    )


def _build(cls: type, options: list[ConfigOption], given: dict[str, Any], as_overrides: bool) -> Any:
    by_name = {o.field_name: o for o in options}
    if as_overrides:
        values = {k: v for k, v in given.items() if v is not None}
    else:
        values = {k: v for k, v in given.items() if not (v is None and by_name[k].has_factory)}
    try:
        built = cls(**values)
    except (TypeError, ValueError) as exc:
        # typer's own exception class: typer vendors click, so click.UsageError would be a traceback.
        raise typer.BadParameter(f"{exc} ({cls.__name__})") from None
    return values if as_overrides else built


def config_options(
    cls: type,
    *,
    into: str,
    only: Collection[str] | None = None,
    exclude: Collection[str] = (),
    as_overrides: bool = False,
    panel: str | None = None,
) -> Callable[[F], F]:
    """Give a typer command one option per field of dataclass `cls`, and call it with
    `into=cls(...)` built from them. `into` must be a keyword-only parameter of the command (after
    `*`); the options take its place in the signature (and in `--help`).

    as_overrides=True: every option defaults to None (the help still shows the dataclass default),
    and the command gets `into` as a dict of just the fields given on the command line, checked by
    building `cls(**that)`. For commands that pass settings on to something else (a benchmark that
    starts several systems), where "not given" must stay distinct from "given the default".

    A Python caller may pass `into` itself (then no field keywords), or field keywords."""
    options = config_option_list(cls, only=only, exclude=exclude)

    def decorate(command: F) -> F:
        signature = inspect.signature(command, eval_str=True)
        target = signature.parameters.get(into)
        if target is None or target.kind is not inspect.Parameter.KEYWORD_ONLY:
            raise TypeError(
                f"{command.__name__} needs a keyword-only parameter {into!r} for the {cls.__name__}"
            )
        clash = {o.field_name for o in options} & (set(signature.parameters) - {into})
        if clash:
            raise TypeError(
                f"{command.__name__}: parameters {sorted(clash)} clash with {cls.__name__} options; "
                "rename them or pass exclude="
            )
        params: list[inspect.Parameter] = []
        for param in signature.parameters.values():
            if param.name == into:
                params += [_parameter(o, as_overrides, panel) for o in options]
            else:
                params.append(param)

        @functools.wraps(command)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            given = {o.field_name: kwargs.pop(o.field_name) for o in options if o.field_name in kwargs}
            if into in kwargs:
                if given:
                    raise TypeError(
                        f"pass either {into}= or {cls.__name__} fields, not both: {sorted(given)}"
                    )
            else:
                kwargs[into] = _build(cls, options, given, as_overrides)
            return command(*args, **kwargs)

        new_signature = signature.replace(parameters=params)
        wrapper.__signature__ = new_signature  # type: ignore[attr-defined]
        # typer resolves plain annotations through typing.get_type_hints, which reads these.
        wrapper.__annotations__ = {
            p.name: p.annotation for p in params if p.annotation is not inspect.Parameter.empty
        }
        if new_signature.return_annotation is not inspect.Signature.empty:
            wrapper.__annotations__["return"] = new_signature.return_annotation
        return wrapper  # type: ignore[return-value]

    return decorate


def engine_options(
    *,
    into: str = "engine_config",
    only: Collection[str] | None = None,
    exclude: Collection[str] = (),
    as_overrides: bool = False,
) -> Callable[[F], F]:
    """config_options for EngineConfig: `--model`, `--block-size`, ... -> `engine_config`."""
    return config_options(
        EngineConfig, into=into, only=only, exclude=exclude, as_overrides=as_overrides, panel="Engine"
    )


def worker_options(
    *,
    into: str = "settings",
    only: Collection[str] | None = None,
    exclude: Collection[str] = (),
    as_overrides: bool = False,
) -> Callable[[F], F]:
    """config_options for WorkerSettings: `--max-backlog`, `--drain-grace-s`, ... -> `settings`."""
    return config_options(
        WorkerSettings, into=into, only=only, exclude=exclude, as_overrides=as_overrides, panel="Worker"
    )


def config_to_args(
    config: Any, *, only: Collection[str] | None = None, exclude: Collection[str] = ()
) -> list[str]:
    """The flags that make the generated options build `config` again, e.g. to start a
    `qworker worker` subprocess with an EngineConfig: fields at their default are left out; fields
    with a default_factory are always written (their value is not a fixed default)."""
    args: list[str] = []
    for option in config_option_list(type(config), only=only, exclude=exclude):
        value = getattr(config, option.field_name)
        if not option.has_factory and value == option.default:
            continue
        if value is None:
            raise ValueError(
                f"{option.field_name}=None has no command-line form (its default is {option.default!r})"
            )
        if option.value_type is bool:
            args.append(option.flag if value else f"--no-{option.flag[2:]}")
        else:
            args += [option.flag, str(value.value if isinstance(value, Enum) else value)]
    return args
