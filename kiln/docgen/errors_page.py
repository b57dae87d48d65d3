"""docs/troubleshooting.md: every error kiln raises with a message, grouped by where it comes from,
read from the source (each `raise SomeError("...")` in kiln/), so a new or reworded error appears
without anyone remembering to add it."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

#: (path prefix inside kiln/, section title) — first match wins, so the specific come first
SECTIONS = (
    ("config/", "Configuration"),
    ("cli/", "Command line"),
    ("task_import.py", "Command line"),
    ("registry.py", "Configuration"),
    ("engine/checkpoint/", "Checkpoints and resume"),
    ("strategies/deepspeed", "DeepSpeed"),
    ("strategies/fsdp", "FSDP"),
    ("strategies/xla", "XLA"),
    ("strategies/", "Strategies, devices and launching"),
    ("accelerators/", "Strategies, devices and launching"),
    ("precision/", "Precision"),
    ("engine/data/", "Data"),
    ("optim/", "Optimizers and schedulers"),
    ("engine/evaluation/", "Evaluation and prediction"),
    ("engine/loop/evaluat", "Evaluation and prediction"),  # evaluate.py, evaluation.py
    ("engine/loop/fit_evaluation.py", "Evaluation and prediction"),
    ("engine/loop/prediction_step.py", "Evaluation and prediction"),
    ("engine/hp_search.py", "Hyperparameter search"),
    ("engine/callbacks/", "Callbacks"),
    ("loggers/", "Loggers"),
    ("plot.py", "Loggers"),
    ("engine/", "Training"),
    ("utils/", "Checkpoints and resume"),
)


@dataclass(frozen=True)
class RaiseSite:
    section: str
    error: str
    message: str
    where: str  # module:function


def _text(node: ast.AST) -> str | None:
    """The message as a reader sees it: literal text, with `{expression}` where a value goes."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        parts = []
        for value in node.values:
            if isinstance(value, ast.Constant):
                parts.append(str(value.value))
            else:
                assert isinstance(value, ast.FormattedValue)
                parts.append("{" + ast.unparse(value.value) + "}")
        return "".join(parts)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _text(node.left), _text(node.right)
        if left is not None and right is not None:
            return left + right
    return None


def _error_name(call: ast.Call) -> str | None:
    func = call.func
    name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
    return (
        name
        if name and (name.endswith(("Error", "Exit", "Interrupted", "Detected", "Failed")) or name == "TrialPruned")
        else None
    )


def raise_sites(package: Path) -> list[RaiseSite]:
    sites: list[RaiseSite] = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package).as_posix()
        if rel.startswith("docgen/"):
            continue
        section = next((title for prefix, title in SECTIONS if rel.startswith(prefix)), "Other")
        module = "kiln/" + rel
        tree = ast.parse(path.read_text())
        for func in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))] + [tree]:
            body = (
                func.body
                if not isinstance(func, ast.Module)
                else [n for n in tree.body if not isinstance(n, (ast.FunctionDef, ast.ClassDef))]
            )
            for node in _own_nodes(body):
                if not (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)):
                    continue
                error = _error_name(node.exc)
                if error is None or not node.exc.args:
                    continue
                message = _text(node.exc.args[0])
                if message is None and error in ("SystemExit", "AttributeError"):
                    continue  # an exit code, or Python's own attribute protocol: nothing to look up
                if message is None:
                    message = f"(built at run time from `{ast.unparse(node.exc.args[0])}`)"
                where = f"{module}:{func.name}" if not isinstance(func, ast.Module) else module
                sites.append(RaiseSite(section, error, message, where))
    return sites


def _own_nodes(body: list[ast.stmt]) -> Iterator[ast.AST]:
    """Nodes of a function body, not descending into nested functions (they are visited themselves)."""
    nested = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
    stack: list[ast.AST] = [node for node in body if not isinstance(node, nested)]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(child for child in ast.iter_child_nodes(node) if not isinstance(child, nested))


def _cell(text: str) -> str:
    """Markdown for a table cell: pipes escaped everywhere; outside `code spans` also the characters that
    would start HTML, emphasis, links or headings (inside a span a backslash would show)."""
    parts = " ".join(text.split()).replace("|", "\\|").split("`")
    for i in range(0, len(parts), 2):
        for char, escaped in (("<", "&lt;"), ("*", "\\*"), ("_", "\\_"), ("[", "\\["), ("#", "\\#")):
            parts[i] = parts[i].replace(char, escaped)
    return "`".join(parts)


def troubleshooting_markdown(package: Path) -> str:
    sites = sorted(set(raise_sites(package)), key=lambda s: (s.section, s.where, s.error, s.message))
    order = list(dict.fromkeys(title for _, title in SECTIONS)) + ["Other"]
    out = [
        "# Troubleshooting",
        "",
        "Every error kiln raises with a message, generated by `python -m kiln.docgen` from the `raise` statements",
        "in `kiln/` (a test fails when this page is stale). kiln's rule is that the message itself names the",
        "problem and the fix, so find your message here (search the page for a word of it) to see which part of",
        "kiln raised it; `{name}` marks a value filled in at run time. Errors are grouped by where they come",
        "from; the pages linked in each section explain the feature.",
        "",
        "Most errors are one of these types, all importable from `kiln` or `kiln.utils.errors`:",
        "",
        "| error | means |",
        "|---|---|",
        "| `ConfigError` | a config key, value or combination is invalid ([config reference](config.md)) |",
        "| `CapabilityError` | the strategy, precision and device cannot work together ([choosing a strategy](choosing-a-strategy.md)) |",
        "| `PrecisionError` | the precision cannot work on this machine ([precision](precision.md)) |",
        "| `CheckpointError` | a checkpoint is missing, damaged, unsafe or does not fit the run ([checkpoints](checkpoints.md)) |",
        "| `KilnError` | any other problem you can fix (the base of `CapabilityError` and `CheckpointError`) |",
        "| `UnknownNameError` | a strategy, precision, optimizer, scheduler or logger name that does not exist |",
        "| `RankFailed` | `fit()` failed on another rank, which aborted the process group after a grace period (10 s) so that this rank stops rather than wait until the collective timeout; look at that rank's output ([when a process fails](distributed.md#when-a-process-fails)) |",
        "",
    ]
    for title in order:
        rows = [s for s in sites if s.section == title]
        if not rows:
            continue
        out += [f"## {title}", "", "| error | message | raised in |", "|---|---|---|"]
        out += [f"| `{s.error}` | {_cell(s.message)} | `{s.where}` |" for s in rows]
        out.append("")
    return "\n".join(out).rstrip() + "\n"
