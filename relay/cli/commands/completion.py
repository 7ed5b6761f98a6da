"""``relay completion SHELL``: the shell completion script, made from the parser itself.

The script is generated (by ``shtab``) from the parser that read the command
line, so every command of the table and every option is completed without a
line written for it here.
"""

from __future__ import annotations

import argparse

from relay.cli.command import Context

SHELLS = ("bash", "zsh")
COMPLETION_DESCRIPTION = """\
Print the completion script for SHELL. To install it:

  bash:  relay completion bash > ~/.local/share/bash-completion/completions/relay
         (or add  eval "$(relay completion bash)"  to ~/.bashrc)
  zsh:   relay completion zsh > "${fpath[1]}/_relay"   then start a new shell
         (or add  eval "$(relay completion zsh)"  to ~/.zshrc, after compinit)"""


def completion_arguments(parser: argparse.ArgumentParser) -> None:
    """The shell."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("shell", choices=SHELLS, help="the shell to complete for")


async def completion(ctx: Context) -> int:
    """Print the completion script for ``ctx.args.shell``."""
    import shtab

    ctx.console.out.write(shtab.complete(ctx.parser, shell=ctx.args.shell))
    ctx.console.out.flush()
    return 0
