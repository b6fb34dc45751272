"""MkDocs hooks: pages generated from the repository at build time.

``contributing.md`` is ``CONTRIBUTING.md`` of the repository root (one text, shown on GitHub and
in the site; its ``docs/`` links are made relative to the site).

``docs/api/configs.md`` holds the marker ``<!-- config-fields -->``; at build time it is replaced
by one table per dataclass of ``tandemrl/configs/`` (field, type, default, the ``help`` metadata),
so the page can never drift from the dataclasses. A field without ``help`` fails the build.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import typing
from pathlib import Path
from typing import Any

MARKER = "<!-- config-fields -->"


def _config_classes() -> list[type]:
    import tandemrl.configs as pkg

    classes: list[type] = []
    for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda m: m.name):
        if info.ispkg:
            continue
        module = importlib.import_module(f"{pkg.__name__}.{info.name}")
        for obj in vars(module).values():
            if isinstance(obj, type) and dataclasses.is_dataclass(obj) and obj.__module__ == module.__name__:
                classes.append(obj)
    # Sections whose dataclass lives outside configs/ (e.g. api's GenerationHyperparameters).
    for cls in classes:
        for f in dataclasses.fields(cls):
            kind = _section_class(cls, f)
            if kind is not None and kind not in classes:
                classes.append(kind)
    return classes


def _section_class(cls: type, field: dataclasses.Field) -> type | None:
    hint = typing.get_type_hints(cls)[field.name]
    kinds = [a for a in (typing.get_args(hint) or (hint,)) if isinstance(a, type) and dataclasses.is_dataclass(a)]
    return kinds[0] if len(kinds) == 1 else None


def _type_name(tp: Any) -> str:
    text = tp if isinstance(tp, str) else getattr(tp, "__name__", repr(tp))
    return str(text).replace("typing.", "").replace("|", "\\|")


def _default(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        value = repr(field.default)
    elif field.default_factory is not dataclasses.MISSING:
        made = field.default_factory()
        value = repr(made) if not dataclasses.is_dataclass(made) else f"{type(made).__name__}()"
    else:
        return "required"
    value = value if len(value) <= 60 else value[:57] + "..."
    return "`" + value.replace("|", "\\|").replace("`", "'") + "`"


def _section_help(cls: type, field: dataclasses.Field) -> str | None:
    """A field that holds another config dataclass is a YAML section: point at its table."""
    kind = _section_class(cls, field)
    if kind is None:
        return None
    hint = typing.get_type_hints(cls)[field.name]
    name = kind.__name__
    optional = " (optional: null leaves it out)" if type(None) in typing.get_args(hint) else ""
    return f"Section{optional}: the fields of [{name}](#{name.lower()})."


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def config_tables() -> str:
    """Markdown: a section per config dataclass with a row per field."""
    out: list[str] = []
    for cls in _config_classes():
        out.append(f"## {cls.__name__}\n")
        out.append(f"`{cls.__module__}.{cls.__name__}`\n")
        doc = (cls.__doc__ or "").strip()
        if doc and not doc.startswith(f"{cls.__name__}("):
            out.append(_cell(doc) + "\n")
        out.append("| field | type | default | help |")
        out.append("| --- | --- | --- | --- |")
        for f in dataclasses.fields(cls):
            help_text = f.metadata.get("help") or _section_help(cls, f)
            if not help_text:
                raise ValueError(f"{cls.__module__}.{cls.__name__}.{f.name} has no help metadata")
            out.append(f"| `{f.name}` | `{_type_name(f.type)}` | {_default(f)} | {_cell(help_text)} |")
        out.append("")
    return "\n".join(out)


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    root = Path(config["config_file_path"]).parent
    text = (root / "CONTRIBUTING.md").read_text(encoding="utf-8").replace("](docs/", "](")
    files.append(File.generated(config, "contributing.md", content=text))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if MARKER in markdown:
        return markdown.replace(MARKER, config_tables())
    return markdown
