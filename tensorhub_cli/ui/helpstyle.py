"""How `th --help` writes parameters: the conventions of other operator CLIs.

Protocol: every `th` group is a ``ThGroup``; the commands it hands out are turned
into ``ThCommand``s as they are looked up (``get_command``), so a command added
anywhere with a plain ``@app.command()`` gets the same help. Differences from typer's
own rendering: a flag shows no value placeholder (``--json``, not ``--json <bool>``),
an option without a metavar of its own shows its name upper case (``--role ROLE``, not
``--role <str>``), and the usage line names arguments by their metavar, upper case, optional ones in
brackets (``th up FILE``, ``th versions [MODEL]``), not ``{file}``. Parsing is
untouched.
"""

from __future__ import annotations

from typer.core import TyperArgument, TyperCommand, TyperGroup


def _conventional(params: list) -> list:
    for param in params:
        if isinstance(param, TyperArgument) and param.metavar is None:
            param.metavar = param.name.upper()
        elif getattr(param, "is_flag", False) and getattr(param, "metavar", None) is None:
            param.metavar = ""  # typer would print <bool> where a flag takes no value
        elif param.param_type_name == "option" and param.metavar is None:
            param.metavar = param.name.upper()  # as argparse does: --role ROLE, not --role <str>
    return params


class ThCommand(TyperCommand):
    def get_params(self, ctx):
        return _conventional(super().get_params(ctx))

    def collect_usage_pieces(self, ctx) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        for param in self.get_params(ctx):
            if isinstance(param, TyperArgument):
                name = param.metavar + ("..." if param.nargs != 1 else "")
                pieces.append(name if param.required else f"[{name}]")
        return pieces


class ThGroup(TyperGroup):
    def get_params(self, ctx):
        return _conventional(super().get_params(ctx))

    def get_command(self, ctx, cmd_name):
        command = super().get_command(ctx, cmd_name)
        if type(command) is TyperCommand:
            command.__class__ = ThCommand  # same object, same parsing: only its help is written our way
        return command
