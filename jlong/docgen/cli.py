"""The command-line reference, from the parser itself (`jlong.cli.build_parser`): every subcommand with its help
and description, and every argument with its help, default and choices."""

from __future__ import annotations

import argparse

from jlong.docgen.markdown import GENERATED, anchored, code, paragraph, table


def subcommands(parser: argparse.ArgumentParser) -> dict[str, tuple[argparse.ArgumentParser, str]]:
    """Each subcommand's parser and one-line help, in the parser's order."""
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    helps = {choice.dest: choice.help for choice in action._choices_actions}
    return {name: (sub, helps.get(name) or "") for name, sub in action.choices.items()}


def arguments(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """A subcommand's arguments, positionals first, without --help."""
    actions = [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]
    return [a for a in actions if not a.option_strings] + [a for a in actions if a.option_strings]


def argument_names(action: argparse.Action) -> list[str]:
    """How the command line writes an argument: its option strings, or a positional's name."""
    return list(action.option_strings) or [action.metavar or action.dest]


def _takes(action: argparse.Action) -> str:
    """What an argument takes, as its usage writes it."""
    if action.nargs == 0:
        return "flag"
    metavar = action.metavar or (action.dest.upper() if action.option_strings else action.dest)
    if isinstance(metavar, tuple):
        metavar = " ".join(metavar)
    if action.type is not None and action.nargs is None:
        metavar = f"{metavar} ({action.type.__name__})"
    return {"+": f"{metavar} ...", "*": f"[{metavar} ...]", "?": f"[{metavar}]"}.get(action.nargs, metavar)


def _default(action: argparse.Action) -> str:
    if action.required and action.option_strings:
        return "required"
    default = action.default
    if default is None or default is False or default == [] or default == argparse.SUPPRESS:
        return ""
    return code(default)


def _anchor(command: str, action: argparse.Action) -> str:
    return f"{command}-{action.option_strings[0].lstrip('-') if action.option_strings else action.dest}"


def cli_page() -> str:
    from jlong.cli import build_parser

    parser = build_parser()
    commands = subcommands(parser)
    out = [
        "# Command line\n",
        GENERATED.format(source="`jlong.cli.build_parser`"),
        f"`jlong <command> ...`: {paragraph(parser.description)} Every user error ends as one line on stderr and "
        "exit status 2, before anything compiles. A command that reads a config takes overrides "
        "(`section.key=value`, see [the configuration](config.md)) after the config, before or after its "
        "options.\n",
        table(["command", "what it does"], [[f"[{code(name)}](#{name})", help_] for name, (_, help_) in
                                             commands.items()]),
    ]
    for name, (sub, help_) in commands.items():
        out.append(f"## jlong {name} {{ #{name} }}\n")
        out.append(f"{paragraph(sub.description) or paragraph(help_[:1].upper() + help_[1:]) + '.'}\n")
        usage = " ".join(sub.format_usage().split()).removeprefix("usage: ")
        out.append(f"```\n{usage}\n```\n")
        rows = []
        for action in arguments(sub):
            names = ", ".join(argument_names(action))
            choices = ", ".join(map(code, action.choices)) if action.choices else ""
            rows.append([anchored(names, _anchor(name, action)), _takes(action), _default(action), choices,
                         action.help or ""])
        out.append(table(["argument", "takes", "default", "choices", "description"], rows))
    return "\n".join(out)
